// A DeltaNet layer keeps a conv and recurrent state, an attention layer keys
// and values: each kind has its own type of per-layer state, so handing a
// layer the other kind's (here the KV cache to the delta rule) does not compile.
use strata::backend::{Backend, DeltaRule, SeqState, Tensor};
use strata::pipeline::batch::PackedBatch;

fn delta_layer<B: Backend>(
    b: &B,
    qkv: &Tensor<B>,
    zba: &Tensor<B>,
    rule: &DeltaRule<'_, B>,
    batch: &PackedBatch,
    state: &mut SeqState<B>,
    out: &mut Tensor<B>,
) {
    let (z, ba) = (zba.cols(0, 256), zba.cols(256, 4));
    b.gated_delta_rule(qkv, z, ba, rule, batch, &mut state.kv, 0, out);
}

fn main() {}
