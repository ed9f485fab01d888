//! The autocast state: thread-scoped guards, op-class scopes. The process-wide default and
//! overrides are tested in `tests/autocast_process.rs`, alone in their binary: they reach
//! every thread, so no test here could run beside them.

use std::panic;
use std::thread;

use burn_accelerate::Precision;
use burn_accelerate::autocast::{self, Op, OpClass, OpClasses};

#[test]
fn guards_nest_and_restore_in_reverse_order() {
    assert_eq!(autocast::current(), None);
    {
        let _a = autocast::enable(Precision::F16);
        {
            let _b = autocast::enable(Precision::Bf16);
            {
                let _off = autocast::disable();
                assert_eq!(autocast::current(), None);
            }
            assert_eq!(autocast::current(), Some(Precision::Bf16));
        }
        assert_eq!(autocast::current(), Some(Precision::F16));
    }
    assert_eq!(autocast::current(), None);
}

#[test]
fn a_guard_is_restored_when_a_panic_unwinds_through_it() {
    let _outer = autocast::enable(Precision::F16);
    let caught = panic::catch_unwind(|| {
        let _inner = autocast::enable(Precision::Bf16);
        assert_eq!(autocast::current(), Some(Precision::Bf16));
        panic!("boom");
    });
    assert!(caught.is_err());
    assert_eq!(autocast::current(), Some(Precision::F16));
}

#[test]
fn a_guard_on_one_thread_does_not_reach_another() {
    let _bf16 = autocast::enable(Precision::Bf16);
    let seen = thread::spawn(autocast::current).join().unwrap();
    assert_eq!(seen, None);
    assert_eq!(autocast::current(), Some(Precision::Bf16));
}

#[test]
fn op_class_scopes_stay_on_their_thread() {
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Lower);
    assert_eq!(autocast::op_class(Op::Exp), OpClass::Fp32);
    assert_eq!(autocast::op_class(Op::Add), OpClass::Promote);
    {
        let _fp32 = autocast::scope_op_classes(OpClasses::new().with(Op::Matmul, OpClass::Fp32));
        assert_eq!(autocast::op_class(Op::Matmul), OpClass::Fp32);
        let other = thread::spawn(|| autocast::op_class(Op::Matmul))
            .join()
            .unwrap();
        assert_eq!(other, OpClass::Lower);
    }
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Lower);
}

#[test]
fn every_table_entry_names_its_backend_method_once() {
    let mut methods: Vec<&str> = Op::ALL.iter().map(|op| op.method()).collect();
    methods.sort();
    let before = methods.len();
    methods.dedup();
    assert_eq!(methods.len(), before, "an op is listed twice");
}
