//! The process-wide autocast settings: the default precision and the op-class overrides, for
//! threads the crate does not start. One test, alone in its binary: what it sets reaches every
//! thread of the process, so no other test could run beside it.

use std::thread;

use burn_accelerate::autocast::{self, Op, OpClass, OpClasses};
use burn_accelerate::{Context, Precision};

#[test]
fn process_settings_reach_every_thread_without_a_scope_of_its_own() {
    let before = Context::process()
        .with_precision(Some(Precision::F16))
        .set_as_default();
    let seen = thread::spawn(autocast::current).join().unwrap();
    let overridden = thread::spawn(|| {
        let _off = autocast::disable();
        autocast::current()
    })
    .join()
    .unwrap();
    before.set_as_default();
    assert_eq!(seen, Some(Precision::F16));
    assert_eq!(overridden, None);
    assert_eq!(autocast::default_precision(), None);

    let before = Context::process()
        .with_op_classes(OpClasses::new().with(Op::Matmul, OpClass::Fp32))
        .set_as_default();
    let seen = thread::spawn(|| autocast::op_class(Op::Matmul))
        .join()
        .unwrap();
    // A thread's own scope wins over the process's override.
    let scoped = thread::spawn(|| {
        let _lower = autocast::scope_op_classes(OpClasses::new().with(Op::Matmul, OpClass::Lower));
        autocast::op_class(Op::Matmul)
    })
    .join()
    .unwrap();
    before.set_as_default();
    assert_eq!(seen, OpClass::Fp32);
    assert_eq!(scoped, OpClass::Lower);
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Lower);
}
