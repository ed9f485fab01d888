//! A user's override of an op's class changes what the decorator does with it, on the thread
//! that holds it.
#![cfg(feature = "flex")]

use burn::backend::Flex;
use burn::tensor::{DType, Tensor};
use burn_accelerate::autocast::{self, Op, OpClass, OpClasses};
use burn_accelerate::{Accelerated, AutocastConfig, Precision};

type B = Accelerated<Flex>;

#[test]
fn overriding_a_class_changes_the_output_dtype() {
    let device = Default::default();
    let x = Tensor::<B, 2>::ones([2, 2], &device);
    let _bf16 = autocast::enable(Precision::Bf16);
    assert_eq!(x.clone().matmul(x.clone()).dtype(), DType::BF16);
    {
        let _classes = autocast::scope_op_classes(
            OpClasses::new()
                .with(Op::Matmul, OpClass::Fp32)
                .with(Op::Exp, OpClass::Lower),
        );
        assert_eq!(x.clone().matmul(x.clone()).dtype(), DType::F32);
        assert_eq!(x.clone().exp().dtype(), DType::BF16);
    }
    assert_eq!(x.clone().matmul(x).dtype(), DType::BF16);
}

#[test]
fn an_entered_autocast_gives_its_thread_the_configurations_classes_and_no_other() {
    let device = Default::default();
    let autocast = AutocastConfig::new(Precision::Bf16)
        .with_op_classes(OpClasses::new().with(Op::Exp, OpClass::Lower))
        .init::<Flex>(&device)
        .unwrap();
    let _scope = autocast.enter();
    let x = Tensor::<B, 2>::ones([2, 2], &device);
    assert_eq!(x.exp().dtype(), DType::BF16);
    // Another thread under the same precision keeps the table's class: exp stays in f32.
    let other = std::thread::spawn(move || {
        let _bf16 = autocast::enable(Precision::Bf16);
        Tensor::<B, 2>::ones([2, 2], &Default::default())
            .exp()
            .dtype()
    });
    assert_eq!(other.join().unwrap(), DType::F32);
}

#[test]
fn scopes_nest_over_each_other() {
    let _outer = autocast::scope_op_classes(OpClasses::new().with(Op::Exp, OpClass::Lower));
    {
        let _inner = autocast::scope_op_classes(OpClasses::new().with(Op::Add, OpClass::Fp32));
        assert_eq!(autocast::op_class(Op::Exp), OpClass::Lower);
        assert_eq!(autocast::op_class(Op::Add), OpClass::Fp32);
    }
    assert_eq!(autocast::op_class(Op::Add), OpClass::Promote);
    assert_eq!(autocast::op_class(Op::Exp), OpClass::Lower);
}

#[test]
fn op_classes_round_trip_through_a_config_file() {
    let config = AutocastConfig::new(Precision::Bf16)
        .with_op_classes(OpClasses::new().with(Op::Softmax, OpClass::Passthrough));
    let json = serde_json::to_string(&config).unwrap();
    assert!(json.contains("Softmax"), "{json}");
    let back: AutocastConfig = serde_json::from_str(&json).unwrap();
    assert_eq!(back, config);
}
