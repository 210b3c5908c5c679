// Arguments swapped: a layers dim given where the hidden dim goes.
use strata::shape::{CapturedStates, Hidden, Layers};

fn main() {
    let _ = CapturedStates::<Layers<4>, Hidden<8>>::zeros(Hidden::<8>, 3, Layers::<4>);
}
