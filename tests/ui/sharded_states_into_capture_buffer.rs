// A rank's slice [L, T, 7168/8] handed on as if it were the full residual
// stream [L, T, 7168]: only gathered states can reach a capture buffer or sink.
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;
use strata::model::TpDeepseek;
use strata::shape::{CapturedStates, Layers};
use strata::parallel::{HiddenU, Tp};
use typenum::{Prod, U1024, U7, U8};

type Kimi = HiddenU<Prod<U7, U1024>>;

fn write(_states: CapturedStates<Layers<4>, Kimi>) {}

fn job(model: &TpDeepseek<Kimi, Tp<U8>>, batch: &PackedBatch, captures: &CaptureSet<Layers<4>>) {
    let per_rank = model.forward_sharded(batch, captures).unwrap();
    write(per_rank.into_rank(0));
}

fn main() {}
