//! What autocast did with the lower-class ops it saw: how many ran in the half type and how
//! many it kept in f32, and why, with their flops.
//!
//! Counted per thread, on the thread that called the op (the training loop's, where Burn and
//! the strategy run the steps), so that two trainings on two threads of one process, as tests
//! run, never count each other's ops. A reader takes the difference of two snapshots
//! ([`LowerOpTally::since`]) around the work it wants counted.
//!
//! ```
//! use burn_accelerate::autocast::{self, LowerOpTally};
//!
//! let before = autocast::thread_tally();
//! // ... ops under autocast ...
//! let ran = autocast::thread_tally().since(&before);
//! assert_eq!(ran, LowerOpTally::default());
//! ```

use core::cell::Cell;

/// Why a lower-class op ran in f32 under autocast.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kept {
    /// Its work was below the small-op threshold ([`SmallOps`](super::SmallOps)).
    Small,
    /// The device cannot run the precision (autocast fell back to f32).
    Unsupported,
}

/// Lower-class op calls under a half-precision autocast (bf16, f16), by what they ran in.
///
/// Flops are [`estimated_flops`](super::estimated_flops) of each call (two per multiply-add);
/// a call whose flops cannot be estimated counts as an op with none. fp8 is emulated in f32
/// and is not counted here.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LowerOpTally {
    /// Calls that ran in the half type.
    pub half_ops: u64,
    /// Their flops.
    pub half_flops: u64,
    /// Calls kept in f32 because they were too small for the half type to pay.
    pub small_ops: u64,
    /// Their flops.
    pub small_flops: u64,
    /// Calls kept in f32 because the device cannot run the precision.
    pub unsupported_ops: u64,
    /// Their flops.
    pub unsupported_flops: u64,
    /// Of the calls run in the half type, the products the crate's own kernels computed
    /// (matmuls, linears and convolutions on Flex; the rest ran on the backend's own ops).
    pub crate_kernel_ops: u64,
}

impl LowerOpTally {
    /// What was counted after `earlier`, a snapshot of the same thread's tally.
    pub fn since(&self, earlier: &LowerOpTally) -> LowerOpTally {
        LowerOpTally {
            half_ops: self.half_ops.wrapping_sub(earlier.half_ops),
            half_flops: self.half_flops.wrapping_sub(earlier.half_flops),
            small_ops: self.small_ops.wrapping_sub(earlier.small_ops),
            small_flops: self.small_flops.wrapping_sub(earlier.small_flops),
            unsupported_ops: self.unsupported_ops.wrapping_sub(earlier.unsupported_ops),
            unsupported_flops: self
                .unsupported_flops
                .wrapping_sub(earlier.unsupported_flops),
            crate_kernel_ops: self.crate_kernel_ops.wrapping_sub(earlier.crate_kernel_ops),
        }
    }

    /// Two tallies added: the calls of two spans of work (validation's, epoch after epoch).
    pub fn plus(&self, other: &LowerOpTally) -> LowerOpTally {
        LowerOpTally {
            half_ops: self.half_ops.wrapping_add(other.half_ops),
            half_flops: self.half_flops.wrapping_add(other.half_flops),
            small_ops: self.small_ops.wrapping_add(other.small_ops),
            small_flops: self.small_flops.wrapping_add(other.small_flops),
            unsupported_ops: self.unsupported_ops.wrapping_add(other.unsupported_ops),
            unsupported_flops: self.unsupported_flops.wrapping_add(other.unsupported_flops),
            crate_kernel_ops: self.crate_kernel_ops.wrapping_add(other.crate_kernel_ops),
        }
    }

    /// Every lower-class call counted.
    pub fn ops(&self) -> u64 {
        self.half_ops + self.small_ops + self.unsupported_ops
    }

    /// Their flops.
    pub fn flops(&self) -> u64 {
        self.half_flops + self.small_flops + self.unsupported_flops
    }

    /// The share of the counted flops that ran in the half type, 0 when nothing was counted.
    pub fn half_flops_share(&self) -> f64 {
        match self.flops() {
            0 => 0.0,
            all => self.half_flops as f64 / all as f64,
        }
    }

    /// One line for a summary: `half_ops=<n>/<all> half_flops=<pct>% kept_f32=<small>
    /// small,<unsupported> unsupported`.
    pub fn summary(&self) -> String {
        format!(
            "half_ops={}/{} half_flops={:.1}% kept_f32={} small,{} unsupported",
            self.half_ops,
            self.ops(),
            100.0 * self.half_flops_share(),
            self.small_ops,
            self.unsupported_ops
        )
    }
}

thread_local! {
    static TALLY: Cell<LowerOpTally> = const {
        Cell::new(LowerOpTally {
            half_ops: 0,
            half_flops: 0,
            small_ops: 0,
            small_flops: 0,
            unsupported_ops: 0,
            unsupported_flops: 0,
            crate_kernel_ops: 0,
        })
    };
}

/// This thread's tally since it started.
pub fn thread_tally() -> LowerOpTally {
    TALLY.with(Cell::get)
}

/// Counts one lower-class call under a half-precision autocast: run in the half type
/// (`kept: None`) or kept in f32.
#[inline]
pub(crate) fn record(kept: Option<Kept>, flops: Option<u64>) {
    let flops = flops.unwrap_or(0);
    TALLY.with(|tally| {
        let mut t = tally.get();
        let (ops, sum) = match kept {
            None => (&mut t.half_ops, &mut t.half_flops),
            Some(Kept::Small) => (&mut t.small_ops, &mut t.small_flops),
            Some(Kept::Unsupported) => (&mut t.unsupported_ops, &mut t.unsupported_flops),
        };
        *ops = ops.wrapping_add(1);
        *sum = sum.wrapping_add(flops);
        tally.set(t);
    });
}

/// Counts one half-precision product computed by the crate's own kernels
/// (`backend::lowered`), already counted by [`record`] as run in the half type.
#[inline]
pub(crate) fn record_crate_kernel() {
    TALLY.with(|tally| {
        let mut t = tally.get();
        t.crate_kernel_ops = t.crate_kernel_ops.wrapping_add(1);
        tally.set(t);
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_threads_calls_are_counted_by_kind_and_read_as_differences() {
        let before = thread_tally();
        record(None, Some(100));
        record(None, None);
        record(Some(Kept::Small), Some(7));
        record(Some(Kept::Unsupported), Some(5));
        let ran = thread_tally().since(&before);
        assert_eq!(
            ran,
            LowerOpTally {
                half_ops: 2,
                half_flops: 100,
                small_ops: 1,
                small_flops: 7,
                unsupported_ops: 1,
                unsupported_flops: 5,
                crate_kernel_ops: 0,
            }
        );
        assert_eq!((ran.ops(), ran.flops()), (4, 112));
        assert!((ran.half_flops_share() - 100.0 / 112.0).abs() < 1e-12);
        assert_eq!(
            ran.summary(),
            "half_ops=2/4 half_flops=89.3% kept_f32=1 small,1 unsupported"
        );
        record_crate_kernel();
        let with_kernel = thread_tally().since(&before);
        assert_eq!(with_kernel.crate_kernel_ops, 1);
        assert_eq!(ran.plus(&ran).half_ops, 4);
        assert_eq!(ran.plus(&with_kernel).crate_kernel_ops, 1);
        // Another thread's calls are its own.
        std::thread::spawn(|| record(None, Some(1))).join().unwrap();
        assert_eq!(thread_tally().since(&before), with_kernel);
        assert_eq!(LowerOpTally::default().half_flops_share(), 0.0);
    }
}
