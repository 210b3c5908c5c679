// Stacking two samples' captures along layers: [2L, T, H] reads as twice the
// capture points.
use strata::shape::{CapturedStates, Hidden, LayerAxis, Layers};

fn main() {
    let a = CapturedStates::<Layers<4>, Hidden<8>>::zeros(Layers, 3, Hidden);
    let b = a.clone();
    let _ = CapturedStates::concat::<LayerAxis>(&[a, b]);
}
