// The seed's bug: `collective_rpc(..., unique_reply_rank=0)` already returns
// rank 0's reply (the captured states), and the driver indexed it once more
// and sliced tokens out of what it took for one layer: 771 tensors of [512]
// instead of 4 of [512, 7168], on Kimi-K2.5 (DeepSeek-V3 layout, TP 8).
// Here the unique reply is `CapturedStates` itself, which has no `[0]`.
use strata::pipeline::batch::PackedBatch;
use strata::pipeline::capture::CaptureSet;
use strata::model::{Deepseek, RankWorker, TpDeepseek};
use strata::shape::Layers;
use strata::parallel::{HiddenU, Tp};
use typenum::{Prod, U1024, U7, U8};

type Kimi = HiddenU<Prod<U7, U1024>>;

fn generate(model: &TpDeepseek<Kimi, Tp<U8>>, batch: PackedBatch, captures: CaptureSet<Layers<4>>) {
    let captured_states = model
        .rpc_unique(0, move |w: &mut RankWorker<Deepseek<Kimi>>| w.capture(&batch, &captures).unwrap())
        .unwrap();
    let aux_hidden_states = captured_states[0];
    let (offset, seq_len) = (0, 512);
    for h in aux_hidden_states {
        let _ = h.slice_tokens(offset..offset + seq_len);
    }
}

fn main() {}
