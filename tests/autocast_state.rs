//! The autocast state: thread-scoped guards, the process-wide default, op-class overrides.
//!
//! The process-wide state is shared by every test in this binary, so the tests that change it
//! hold `GLOBAL` while they run.

use std::panic;
use std::sync::Mutex;
use std::thread;

use burn_accelerate::Precision;
use burn_accelerate::autocast::{self, Op, OpClass};

static GLOBAL: Mutex<()> = Mutex::new(());

#[test]
fn guards_nest_and_restore_in_reverse_order() {
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
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
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
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
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    let _bf16 = autocast::enable(Precision::Bf16);
    let seen = thread::spawn(autocast::current).join().unwrap();
    assert_eq!(seen, None);
    assert_eq!(autocast::current(), Some(Precision::Bf16));
}

#[test]
fn the_process_default_reaches_every_thread_without_a_guard() {
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    autocast::set_default(Some(Precision::F16));
    let seen = thread::spawn(autocast::current).join().unwrap();
    let overridden = thread::spawn(|| {
        let _off = autocast::disable();
        autocast::current()
    })
    .join()
    .unwrap();
    autocast::set_default(None);
    assert_eq!(seen, Some(Precision::F16));
    assert_eq!(overridden, None);
    assert_eq!(autocast::default_precision(), None);
}

#[test]
fn op_classes_can_be_overridden_and_reset() {
    let _g = GLOBAL.lock().unwrap_or_else(|e| e.into_inner());
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Lower);
    assert_eq!(autocast::op_class(Op::Exp), OpClass::Fp32);
    assert_eq!(autocast::op_class(Op::Add), OpClass::Promote);
    autocast::set_op_class(Op::Matmul, OpClass::Fp32);
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Fp32);
    autocast::reset_op_classes();
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
