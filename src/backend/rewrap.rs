//! Moves Burn's backend-generic op structs between `B` and `Accelerated<B>`.
//!
//! The tensor primitives are the same types, but structs like `MaxPool2dWithIndices<B>` are
//! nominally different for the two backends, so their fields are moved over one by one.

use burn_backend::ops::{
    DeformConv2dBackward, MaxPool1dBackward, MaxPool1dWithIndices, MaxPool2dBackward,
    MaxPool2dWithIndices, TransactionPrimitive,
};
use burn_backend::quantization::QuantizationParametersPrimitive;
use burn_backend::{Backend, TensorPrimitive};

use super::Accelerated;

/// The same value, typed for the other side of the decorator.
pub(crate) trait Rewrap<T> {
    fn rewrap(self) -> T;
}

macro_rules! rewrap_both_ways {
    ($ty:ident { $($field:ident),* }) => {
        impl<B: Backend> Rewrap<$ty<B>> for $ty<Accelerated<B>> {
            fn rewrap(self) -> $ty<B> {
                $ty { $($field: self.$field),* }
            }
        }
        impl<B: Backend> Rewrap<$ty<Accelerated<B>>> for $ty<B> {
            fn rewrap(self) -> $ty<Accelerated<B>> {
                $ty { $($field: self.$field),* }
            }
        }
    };
}

rewrap_both_ways!(DeformConv2dBackward {
    x_grad,
    offset_grad,
    weight_grad,
    mask_grad,
    bias_grad
});
rewrap_both_ways!(MaxPool1dBackward { x_grad });
rewrap_both_ways!(MaxPool2dBackward { x_grad });
rewrap_both_ways!(MaxPool1dWithIndices { output, indices });
rewrap_both_ways!(MaxPool2dWithIndices { output, indices });
rewrap_both_ways!(QuantizationParametersPrimitive { scales });

// Its read order is private, but `execute_async` takes it out before calling `tr_execute`,
// so a transaction reaching a backend carries none and `new` loses nothing.
impl<B: Backend> Rewrap<TransactionPrimitive<B>> for TransactionPrimitive<Accelerated<B>> {
    fn rewrap(self) -> TransactionPrimitive<B> {
        TransactionPrimitive::new(
            self.read_floats,
            self.read_qfloats,
            self.read_ints,
            self.read_bools,
        )
    }
}

impl<B: Backend> Rewrap<TensorPrimitive<Accelerated<B>>> for TensorPrimitive<B> {
    fn rewrap(self) -> TensorPrimitive<Accelerated<B>> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}

impl<B: Backend> Rewrap<TensorPrimitive<B>> for TensorPrimitive<Accelerated<B>> {
    fn rewrap(self) -> TensorPrimitive<B> {
        match self {
            TensorPrimitive::Float(t) => TensorPrimitive::Float(t),
            TensorPrimitive::QFloat(t) => TensorPrimitive::QFloat(t),
        }
    }
}
