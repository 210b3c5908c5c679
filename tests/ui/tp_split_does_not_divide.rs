// Hidden 7168 over 3 tensor-parallel ranks: 7168 / 3 is not an integer, so
// the split does not compile.
use strata::model::TpLlama;
use strata::parallel::{HiddenU, Tp};
use typenum::{Prod, U1024, U3, U7};

fn main() {
    let _ = TpLlama::<HiddenU<Prod<U7, U1024>>, Tp<U3>>::load("kimi".as_ref(), Tp::default());
}
