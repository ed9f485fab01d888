//! The process-wide autocast settings: the default precision and the op-class overrides, for
//! threads the crate does not start. One test, alone in its binary: what it sets reaches every
//! thread of the process, so no other test could run beside it.

use std::thread;

use burn_accelerate::Precision;
use burn_accelerate::autocast::{self, Op, OpClass, OpClasses};

#[test]
fn process_settings_reach_every_thread_without_a_scope_of_its_own() {
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

    autocast::set_op_class(Op::Matmul, OpClass::Fp32);
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
    autocast::reset_op_classes();
    assert_eq!(seen, OpClass::Fp32);
    assert_eq!(scoped, OpClass::Lower);
    assert_eq!(autocast::op_class(Op::Matmul), OpClass::Lower);
}
