//! Named axis types. Distinct types, so a `Layers<4>` never passes for a `Hidden<4>`.

use dfdx::shapes::{ConstDim, Dim};

macro_rules! named_dim {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name<const N: usize>;

        impl<const N: usize> Dim for $name<N> {
            #[inline(always)]
            fn size(&self) -> usize {
                N
            }
            #[inline(always)]
            fn from_size(size: usize) -> Option<Self> {
                (size == N).then_some($name)
            }
        }

        impl<const N: usize> ConstDim for $name<N> {
            const SIZE: usize = N;
        }
    };
}

named_dim!(
    /// The captured-layers axis of a `[layers, tokens, hidden]` buffer, known at compile time.
    Layers
);
named_dim!(
    /// The model's hidden (residual stream) width, known at compile time.
    Hidden
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn const_dims_accept_only_their_size() {
        assert_eq!(Hidden::<7168>.size(), 7168);
        assert_eq!(Hidden::<7168>::from_size(7168), Some(Hidden));
        assert_eq!(Hidden::<7168>::from_size(896), None);
        assert_eq!(<Layers<4> as ConstDim>::SIZE, 4);
        assert_eq!(Layers::<4>::from_size(5), None);
    }
}
