//! Op classes and the run-time overrides of the op table's defaults.

use std::sync::atomic::{AtomicU8, Ordering};

use super::Op;

/// How autocast treats an op's float inputs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Cast inputs to the autocast dtype (bf16/f16), where the device can run it.
    Lower,
    /// Cast low-precision inputs up to f32; the result is f32.
    Fp32,
    /// Run in the widest dtype among the inputs, so mixed dtypes never reach the backend.
    Promote,
    /// Leave the inputs alone.
    Passthrough,
}

impl OpClass {
    fn code(self) -> u8 {
        match self {
            OpClass::Lower => 1,
            OpClass::Fp32 => 2,
            OpClass::Promote => 3,
            OpClass::Passthrough => 4,
        }
    }

    fn from_code(code: u8) -> Option<OpClass> {
        Some(match code {
            1 => OpClass::Lower,
            2 => OpClass::Fp32,
            3 => OpClass::Promote,
            4 => OpClass::Passthrough,
            _ => return None,
        })
    }
}

// One slot per op, 0 meaning "the table's default". Atomics keep the per-op lookup a plain
// load on the hot path; overrides are rare and process-wide, like the table they amend.
static OVERRIDES: [AtomicU8; 64] = [const { AtomicU8::new(0) }; 64];
const _: () = assert!(Op::ALL.len() <= 64, "grow OVERRIDES");

/// The class `op` has now: the override if one is set, else the table's default.
#[inline]
pub fn op_class(op: Op) -> OpClass {
    OpClass::from_code(OVERRIDES[op as usize].load(Ordering::Relaxed)).unwrap_or(op.default_class())
}

/// Overrides the class of one op for the whole process.
///
/// ```
/// use burn_accelerate::autocast::{self, Op, OpClass};
///
/// // Keep softmax in whatever dtype its input has, as PyTorch's CPU autocast does.
/// autocast::set_op_class(Op::Softmax, OpClass::Passthrough);
/// assert_eq!(autocast::op_class(Op::Softmax), OpClass::Passthrough);
/// autocast::reset_op_classes();
/// assert_eq!(autocast::op_class(Op::Softmax), OpClass::Fp32);
/// ```
pub fn set_op_class(op: Op, class: OpClass) {
    OVERRIDES[op as usize].store(class.code(), Ordering::Relaxed);
}

/// Drops every override: each op gets its table default back.
pub fn reset_op_classes() {
    for slot in &OVERRIDES {
        slot.store(0, Ordering::Relaxed);
    }
}
