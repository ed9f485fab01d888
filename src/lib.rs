//! # burn-accelerate
//!
//! What Hugging Face Accelerate gives PyTorch training loops, for [Burn](https://burn.dev):
//! mixed-precision autocast (bf16, f16, and fp8 emulated on every backend) as a backend
//! decorator, so that migrating a Burn project is one type alias:
//!
//! ```text
//! type Backend = Autodiff<Flex>;              // before
//! type Backend = Accelerated<Autodiff<Flex>>; // after
//! ```
//!
//! - [`Accelerated`]: the backend decorator; every Burn op forwarded, the autocast table's ops
//!   cast first.
//! - [`Context`]: every setting the decorator's ops and the training step read (precision, op
//!   classes, small-op rule, half path, placement switches, fp8 recipe and state, armed loss
//!   transform, sync layout), one value entered per thread by a guard, with one process default.
//! - [`autocast`]: the precision in force (thread-scoped guards over the context), the op table
//!   and its classes, user overrides.
//! - [`capability`]: which low precisions a device really runs, found by running them.
//! - [`fp8`]: fp8 autocast's rounding, Transformer Engine's delayed scaling and its per-tensor
//!   state.
//! - [`Accelerator`] (built from an [`AccelerateConfig`]): loss scaling, gradient accumulation
//!   and clipping for hand-written loops, conformant with torch's `GradScaler` and
//!   accelerate's accumulation.
//! - [`scaler`]: loss scales as values (none, static, torch's dynamic one) and the
//!   process-wide armed scale the decorator's `backward` applies.
//! - [`grads`]: unscale-and-check, accumulation and clipping over a model's gradients, on the
//!   device with one host read per optimizer step.
//! - [`gradient_state`]: Accelerate's `GradientState` (`sync_gradients`, end of data loader).
//! - [`data`]: Accelerate's data sharding as Burn data loaders, one per process
//!   ([`data::DataLoaderConfig`], [`data::ShardLoaderBuilder`]).
//! - [`train`]: `with_accelerate` on Burn's `SupervisedTraining`: the same semantics inside
//!   Burn's own training loop, with its metrics, checkpoints and early stopping; with a
//!   checkpoint directory it resumes by itself from its newest complete checkpoint.
//! - [`checkpoint`]: checkpoints a crash cannot corrupt (written aside and renamed, listed in
//!   a manifest with checksums, verified when read back).
//! - [`distributed`]: the same script on several processes or machines (`burn-accelerate
//!   launch`): the process state, the process group, gradients averaged at synchronising steps.
//! - `threads` (with the `flex` feature): the thread that runs the training step made one of
//!   the CPU threads its ops compute on.
//! - [`placement`]: where a model's parameters live, device maps under memory budgets, running
//!   a model placed over several devices, and refusing data-parallel training of one.
//!
//! The layers below, which need no Burn, are crates of their own in this workspace (re-exported
//! here under their old paths): `burn-accelerate-comm` (the process group's engines, the
//! rendezvous, elastic membership, run secrets, the process layout), `burn-accelerate-checkpoint`
//! (the crash-safe checkpoint directory) and `burn-accelerate-launch` (the launcher, which
//! `cargo install burn-accelerate-launch` builds without Burn).
//!
//! ```
//! # #[cfg(feature = "flex")] {
//! use burn::backend::{Autodiff, Flex};
//! use burn::tensor::{DType, Tensor};
//! use burn_accelerate::{Accelerated, AutocastConfig, Precision};
//!
//! type B = Accelerated<Autodiff<Flex>>;
//! let device = Default::default();
//! let autocast = AutocastConfig::new(Precision::Bf16).init::<B>(&device)?;
//! let _guard = autocast.enter();
//!
//! let x = Tensor::<B, 2>::ones([4, 8], &device);
//! let w = Tensor::<B, 2>::ones([8, 2], &device);
//! let logits = x.matmul(w); // lower class: runs in bf16
//! assert_eq!(logits.dtype(), DType::BF16);
//! let loss = logits.exp().mean(); // fp32 class: runs in f32
//! assert_eq!(loss.dtype(), DType::F32);
//! # }
//! # Ok::<(), burn_accelerate::AccelerateError>(())
//! ```

mod accelerator;
pub mod autocast;
mod backend;
#[doc(hidden)]
#[cfg(feature = "flex")]
pub mod bench_support;
pub mod capability;
pub mod checkpoint;
pub mod context;
mod cpu;
pub mod data;
mod device_moves;
pub mod distributed;
mod error;
pub mod fp8;
pub mod gradient_state;
pub mod grads;
mod hooks;
mod loss_transform;
mod op_table;
pub mod placement;
mod precision;
mod record_bytes;
pub mod scaler;
pub mod step;
#[cfg(feature = "flex")]
pub mod threads;
pub mod train;
mod warnings;
pub mod zero;

// The decoders' property-test kit, shared with the comm and checkpoint crates' tests (issue
// 49), and this crate's decoders tried with it.
#[cfg(test)]
#[path = "../crates/comm/src/fuzz.rs"]
#[allow(dead_code)]
mod fuzz;
#[cfg(all(test, feature = "flex"))]
mod record_decoders;

pub use accelerator::{AccelerateConfig, Accelerator, AcceleratorState};
pub use autocast::{Autocast, AutocastConfig};
pub use backend::Accelerated;
pub use context::{Context, ContextGuard};
pub use error::AccelerateError;
pub use gradient_state::{Accumulate, ActiveDataLoader, GradientState, GradientStateSnapshot};
pub use precision::{Precision, UnknownPrecision};
pub use scaler::{ArmedLossScale, DynamicLossScale, GradScalerConfig, LossScale};
pub use step::StepOutcome;
