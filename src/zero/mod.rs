//! Sharded data parallel (DeepSpeed's ZeRO stages 1 to 3): at stages 1 and 2, which process
//! owns which parameter ([`partition`], pure arithmetic), the stage-2 gradient sync that
//! leaves each process its partition's mean ([`reduce_scatter_gradients`]) and the
//! parameters shared from their owners after the step ([`share_parameters`]); at stage 3,
//! each process's flat 1/N slice of every parameter ([`slice_range`]), the parameters
//! released until their next use ([`release_parameters`]) and the model's record gathered
//! whole on one process ([`gather_model_record`]); the optimizer state kept per process
//! (a partition's, or slices) and merged whole for a checkpoint ([`consolidate_state`],
//! [`keep_own_state`], [`keep_own_slices`]).
//!
//! The step core ([`step`](crate::step)) runs them for both entry points; this module sits on
//! the process group of [`distributed`](crate::distributed), which carries the bytes.

mod checkpoint_layout;
mod fingerprint;
mod full_shard;
mod full_shard_checkpoint;
mod optimizer_record;
pub(crate) mod post_backward;
mod sharded;
mod sharding;
mod stage;
mod state_slices;

pub(crate) use crate::backend::placeholder::discard_anchors;
pub use crate::backend::placeholder::{GatheredBytes, gathered_bytes, reset_gathered_peak};
#[doc(hidden)]
pub use crate::backend::placeholder::{RegistryEntries, registry_entries};
pub use crate::distributed::sent_bytes;
pub use checkpoint_layout::CheckpointLayout;
pub use fingerprint::check_same_model;
pub use full_shard::release_parameters;
pub(crate) use full_shard::{
    end_gathers, end_sharding, holds_released, reduce_scatter_slices, release_stepped, to_slices,
};
pub use full_shard_checkpoint::{gather_model, gather_model_record};
pub(crate) use full_shard_checkpoint::{held_record, own_model_record, release_loaded};
pub(crate) use optimizer_record::own_whole_state;
pub use optimizer_record::{ParamStateRecord, consolidate_state, keep_own_slices, keep_own_state};
pub(crate) use optimizer_record::{keyed_by_id, keyed_by_place};
pub(crate) use sharded::shards;
pub use sharded::{Partition, keep_own, reduce_scatter_gradients, share_parameters};
pub use sharding::{ZeroStage, partition, slice_len, slice_range};
