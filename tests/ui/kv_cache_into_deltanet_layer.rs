// A DeltaNet layer keeps a conv and recurrent state, an attention layer keys
// and values: each kind has its own type of per-layer state, so handing a
// layer the other kind's (here the KV cache to the delta rule) does not compile.
use strata::backend::{Backend, DeltaGates, DeltaRule, LayerState, SeqState, Tensor};
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
    let gates = DeltaGates { z: zba.cols(0, 256), ba: zba.cols(256, 4) };
    b.gated_delta_rule(qkv, gates, rule, batch, LayerState::new(&mut state.kv, 0), out);
}

fn main() {}
