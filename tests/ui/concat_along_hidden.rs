// Joining two captures side by side along hidden: [L, T, 2H] silently
// doubles the feature width a draft head sees.
use strata::shape::{CapturedStates, Hidden, HiddenAxis, Layers};

fn main() {
    let a = CapturedStates::<Layers<4>, Hidden<8>>::zeros(Layers, 3, Hidden);
    let b = a.clone();
    let _ = CapturedStates::concat::<HiddenAxis>(&[a, b]);
}
