//! The element types a collective reduces, and the arithmetic it does on them: a sum of two
//! buffers and a division by the number of processes, in the element's own type.
//!
//! Collectives move bytes; only the reducing ones need to know what the bytes are. Naming the
//! type with a small [`Element`] value (rather than a generic parameter) is what lets an
//! engine be a trait object, and what an MPI engine maps to its datatypes. (Which element a
//! Burn tensor's dtype is, is said above this crate: `burn_accelerate::distributed::ElementOf`.)

use bytemuck::Pod;
use half::{bf16, f16};

/// The type of a reduced buffer's values: sums and means are computed in it, as torch's gloo
/// and NCCL do (an f16 sum is rounded to f16 at every addition; an integer mean divides as
/// integers do).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Element {
    /// Values that are only moved, never added (all-gather, broadcast, streams).
    Bytes,
    /// `f64`.
    F64,
    /// `f32`.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// `i64`.
    I64,
    /// `i32`.
    I32,
    /// `i16`.
    I16,
    /// `i8`.
    I8,
    /// `u64`.
    U64,
    /// `u32`.
    U32,
    /// `u16`.
    U16,
    /// `u8`.
    U8,
}

impl Element {
    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            Self::Bytes | Self::I8 | Self::U8 => 1,
            Self::F16 | Self::BF16 | Self::I16 | Self::U16 => 2,
            Self::F32 | Self::I32 | Self::U32 => 4,
            Self::F64 | Self::I64 | Self::U64 => 8,
        }
    }

    /// A short name for messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bytes => "bytes",
            Self::F64 => "f64",
            Self::F32 => "f32",
            Self::F16 => "f16",
            Self::BF16 => "bf16",
            Self::I64 => "i64",
            Self::I32 => "i32",
            Self::I16 => "i16",
            Self::I8 => "i8",
            Self::U64 => "u64",
            Self::U32 => "u32",
            Self::U16 => "u16",
            Self::U8 => "u8",
        }
    }

    /// The code of this element on the wire.
    pub(crate) fn code(self) -> u8 {
        ALL.iter().position(|e| *e == self).expect("listed") as u8
    }

    /// The element of a wire code.
    pub(crate) fn from_code(code: u8) -> Option<Self> {
        ALL.get(usize::from(code)).copied()
    }

    /// `acc[i] += other[i]` for every value; both hold whole values of this element, aligned
    /// or not.
    pub(crate) fn add_assign(self, acc: &mut [u8], other: &[u8]) {
        debug_assert_eq!(acc.len(), other.len());
        match self {
            Self::Bytes => unreachable!("bytes are never reduced"),
            Self::F64 => add::<f64>(acc, other, |a, b| a + b),
            Self::F32 => add::<f32>(acc, other, |a, b| a + b),
            Self::F16 => add::<f16>(acc, other, |a, b| a + b),
            Self::BF16 => add::<bf16>(acc, other, |a, b| a + b),
            Self::I64 => add::<i64>(acc, other, i64::wrapping_add),
            Self::I32 => add::<i32>(acc, other, i32::wrapping_add),
            Self::I16 => add::<i16>(acc, other, i16::wrapping_add),
            Self::I8 => add::<i8>(acc, other, i8::wrapping_add),
            Self::U64 => add::<u64>(acc, other, u64::wrapping_add),
            Self::U32 => add::<u32>(acc, other, u32::wrapping_add),
            Self::U16 => add::<u16>(acc, other, u16::wrapping_add),
            Self::U8 => add::<u8>(acc, other, u8::wrapping_add),
        }
    }

    /// Divides every value by `n` (a mean from a sum).
    pub fn divide(self, values: &mut [u8], n: usize) {
        match self {
            Self::Bytes => unreachable!("bytes are never reduced"),
            Self::F64 => map::<f64>(values, |v| v / n as f64),
            Self::F32 => map::<f32>(values, |v| v / n as f32),
            Self::F16 => map::<f16>(values, |v| f16::from_f32(v.to_f32() / n as f32)),
            Self::BF16 => map::<bf16>(values, |v| bf16::from_f32(v.to_f32() / n as f32)),
            Self::I64 => map::<i64>(values, |v| v / n as i64),
            Self::I32 => map::<i32>(values, |v| v / n as i32),
            Self::I16 => map::<i16>(values, |v| v / n as i16),
            Self::I8 => map::<i8>(values, |v| v / n as i8),
            Self::U64 => map::<u64>(values, |v| v / n as u64),
            Self::U32 => map::<u32>(values, |v| v / n as u32),
            Self::U16 => map::<u16>(values, |v| v / n as u16),
            Self::U8 => map::<u8>(values, |v| v / n as u8),
        }
    }
}

const ALL: [Element; 13] = [
    Element::Bytes,
    Element::F64,
    Element::F32,
    Element::F16,
    Element::BF16,
    Element::I64,
    Element::I32,
    Element::I16,
    Element::I8,
    Element::U64,
    Element::U32,
    Element::U16,
    Element::U8,
];

fn aligned<T>(bytes: &[u8]) -> bool {
    (bytes.as_ptr() as usize).is_multiple_of(align_of::<T>())
}

fn add<T: Pod>(acc: &mut [u8], other: &[u8], op: impl Fn(T, T) -> T) {
    if aligned::<T>(acc) && aligned::<T>(other) {
        let acc: &mut [T] = bytemuck::cast_slice_mut(acc);
        let other: &[T] = bytemuck::cast_slice(other);
        acc.iter_mut().zip(other).for_each(|(a, b)| *a = op(*a, *b));
        return;
    }
    // Bytes not aligned for T (a tensor's, or a piece's): value by value.
    let size = size_of::<T>();
    for (a, b) in acc.chunks_exact_mut(size).zip(other.chunks_exact(size)) {
        let sum = op(
            bytemuck::pod_read_unaligned(a),
            bytemuck::pod_read_unaligned(b),
        );
        a.copy_from_slice(bytemuck::bytes_of(&sum));
    }
}

fn map<T: Pod>(values: &mut [u8], op: impl Fn(T) -> T) {
    if aligned::<T>(values) {
        let values: &mut [T] = bytemuck::cast_slice_mut(values);
        values.iter_mut().for_each(|v| *v = op(*v));
        return;
    }
    for v in values.chunks_exact_mut(size_of::<T>()) {
        v.copy_from_slice(bytemuck::bytes_of(&op(bytemuck::pod_read_unaligned(v))));
    }
}

/// A value type the process group can reduce: the plain numbers and the half floats.
///
/// Sealed: the arithmetic behind it is [`Element`]'s.
pub trait Reducible: Pod + sealed::Sealed {
    /// Its element.
    const ELEMENT: Element;
}

mod sealed {
    pub trait Sealed {}
}

macro_rules! reducible {
    ($($t:ty => $e:ident),* $(,)?) => {$(
        impl sealed::Sealed for $t {}
        impl Reducible for $t {
            const ELEMENT: Element = Element::$e;
        }
    )*};
}

reducible!(
    f64 => F64, f32 => F32, f16 => F16, bf16 => BF16, i64 => I64, i32 => I32, i16 => I16,
    i8 => I8, u64 => U64, u32 => U32, u16 => U16, u8 => U8,
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_round_trip_and_sizes_match_the_types() {
        for e in ALL {
            assert_eq!(Element::from_code(e.code()), Some(e));
        }
        assert_eq!(Element::from_code(ALL.len() as u8), None);
        assert_eq!(f16::ELEMENT.size(), 2);
        assert_eq!(i64::ELEMENT.size(), 8);
    }

    #[test]
    fn sums_and_means_are_in_the_element_type() {
        let mut acc = [i64::MAX - 1, 7];
        Element::I64.add_assign(
            bytemuck::cast_slice_mut(&mut acc),
            bytemuck::cast_slice(&[1i64, 3]),
        );
        assert_eq!(acc, [i64::MAX, 10]);
        Element::I64.divide(bytemuck::cast_slice_mut(&mut acc), 3);
        assert_eq!(acc, [i64::MAX / 3, 3]);

        // An f16 sum rounds to f16: 2048 + 1 is 2048 in f16.
        let mut h = [f16::from_f32(2048.0)];
        Element::F16.add_assign(
            bytemuck::cast_slice_mut(&mut h),
            bytemuck::cast_slice(&[f16::ONE]),
        );
        assert_eq!(h[0], f16::from_f32(2048.0));

        // Misaligned bytes are read and written all the same.
        let mut acc = [1.5f32, 2.0];
        let mut bytes = vec![0u8];
        bytes.extend_from_slice(bytemuck::cast_slice(&[0.25f32, -2.0]));
        Element::F32.add_assign(bytemuck::cast_slice_mut(&mut acc), &bytes[1..]);
        assert_eq!(acc, [1.75, 0.0]);
        Element::F32.add_assign(&mut bytes[1..], bytemuck::cast_slice(&acc));
        Element::F32.divide(&mut bytes[1..], 2);
        let got: Vec<f32> = bytes[1..]
            .chunks_exact(4)
            .map(bytemuck::pod_read_unaligned)
            .collect();
        assert_eq!(got, [1.0, -1.0]);
    }
}
