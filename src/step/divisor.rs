//! The one divisor rule: what a window's loss and gradients are divided by, for both entry
//! points.
//!
//! As Accelerate's `accelerator.backward`, every batch's loss is divided by the window's
//! length `k` before it is differentiated, then multiplied by the loss scale ([`LossTransform`],
//! a value of its own below this rule and the loss scale's arming):
//! the `Accelerator` does it to the loss it is given, and the `with_accelerate` strategy arms
//! the decorator's `backward` to do it to the loss of the user's unmodified `TrainStep`
//! ([`ArmedLossScale`](crate::scaler::ArmedLossScale)). The ops are the same, in the same
//! order, so the two give the same bits. Dividing the loss rather than the summed gradients
//! also keeps f16's scaled gradients as large as torch's, so overflows (and the loss scale's
//! backoffs) come where they come under Accelerate.
//!
//! When the window completes, its summed gradients are multiplied once by
//! [`unscale_factor`]: the inverse loss scale, times `k / n` for a last window of `n < k`
//! batches when [`divide_partial_window_by_length`](crate::AccelerateConfig::divide_partial_window_by_length)
//! asks for it, divided by the replicas on the process's devices (a data-parallel strategy
//! averages them, as DDP does; several processes are averaged by the all-reduce itself).
//!
//! Burn's own `grads_accumulation(n)` sums its window ([`Window::sums`]): nothing divides by
//! its length. Where the strategy drives a backend without the decorator (plain `Autodiff`,
//! f32), whose `backward` cannot be armed, the window's sum is divided by `k` instead
//! ([`Window::loss_divided`]).

pub use crate::loss_transform::LossTransform;

/// How a training step's window is divided.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Window {
    /// Batches per optimizer step (`k`).
    pub steps: usize,
    /// The window's gradients are summed (Burn's `grads_accumulation`) rather than averaged
    /// (Accelerate's `gradient_accumulation_steps`).
    pub sums: bool,
    /// A last window of `n < k` batches is averaged over its `n` batches rather than `k`.
    pub divide_partial_by_length: bool,
    /// Each batch's loss was divided by `k` before it was differentiated. Not where the
    /// strategy drives a backend without the decorator, whose `backward` cannot be armed:
    /// there the window's sum is divided by `k` instead (the same value, rounded otherwise).
    pub loss_divided: bool,
}

impl Window {
    /// What each batch's loss is divided by before it is differentiated: `k`, or 1 when the
    /// window sums.
    pub fn loss_divisor(&self) -> u32 {
        if self.sums || !self.loss_divided {
            1
        } else {
            u32::try_from(self.steps).unwrap_or(u32::MAX)
        }
    }
}

/// The factor a completed window's summed gradients are multiplied by: `inv_scale`, times
/// `k / n` for a partial window of `batches = n < k` when the window asks for it, over
/// `replicas`. Computed in f64 and rounded once.
pub(crate) fn unscale_factor(
    window: &Window,
    inv_scale: f32,
    batches: usize,
    replicas: usize,
) -> f32 {
    let mut factor = f64::from(inv_scale);
    if !window.sums && window.divide_partial_by_length && batches > 0 && batches < window.steps {
        factor = factor * window.steps as f64 / batches as f64;
    }
    if !window.sums && !window.loss_divided {
        factor /= window.steps as f64;
    }
    if replicas > 1 {
        factor /= replicas as f64;
    }
    factor as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    const AVERAGE_3: Window = Window {
        steps: 3,
        sums: false,
        divide_partial_by_length: false,
        loss_divided: true,
    };

    #[test]
    fn the_loss_is_divided_by_the_window_unless_it_sums() {
        assert_eq!(AVERAGE_3.loss_divisor(), 3);
        let sums = Window {
            sums: true,
            ..AVERAGE_3
        };
        assert_eq!(sums.loss_divisor(), 1);
    }

    #[test]
    fn the_factor_is_the_inverse_scale_adjusted_for_partial_windows_and_replicas() {
        let inv = 1.0 / 1024.0;
        assert_eq!(unscale_factor(&AVERAGE_3, inv, 3, 1), inv);
        // Accelerate's own rule: the last window of 2 is still divided by 3.
        assert_eq!(unscale_factor(&AVERAGE_3, inv, 2, 1), inv);
        let by_length = Window {
            divide_partial_by_length: true,
            ..AVERAGE_3
        };
        assert_eq!(unscale_factor(&by_length, inv, 2, 1), inv * 1.5);
        assert_eq!(unscale_factor(&by_length, inv, 3, 1), inv);
        // Two devices of one process: their sum is averaged.
        assert_eq!(unscale_factor(&by_length, 1.0, 2, 2), 0.75);
        // Burn's summed window: the scale and the replicas only.
        let sums = Window {
            sums: true,
            ..by_length
        };
        assert_eq!(unscale_factor(&sums, 0.5, 2, 2), 0.25);
        // A backend whose backward cannot divide the loss: the sum is divided instead.
        let undivided = Window {
            loss_divided: false,
            ..AVERAGE_3
        };
        assert_eq!(undivided.loss_divisor(), 1);
        assert_eq!(unscale_factor(&undivided, 1.0, 3, 1), 1.0 / 3.0);
    }

    #[test]
    fn the_transform_divides_then_scales_and_is_skipped_where_trivial() {
        assert!(
            LossTransform {
                divisor: 1,
                scale: None
            }
            .is_identity()
        );
        assert!(
            !LossTransform {
                divisor: 3,
                scale: None
            }
            .is_identity()
        );
    }
}
