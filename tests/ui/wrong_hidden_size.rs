// A tensor-parallel shard's states ([L, T, 7168/8]) handed to code that
// expects full residual states of width 7168.
use strata::shape::{CapturedStates, Hidden, Layers};

fn train_draft(_states: CapturedStates<Layers<4>, Hidden<7168>>) {}

fn main() {
    let shard = CapturedStates::<Layers<4>, Hidden<896>>::zeros(Layers, 512, Hidden);
    train_draft(shard);
}
