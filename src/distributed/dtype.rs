//! Which [`Element`] a Burn tensor's dtype is: the one thing about elements that needs Burn,
//! kept above the Burn-free engines (`burn-accelerate-comm`).

use burn::tensor::DType;

use super::element::Element;

/// The element of a tensor dtype, as `Element::of(dtype)`.
pub trait ElementOf {
    /// The element of a tensor dtype a collective can reduce; `None` for bool and quantized
    /// tensors, which have no sum.
    ///
    /// ```
    /// use burn::tensor::DType;
    /// use burn_accelerate::distributed::{Element, ElementOf};
    ///
    /// assert_eq!(Element::of(DType::BF16), Some(Element::BF16));
    /// assert_eq!(Element::of(DType::Flex32), Some(Element::F32));
    /// ```
    fn of(dtype: DType) -> Option<Element>;
}

impl ElementOf for Element {
    fn of(dtype: DType) -> Option<Element> {
        Some(match dtype {
            DType::F64 => Self::F64,
            DType::F32 | DType::Flex32 => Self::F32,
            DType::F16 => Self::F16,
            DType::BF16 => Self::BF16,
            DType::I64 => Self::I64,
            DType::I32 => Self::I32,
            DType::I16 => Self::I16,
            DType::I8 => Self::I8,
            DType::U64 => Self::U64,
            DType::U32 => Self::U32,
            DType::U16 => Self::U16,
            DType::U8 => Self::U8,
            _ => return None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_number_dtype_has_its_element_and_a_mask_none() {
        assert_eq!(
            Element::of(DType::Bool(burn::tensor::BoolStore::Native)),
            None
        );
        assert_eq!(Element::of(DType::BF16), Some(Element::BF16));
        assert_eq!(Element::of(DType::I8), Some(Element::I8));
        assert_eq!(Element::of(DType::U64), Some(Element::U64));
    }
}
