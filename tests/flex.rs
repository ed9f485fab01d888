//! The generic suite on Flex, the CPU backend with real f16 and bf16 kernels.
#![cfg(feature = "flex")]

mod suite;

use burn::backend::{Autodiff, Flex};
use burn::tensor::DType;

backend_suite!(Autodiff<Flex>, Default::default(), DType::BF16, [Bf16, F16]);

#[test]
fn flex_runs_both_half_types() {
    let caps = burn_accelerate::capability::probe::<Flex>(&Default::default());
    assert!(caps.f16 && caps.bf16, "{caps:?}");
}
