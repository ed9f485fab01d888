//! A user's override of an op's class changes what the decorator does with it.
#![cfg(feature = "flex")]

use burn::backend::Flex;
use burn::tensor::{DType, Tensor};
use burn_accelerate::autocast::{self, Op, OpClass};
use burn_accelerate::{Accelerated, Precision};

#[test]
fn overriding_a_class_changes_the_output_dtype() {
    type B = Accelerated<Flex>;
    let device = Default::default();
    let x = Tensor::<B, 2>::ones([2, 2], &device);
    let _bf16 = autocast::enable(Precision::Bf16);
    assert_eq!(x.clone().matmul(x.clone()).dtype(), DType::BF16);
    autocast::set_op_class(Op::Matmul, OpClass::Fp32);
    let overridden = x.clone().matmul(x.clone()).dtype();
    autocast::set_op_class(Op::Exp, OpClass::Lower);
    let exp_lowered = x.clone().exp().dtype();
    autocast::reset_op_classes();
    assert_eq!(overridden, DType::F32);
    assert_eq!(exp_lowered, DType::BF16);
    assert_eq!(x.clone().matmul(x).dtype(), DType::BF16);
}
