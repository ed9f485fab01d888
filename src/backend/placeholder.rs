//! Parameters held as placeholders (ZeRO stage 3's per-layer bound): a tensor of the
//! parameter's full shape that holds no values, recognised by the decorator by its autodiff
//! node id, and resolved to the whole parameter by every op that reads it.
//!
//! Stage 3 (`crate::zero::release_parameters`) leaves each process a flat slice of every
//! parameter; on its first `Param::val()` a released parameter gives a placeholder (a
//! stride-0 view of one `-0.0`) on every process, registered here with its [`Shard`], which
//! holds this process's slice and runs the gather (an all-gather of every process's slice).
//! Every use of a registered tensor by an op is then one gather on every process, in the
//! order the processes run their ops, so the collectives pair up as the lazy gather's do.
//! Before the optimizer steps (on each process's slices, with no collective) stage 3 forgets
//! every registered tensor ([`forget_all`]), until it releases the parameters again.
//!
//! # Which ops hold the bound
//!
//! - `linear` (Burn's `nn::Linear`: the product and the bias add), where autocast lowers
//!   nothing and the operands share a dtype: the weight (and a registered bias) are gathered
//!   for the op alone and dropped when it returns; its backward node keeps the placeholder
//!   and gathers the weight again to compute the input's gradient. At most one layer's
//!   gathered weight and bias are whole at a time ([`gathered_bytes`]).
//! - `linear`, and `matmul` with a parameter operand (its batch dimensions equal to the
//!   other operand's or broadcast over them), under bf16/f16 autocast on `Autodiff<Flex>`,
//!   where autocast runs them on the crate's half kernels: the same bound, with the
//!   parameters gathered in the half type (each process casts its slice and sends halves:
//!   FSDP's `param_dtype`; a broadcast one expanded as a view), and the gradients summed over a
//!   broadcast and cast back to f32 for the parameters, as autocast's expand and cast nodes
//!   do (`half`). Where autocast reads the parameters in f32 (an op the small-op rule keeps
//!   in f32 as too small for the half type, or one of the fp32 class), the bound of autocast
//!   off on the cast input, the parameters gathered in f32 for the op alone (tested by
//!   `stage_3_under_autocast_gathers_a_linear_kept_in_f32_for_its_op_alone_like_stage_2` and
//!   `stage_3_under_autocast_gathers_an_fp32_class_matmul_parameter_for_its_op_alone_like_stage_2`).
//! - `linear`, and `matmul` with a parameter operand, under bf16/f16 autocast on every other
//!   registered backend (wgpu, CUDA, LibTorch, NdArray), and on `Autodiff<Flex>` where the
//!   process runs Flex's own half ops (`HalfPath::Own`): where autocast casts the f32
//!   parameters to the half type and the backend's `linear` (`float_matmul`) runs on the
//!   half operands, the parameters gathered in the half type (each process casts its slice
//!   with autocast's cast and sends halves) for Burn's node on them, the weight again for the
//!   other operand's gradient, each parameter's gradient cast to f32 as its cast node's
//!   backward casts it (tested on wgpu, LibTorch and Flex's own half ops by
//!   `stage3_backends`).
//! - `linear`, and `matmul` with a parameter operand (broadcast or not), under fp8 autocast
//!   where fp8's cast node is registered for the backend: the same bound, with the
//!   parameters gathered in f32 and the weight (the parameter operand) rounded there by the
//!   op's own fp8 cast (its key, scale and amax record), again in backward for the other
//!   operand's gradient, and the weight's gradient rounded as the cast node's backward
//!   rounds it (`fp8`).
//! - `matmul` (Burn's `Tensor::matmul`) with a registered operand, where autocast is off and
//!   the operands share a dtype: the parameter is gathered for the product alone; the node
//!   keeps its placeholder and gathers it again for the other operand's gradient (Burn's
//!   `Matmul` backward, the same ops in the same order).
//! - `embedding` (Burn's `nn::Embedding`): the table is gathered for the lookup alone; the
//!   backward reads only its shape (`embedding_backward`), so it is not gathered again.
//! - `layer_norm` (Burn's `nn::LayerNorm`), autocast off or under autocast's f32 class,
//!   where gamma and beta are read as they are: the normalisation runs as Burn decomposes
//!   it; gamma and beta are gathered for the affine part alone, and gamma again for the
//!   normalised input's gradient (`norm`).
//! - The convolutions (Burn's `nn::conv`: `conv1d`, `conv2d`, `conv3d` and the transposed ones),
//!   where autocast is off and the operands share a dtype: as `linear`, the weight (and a
//!   registered bias) gathered for the op alone, the weight again for the input's gradient, in
//!   Burn's convolution node's ops and order; the weight's and bias's gradients read only their
//!   placeholders' shapes (`conv`). Under autocast, each convolution's cast plan decided once:
//!   parameters it reads as they are (an f32-kept op) gathered as with autocast off; f32 parameters
//!   it casts to bf16/f16 gathered in the half type (each process casts its slice and sends
//!   halves), for Burn's convolution node on the half operands (`conv`), or on `Autodiff<Flex>`
//!   where autocast runs `conv2d` or `conv1d` (as a 2-D one, the weight reshaped inside the node)
//!   on the crate's half convolution, for its node, the weight again for the backward pass, whose
//!   GEMMs read it for both the input's and the weight's gradients (`half_conv`). Under fp8
//!   autocast (fp8's cast node registered for the backend), f32 parameters gathered in f32 for
//!   Burn's convolution node, the weight rounded there by the op's own fp8 cast and again for the
//!   input's gradient, and its gradient rounded as the cast node's backward rounds it, as `linear`
//!   under fp8 (tested by
//!   `stage_3_under_fp8_gathers_each_convolutions_parameters_for_its_op_alone_like_stage_2`).
//! - `reshape` of a registered parameter (Burn's `unsqueeze` of `nn::RmsNorm`'s gamma):
//!   nothing is gathered; the result is a *view*, a placeholder of the new shape registered
//!   with the parameter's shard, read through the parameter's anchor reshaped (`view`).
//!   `mul` with one registered operand (a parameter or a view) that reads the parameter as
//!   it is: autocast off and one dtype, or under autocast (`mul` is of the promote class: a
//!   half operand times an f32 parameter, `nn::RmsNorm`'s `normalized * gamma` under
//!   bf16/f16, is cast up to f32 by autocast's cast node, the parameter read in f32): the
//!   parameter gathered in its own dtype for the product alone, again in backward for the
//!   other operand's gradient, in Burn's `Mul` and `ReshapeDim` backward ops (tested under
//!   autocast by
//!   `stage_3_under_autocast_gathers_rms_norm_gamma_in_f32_for_its_product_alone_like_stage_2`).
//! - Every other op of every ops trait the decorator forwards (casts under autocast,
//!   transactions, `mul` where an override puts it in autocast's lower class), `linear` and
//!   `matmul` under autocast with parameters of another dtype than f32: the registered
//!   input is gathered in full and the op reads `anchor + gathered` (the gathered value bit
//!   for bit, since `-0.0` is the additive identity, with the gradient flowing to the
//!   anchor). The numbers are right; the gathered value stays whole while the autodiff graph
//!   keeps it (until the step), as the lazy gather does: no per-op bound for these ops.
//!   Reads that build no graph (`into_data`, the decorator's `AutodiffBackend::inner`:
//!   `Module::valid`'s copy) gather the same way, without an anchor.
//!
//! # Anchors
//!
//! Every op of a pass reads a registered parameter through its anchor, an identity node made
//! at the parameter's first use in the pass: its backward sees the sum of every use's
//! gradient, and hands it to the parameter as it is, or (in the backward pass that completes
//! an accumulation window, `crate::zero::post_backward`) reduce-scatters it first, each
//! process keeping its slice's mean. `linear`, `matmul` and the
//! convolutions place their anchors just above their other input (`layer_norm` above its
//! normalised input), so that they run right after the op's backward; other ops' anchors (an
//! embedding's among them: its input is integers) sit above the parameter alone and run at
//! the end of the pass. An anchor is handed to the uses of the pass being built: where none
//! is (a batch starts, a backward pass ended) the anchors left are discarded
//! (`discard_anchors`), so that a forward pass dropped without a backward (an evaluation on
//! the training model) leaves nothing to the next one.
//!
//! Recognition needs the concrete `Autodiff<B, C>` (the node id), which `crate::hooks`
//! registers per backend type: Burn's autodiff over every backend this crate has a feature
//! for (Flex, NdArray, wgpu, CUDA, LibTorch). Over any other backend nothing is registered,
//! and stage 3 keeps the lazy gather there (`crate::zero::release_parameters`).

use std::any::Any;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::ThreadId;

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind, broadcast_shape, unary};
use burn_backend::tensor::{FloatTensor, IntTensor};
use burn_backend::{Backend, DType, FloatDType, Shape, TensorData, TensorMetadata, try_read_sync};

use crate::hooks::{self, HookKind};

mod conv;
mod fp8;
#[cfg(feature = "flex")]
mod half;
#[cfg(feature = "flex")]
mod half_conv;
mod norm;
mod view;

pub(crate) use conv::{
    conv_transpose1d, conv_transpose2d, conv_transpose3d, conv1d, conv2d, conv3d,
};
pub(crate) use norm::layer_norm;
pub(crate) use view::{float_mul, float_reshape};

/// Where a registered parameter's whole value comes from: one collective per use. Every
/// process holds a slice of the parameter (ZeRO stage 3's 1/N, FSDP's flat slice) and a
/// placeholder of its full shape; each use gathers the slices.
pub trait Shard: Send + Sync + 'static {
    /// This process's slice of the parameter (padded), in the parameter's dtype.
    fn slice(&self) -> TensorData;

    /// The whole parameter in `dtype` (its own, or the half type an op runs in under
    /// autocast: FSDP's `param_dtype`), on every process, from every
    /// process's slice (`own`: this process's, in `dtype`, cast by the op's backend as
    /// autocast casts). Every process must call it at the same use. A failure (processes that
    /// read different parameters, a lost peer) panics with what to change: it runs inside an
    /// op, which has no error channel.
    fn gather(&self, own: &[u8], dtype: DType) -> TensorData;

    /// This process's slice of the mean over the processes of the parameter's gradient
    /// (`grad`: this process's whole gradient, in logical order), as values of
    /// the slice's length (its padding's values zero). Every process must call it at the
    /// same point of the same backward pass. Panics as [`gather`](Self::gather) does.
    fn reduce(&self, grad: Vec<f32>) -> Vec<f32>;

    /// The shard as [`Any`], for ZeRO stage 3 (which made it) to read its slice back.
    fn as_any(&self) -> &dyn Any;
}

/// The gathered parameters' bytes that are whole right now on this process, and the most
/// that were at once since [`reset_gathered_peak`]: what the per-layer bound bounds. Every
/// gather is counted (no process holds a parameter whole between steps); one gathered by an
/// op without a bound is counted until the step releases the parameters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GatheredBytes {
    /// Bytes gathered and not yet dropped.
    pub alive: u64,
    /// The most `alive` has been since the last reset.
    pub peak: u64,
}

#[derive(Default)]
struct Registry {
    // Registered tensors by autodiff node id.
    shards: BTreeMap<u64, Arc<dyn Shard>>,
    // Each registered parameter's anchor (a `FloatTensor<B>` of the backend that made it),
    // by the parameter's node id: every op of a pass reads the parameter through it, so
    // that its backward node sees the sum of every use's gradient. Dropped when its
    // backward runs, or when the parameters are released.
    anchors: BTreeMap<u64, Box<dyn Any + Send>>,
    // Reshaped parameters (`view`), by their node ids: registered in `shards` too, with their
    // parameter's shard.
    views: BTreeMap<u64, view::View>,
    // Whether the anchors' backward reduce-scatters each parameter's gradient (the
    // backward pass that completes an accumulation window), or hands it to the parameter
    // as it is (the window's earlier passes).
    reducing: bool,
    // The window's earlier passes' gradient sum of each parameter (an inner backend's float
    // primitive), by node id, added to the last pass's before its reduction.
    window: BTreeMap<u64, Box<dyn Any + Send>>,
    bytes: GatheredBytes,
    // The thread on which a checkpoint's record reads released parameters: there their
    // initializer gives a placeholder instead of gathering it on every process
    // (`zero::gather_model_record` sends each slice to the root itself).
    reading_held: Option<ThreadId>,
    // Each released parameter's shard (this process's slice of it), by the parameter's id:
    // what the step, the release and a checkpoint read of it without a collective. Replaced
    // at each release, kept from the step's `forget_all` to the release.
    slices: BTreeMap<u64, Arc<dyn Shard>>,
}

// The registry, and how many tensors it holds: every op of the decorator asks, and outside
// stage 3 the answer (none) is one relaxed load.
struct Placeholders {
    registered: AtomicUsize,
    registry: Mutex<Registry>,
}

static PLACEHOLDERS: Placeholders = Placeholders {
    registered: AtomicUsize::new(0),
    registry: Mutex::new(Registry {
        shards: BTreeMap::new(),
        anchors: BTreeMap::new(),
        views: BTreeMap::new(),
        reducing: false,
        window: BTreeMap::new(),
        bytes: GatheredBytes { alive: 0, peak: 0 },
        reading_held: None,
        slices: BTreeMap::new(),
    }),
};

/// Whether a released parameter read on this thread now gives the value this process holds,
/// without any collective ([`reading_held`]).
pub(crate) fn reads_held_values() -> bool {
    let this = std::thread::current().id();
    registry(|registry| registry.reading_held == Some(this))
}

/// Released parameters read on this thread give their held value until the guard drops (also
/// when the visit panics): a checkpoint's record sends each one to the root itself.
pub(crate) fn reading_held() -> ReadingHeld {
    let this = std::thread::current().id();
    registry(|registry| registry.reading_held = Some(this));
    ReadingHeld(())
}

/// The guard of [`reading_held`].
pub(crate) struct ReadingHeld(());

impl Drop for ReadingHeld {
    fn drop(&mut self) {
        registry(|registry| registry.reading_held = None);
    }
}

fn registry<R>(f: impl FnOnce(&mut Registry) -> R) -> R {
    let mut registry = PLACEHOLDERS
        .registry
        .lock()
        .unwrap_or_else(PoisonError::into_inner);
    let result = f(&mut registry);
    PLACEHOLDERS
        .registered
        .store(registry.shards.len(), Ordering::Relaxed);
    result
}

/// This process's gathered bytes ([`GatheredBytes`]).
pub fn gathered_bytes() -> GatheredBytes {
    registry(|r| r.bytes)
}

/// How many entries stage 3's registry holds on this process: what the tests check does not
/// grow from step to step.
#[doc(hidden)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RegistryEntries {
    /// Registered tensors (parameters and views).
    pub shards: usize,
    /// Anchors kept for the current pass's next use of a parameter.
    pub anchors: usize,
    /// Reshaped parameters.
    pub views: usize,
    /// The window's earlier passes' sums handed to a reducing pass.
    pub window: usize,
}

/// This process's [`RegistryEntries`].
#[doc(hidden)]
pub fn registry_entries() -> RegistryEntries {
    registry(|r| RegistryEntries {
        shards: r.shards.len(),
        anchors: r.anchors.len(),
        views: r.views.len(),
        window: r.window.len(),
    })
}

/// Starts the peak of [`gathered_bytes`] again from the bytes alive now.
pub fn reset_gathered_peak() {
    registry(|r| r.bytes.peak = r.bytes.alive);
}

fn count_gathered(bytes: u64) {
    registry(|r| {
        r.bytes.alive += bytes;
        r.bytes.peak = r.bytes.peak.max(r.bytes.alive);
    });
}

fn count_dropped(bytes: u64) {
    registry(|r| r.bytes.alive = r.bytes.alive.saturating_sub(bytes));
}

// The functions registered per backend type: the node id of a tensor, and the bounded linear.
struct Tracked<B: Backend> {
    node_id: fn(&FloatTensor<B>) -> u64,
    linear: LinearHook<B>,
    matmul: MatmulHook<B>,
    embedding: EmbeddingHook<B>,
    anchor: AnchorHook<B>,
    fp8_linear: fp8::Fp8Linear<B>,
    fp8_matmul: fp8::Fp8Matmul<B>,
}

// The bounded matmul: the operands (a parameter's through its anchor), their shards, and the
// half type the parameter operands are gathered in under autocast (`None`: as they are).
type MatmulHook<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<Arc<dyn Shard>>,
    Option<Arc<dyn Shard>>,
    Option<FloatDType>,
) -> FloatTensor<B>;

type EmbeddingHook<B> = fn(FloatTensor<B>, IntTensor<B>, Arc<dyn Shard>) -> FloatTensor<B>;

// A new anchor node for a parameter (its tensor, an input of the op that first reads it, its
// shard); the parameter itself where it is not tracked.
type AnchorHook<B> = fn(FloatTensor<B>, Option<&FloatTensor<B>>, Arc<dyn Shard>) -> FloatTensor<B>;

// The bounded linear: the input, the parameters' anchors, their shards, and the half type
// they are gathered in under autocast (`None`: as they are).
type LinearHook<B> = fn(
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    Arc<dyn Shard>,
    Option<Arc<dyn Shard>>,
    Option<FloatDType>,
) -> FloatTensor<B>;

impl<B: Backend> Clone for Tracked<B> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<B: Backend> Copy for Tracked<B> {}

struct PlaceholderHooks;

// Every backend this crate has a feature for, so that stage 3 holds its per-layer bound on
// the GPU backends (where FSDP's users train) as on the CPU ones: the bounded ops run the
// inner backend's own ops on gathered values, nothing in them is CPU-specific.
impl HookKind for PlaceholderHooks {
    fn register_known() {
        struct Register;
        impl hooks::ForEachBackend for Register {
            fn call<B: Backend>(&mut self) {
                use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
                register::<B, NoCheckpointing>();
            }
        }
        hooks::each_backend(&mut Register);
    }
}

/// Lets the decorator over `Autodiff<B, C>` recognise stage 3's placeholders (Burn's autodiff
/// over every backend this crate has a feature for, with default checkpointing, is registered
/// without asking).
pub fn register<B: Backend, C: CheckpointStrategy>() {
    hooks::insert::<PlaceholderHooks, Autodiff<B, C>, _>(Tracked::<Autodiff<B, C>> {
        node_id: node_id::<B>,
        linear: bounded_linear::<B, C>,
        matmul: bounded_matmul::<B, C>,
        embedding: bounded_embedding::<B, C>,
        anchor: anchor::<B, C>,
        fp8_linear: fp8::bounded_fp8_linear::<B, C>,
        fp8_matmul: fp8::bounded_fp8_matmul::<B, C>,
    });
    norm::register::<B, C>();
    view::register::<B, C>();
    conv::register::<B, C>();
    // Under its key the decorator says that its ops resolve placeholders.
    hooks::insert::<DecoratorHooks, super::Accelerated<Autodiff<B, C>>, _>(Resolves);
    hooks::insert::<PlaceholderHooks, super::Accelerated<Autodiff<B, C>>, _>(Tracked::<
        super::Accelerated<Autodiff<B, C>>,
    > {
        node_id: node_id::<B>,
        linear: bounded_linear::<B, C>,
        matmul: bounded_matmul::<B, C>,
        embedding: bounded_embedding::<B, C>,
        anchor: anchor::<B, C>,
        fp8_linear: fp8::bounded_fp8_linear::<B, C>,
        fp8_matmul: fp8::bounded_fp8_matmul::<B, C>,
    });
}

fn node_id<B: Backend>(tensor: &FloatTensor<Autodiff<B>>) -> u64 {
    tensor.node.id.value
}

fn tracked<B: Backend>() -> Option<Tracked<B>> {
    hooks::get::<PlaceholderHooks, B, Tracked<B>>()
}

// The decorator's own key: its ops resolve placeholders. (The inner `Autodiff<B, C>`'s key
// has the node id too, but its own ops would read a placeholder's zeros.)
#[derive(Clone, Copy)]
struct Resolves;

struct DecoratorHooks;

impl HookKind for DecoratorHooks {
    fn register_known() {
        PlaceholderHooks::register_known();
    }
}

/// Whether ops on `B` resolve placeholders (`B` is the decorator over a registered autodiff
/// backend): where they do not, a placeholder would be read as zeros.
pub(crate) fn recognised<B: Backend>() -> bool {
    hooks::get::<DecoratorHooks, B, Resolves>().is_some() && tracked::<B>().is_some()
}

/// Registers `tensor` (a placeholder) as the parameter `shard` gathers,
/// where `B` has the hook (see [`recognised`]).
pub(crate) fn register_tensor<B: Backend>(tensor: &FloatTensor<B>, shard: Arc<dyn Shard>) {
    if let Some(tracked) = tracked::<B>() {
        let id = (tracked.node_id)(tensor);
        registry(|r| r.shards.insert(id, shard));
    }
}

/// Forgets `tensor`, if registered (the step released its parameter).
pub(crate) fn unregister_tensor<B: Backend>(tensor: &FloatTensor<B>) {
    if let Some(tracked) = tracked::<B>() {
        let id = (tracked.node_id)(tensor);
        registry(|r| r.shards.remove(&id));
    }
}

/// Keeps `slices` (each released parameter's shard, by the parameter's id) as the released
/// parameters' shards, instead of the last release's.
pub(crate) fn keep_slices(slices: BTreeMap<u64, Arc<dyn Shard>>) {
    registry(|r| r.slices = slices);
}

/// The shard of the released parameter of id `param` (by [`keep_slices`]), if any.
pub(crate) fn slice_shard(param: u64) -> Option<Arc<dyn Shard>> {
    registry(|r| r.slices.get(&param).cloned())
}

/// Forgets every registered tensor (stage 3 releases its model's parameters), and the
/// gathered bytes the ops without a bound left whole (counted until the step).
pub(crate) fn forget_all() {
    registry(|r| {
        r.shards.clear();
        r.anchors.clear();
        r.views.clear();
        r.reducing = false;
        r.window.clear();
        r.bytes.alive = 0;
    });
}

/// Forgets the anchors kept for the next use of a parameter in the pass being built, where
/// no pass is: a batch starts (`Accelerator::accumulate`), or a backward pass ended (an
/// anchor left then was made by a forward pass that was not differentiated). A forward pass
/// whose graph was dropped without a backward (an evaluation on the training model) leaves
/// its anchors; the next pass would read the parameters through them, and its backward would
/// run the dropped pass's nodes too. An anchor still in a graph keeps working: the registry
/// only hands it to the next use.
pub(crate) fn discard_anchors() {
    registry(|r| r.anchors.clear());
}

// The shard `tensor` was registered with, if any: nothing to look up while none is.
fn shard_of<B: Backend>(tensor: &FloatTensor<B>) -> Option<Arc<dyn Shard>> {
    if PLACEHOLDERS.registered.load(Ordering::Relaxed) == 0 {
        return None;
    }
    let id = (tracked::<B>()?.node_id)(tensor);
    registry(|r| r.shards.get(&id).cloned())
}

// `tensor`'s values, read where an op has no error channel: a failed read panics, saying
// what stage 3 was reading (`what`).
fn data_of<B: Backend>(tensor: FloatTensor<B>, what: &str) -> TensorData {
    try_read_sync(B::float_into_data(tensor))
        .and_then(Result::ok)
        .unwrap_or_else(|| panic!("ZeRO stage 3 could not read {what}"))
}

// One use's gather of the parameter `tensor` stands for, as a tensor of `B` beside it (same
// shape, dtype, device), counted as whole until `count_dropped`.
fn gather<B: Backend>(shard: &dyn Shard, tensor: &FloatTensor<B>) -> FloatTensor<B> {
    received::<B>(
        shard,
        tensor.shape(),
        tensor.dtype(),
        &B::float_device(tensor),
    )
    .0
}

// A gather's value: `shape` in `dtype` from every process's slice, counted as whole until
// `count_dropped`; with the bytes counted.
fn received<B: Backend>(
    shard: &dyn Shard,
    shape: Shape,
    dtype: DType,
    device: &B::Device,
) -> (FloatTensor<B>, u64) {
    let own = shard.slice();
    let own = if own.dtype == dtype {
        own
    } else {
        // Autocast's cast, on the op's backend: the bits its cast of the whole value gives
        // (an elementwise rounding).
        let own = B::float_from_data(own, device);
        let cast = crate::cpu::table::cast::<B>(own, FloatDType::from(dtype));
        data_of::<B>(cast, "its slice to send it")
    };
    let data = shard.gather(&own.bytes, dtype);
    let expected = shape.num_elements() * dtype.size();
    assert!(
        data.bytes.len() == expected && data.shape == shape,
        "ZeRO stage 3 gathered {} bytes of shape {:?} for a {dtype:?} parameter of shape \
         {shape:?} ({expected} bytes): the processes' models differ",
        data.bytes.len(),
        data.shape
    );
    count_gathered(expected as u64);
    (B::float_from_data(data, device), expected as u64)
}

// Each parameter operand of a product read through its anchor, which sits above the other
// operand where that one is not a parameter (so that the anchor's backward runs right after
// the product's).
fn anchored_operands<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    lhs_shard: &Option<Arc<dyn Shard>>,
    rhs_shard: &Option<Arc<dyn Shard>>,
) -> (FloatTensor<B>, FloatTensor<B>) {
    let lhs_anchored = match lhs_shard {
        Some(shard) => {
            let input = rhs_shard.is_none().then_some(&rhs);
            anchored::<B>(lhs.clone(), input, shard.clone())
        }
        None => lhs.clone(),
    };
    let rhs = match rhs_shard {
        Some(shard) => {
            let input = lhs_shard.is_none().then_some(&lhs);
            anchored::<B>(rhs, input, shard.clone())
        }
        None => rhs,
    };
    (lhs_anchored, rhs)
}

// The bytes one use's gather counted.
fn counted<T: TensorMetadata>(tensor: &T) -> u64 {
    (tensor.shape().num_elements() * tensor.dtype().size()) as u64
}

// One use's gather of the parameter `tensor` stands for, in `dtype` where given (each process
// casts its slice with autocast's cast: what autocast's cast of the gathered value gives, an
// elementwise rounding of the same values), else as it is. With the bytes counted.
fn gather_in<B: Backend>(
    shard: &dyn Shard,
    tensor: &FloatTensor<B>,
    dtype: Option<FloatDType>,
) -> (FloatTensor<B>, u64) {
    let dtype = dtype.map_or(tensor.dtype(), DType::from);
    received::<B>(shard, tensor.shape(), dtype, &B::float_device(tensor))
}

// The half type a node's parameters were gathered in under autocast, and whether its bias is
// a parameter (whose gradient is cast to f32, as its cast node's backward casts it) or a
// tensor autocast cast before the op (whose gradient its own cast node takes as it is).
#[derive(Clone, Copy, Debug)]
struct Half {
    dtype: FloatDType,
    bias_registered: bool,
}

// A parameter's gradient as the parameter takes it: where it was gathered in a half type
// (`half`), cast to f32 as its cast node's backward casts it; as it is otherwise.
fn to_param<B: Backend>(half: Option<FloatDType>, grad: FloatTensor<B>) -> FloatTensor<B> {
    match half {
        Some(_) => crate::cpu::table::cast::<B>(grad, FloatDType::F32),
        None => grad,
    }
}

/// `tensor` for an op that reads it: a registered parameter gathered whole (`anchor +
/// gathered`, so the gradient reaches the parameter through its anchor), any other tensor as
/// it is.
pub(crate) fn resolve<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let Some(shard) = shard_of::<B>(&tensor) else {
        return tensor;
    };
    let gathered = gather::<B>(shard.as_ref(), &tensor);
    let anchor = anchored::<B>(tensor, None, shard.clone());
    // Whole until the step: the graph may keep the sum. Not counted as dropped.
    B::float_add(anchor, gathered)
}

/// [`resolve`] for a read that builds no graph (`into_data`, `AutodiffBackend::inner`): the
/// gathered value without an anchor.
pub(crate) fn resolve_read<B: Backend>(tensor: FloatTensor<B>) -> FloatTensor<B> {
    let Some(shard) = shard_of::<B>(&tensor) else {
        return tensor;
    };
    let gathered = gather::<B>(shard.as_ref(), &tensor);
    B::float_add(tensor, gathered)
}

// The parameter `leaf` through this pass's anchor (made at its first use, `input` an input of
// that op: see `anchor`), where `B` has the hook and `leaf` is tracked; `leaf` otherwise.
fn anchored<B: Backend>(
    leaf: FloatTensor<B>,
    input: Option<&FloatTensor<B>>,
    shard: Arc<dyn Shard>,
) -> FloatTensor<B> {
    let Some(tracked) = tracked::<B>() else {
        return leaf;
    };
    if let Some(anchor) = view::anchored_view::<B>(&leaf, input, &shard) {
        return anchor;
    }
    let id = (tracked.node_id)(&leaf);
    let cached = registry(|r| {
        r.anchors
            .get(&id)
            .and_then(|anchor| anchor.downcast_ref::<FloatTensor<B>>().cloned())
    });
    if let Some(anchor) = cached {
        return anchor;
    }
    let anchor = (tracked.anchor)(leaf, input, shard);
    if (tracked.node_id)(&anchor) != id {
        let kept = Box::new(anchor.clone());
        registry(|r| r.anchors.insert(id, kept));
    }
    anchor
}

// A layer's weight and bias (where it is a registered parameter) through their anchors,
// which sit just above the layer's input `x`, so that they run right after the layer's
// backward (`linear`, the convolutions).
fn anchors<B: Backend>(
    x: &FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: &Arc<dyn Shard>,
    bias_shard: &Option<Arc<dyn Shard>>,
) -> (FloatTensor<B>, Option<FloatTensor<B>>) {
    let weight = anchored::<B>(weight, Some(x), weight_shard.clone());
    let bias = match (bias, bias_shard) {
        (Some(bias), Some(shard)) => Some(anchored::<B>(bias, Some(x), shard.clone())),
        (bias, _) => bias,
    };
    (weight, bias)
}

/// [`resolve`] of an optional input.
pub(crate) fn resolve_opt<B: Backend>(tensor: Option<FloatTensor<B>>) -> Option<FloatTensor<B>> {
    tensor.map(resolve::<B>)
}

/// [`resolve`] of each of a list of inputs.
pub(crate) fn resolve_vec<B: Backend>(tensors: Vec<FloatTensor<B>>) -> Vec<FloatTensor<B>> {
    tensors.into_iter().map(resolve::<B>).collect()
}

/// `linear`'s inputs, given back where the bounded path does not apply.
pub(crate) type LinearInputs<B> = (FloatTensor<B>, FloatTensor<B>, Option<FloatTensor<B>>);

// The bounded half `linear` and `matmul` per backend type (`Autodiff<Flex>`, whose autocast
// runs the crate's half kernels): one kind each, as the registry keeps one hook per kind and
// backend.
#[cfg(feature = "flex")]
struct HalfLinearHooks;

#[cfg(feature = "flex")]
impl HookKind for HalfLinearHooks {
    fn register_known() {
        hooks::insert::<HalfLinearHooks, Autodiff<burn::backend::Flex>, _>(
            half::bounded_half_linear as half::HalfLinear<Autodiff<burn::backend::Flex>>,
        );
    }
}

#[cfg(feature = "flex")]
struct HalfMatmulHooks;

#[cfg(feature = "flex")]
impl HookKind for HalfMatmulHooks {
    fn register_known() {
        hooks::insert::<HalfMatmulHooks, Autodiff<burn::backend::Flex>, _>(
            half::bounded_half_matmul as half::HalfMatmul<Autodiff<burn::backend::Flex>>,
        );
    }
}

/// `linear(x, weight, bias)` with the per-layer bound, where it applies: the weight is a
/// registered parameter, `x` is not, and either autocast lowers nothing and the operands
/// share a dtype, or bf16/f16 autocast runs the op in the half type (the parameters gathered
/// in it: on the crate's half kernels, see `half`, or by the backend's own `linear`) or reads
/// the parameters in f32 (gathered in f32), or fp8 autocast rounds them (see `fp8`).
/// Otherwise the inputs back, for the op's usual path.
pub(crate) fn linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
) -> Result<FloatTensor<B>, LinearInputs<B>> {
    let Some(weight_shard) = shard_of::<B>(&weight) else {
        return Err((x, weight, bias));
    };
    let device = B::float_device(&x);
    // The op's own path co-locates the operands first.
    let one_device = B::float_device(&weight) == device
        && bias.as_ref().is_none_or(|b| B::float_device(b) == device);
    if let Some(crate::Precision::Bf16 | crate::Precision::F16) = crate::autocast::current()
        && shard_of::<B>(&x).is_none()
        && one_device
        && let Some(tracked) = tracked::<B>()
    {
        return Ok(autocast_linear::<B>(x, weight, bias, weight_shard, tracked));
    }
    if fp8::applies::<B>() && shard_of::<B>(&x).is_none() {
        let hook = tracked::<B>().map(|tracked| tracked.fp8_linear);
        return Ok(fp8::autocast_linear::<B>(
            x,
            weight,
            bias,
            weight_shard,
            hook,
        ));
    }
    let same_dtype =
        weight.dtype() == x.dtype() && bias.as_ref().is_none_or(|b| b.dtype() == x.dtype());
    let applies = same_dtype && crate::autocast::current().is_none() && shard_of::<B>(&x).is_none();
    let Some(tracked) = tracked::<B>().filter(|_| applies) else {
        return Err((x, weight, bias));
    };
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
    Ok((tracked.linear)(
        x,
        weight,
        bias,
        weight_shard,
        bias_shard,
        None,
    ))
}

#[cfg(feature = "flex")]
fn half_linear_hook<B: Backend>() -> Option<half::HalfLinear<B>> {
    hooks::get::<HalfLinearHooks, B, half::HalfLinear<B>>()
}

#[cfg(feature = "flex")]
fn half_matmul_hook<B: Backend>() -> Option<half::HalfMatmul<B>> {
    hooks::get::<HalfMatmulHooks, B, half::HalfMatmul<B>>()
}

// `matmul` under bf16/f16 autocast with a registered parameter operand: the op's own path
// (`crate::backend::forward`'s `float_matmul`: the plan, the casts, `lowered::matmul`), the
// plan decided once, with each parameter operand gathered for the product alone: in the half
// type where the product runs in it (on the crate's half kernel where `lowered::matmul` takes
// it, a broadcast operand expanded as that path expands it; else by the backend's own
// `float_matmul` on the half operands, as Burn's node on autocast's casts), in f32 where the
// plan reads it as it is (an fp32-class matmul); otherwise gathered whole in f32 and cast,
// as every other op reads a parameter.
fn autocast_matmul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    [lhs_shard, rhs_shard]: [Option<Arc<dyn Shard>>; 2],
    tracked: Tracked<B>,
) -> FloatTensor<B> {
    use crate::autocast::{CastInput, CastPlan, Op};
    let plan = CastPlan::new::<B>(Op::Matmul, &[CastInput::One(&lhs), CastInput::One(&rhs)]);
    let target = plan
        .target()
        .filter(|t| matches!(t, FloatDType::BF16 | FloatDType::F16));
    // Each operand as the product would take it: a parameter kept f32 (gathered in the half
    // type), any other cast as the op's own path casts it.
    let lhs = match &lhs_shard {
        Some(_) => lhs,
        None => plan.cast_at::<B>(0, lhs),
    };
    let rhs = match &rhs_shard {
        Some(_) => rhs,
        None => plan.cast_at::<B>(1, rhs),
    };
    let operand_fits =
        |t: &FloatTensor<B>, shard: &Option<Arc<dyn Shard>>, target: FloatDType| match shard {
            Some(_) => t.dtype() == DType::F32,
            None => t.dtype() == DType::from(target),
        };
    let half_operands =
        target.filter(|&t| operand_fits(&lhs, &lhs_shard, t) && operand_fits(&rhs, &rhs_shard, t));
    #[cfg(feature = "flex")]
    let (lhs, rhs) = match half_kernel_matmul::<B>(half_operands, lhs, rhs, &lhs_shard, &rhs_shard)
    {
        Ok(output) => return output,
        Err(operands) => operands,
    };
    // Where the plan reads the parameter operands as they are (an fp32-class matmul:
    // `lowered::matmul` runs `B::float_matmul` on the cast operands), the bounded path of
    // autocast off, the parameters gathered in their own dtype.
    let read_as_is = |t: &FloatTensor<B>| {
        plan.target()
            .is_none_or(|target| t.dtype() == DType::from(target))
    };
    let params_as_is = [(&lhs, &lhs_shard), (&rhs, &rhs_shard)]
        .into_iter()
        .all(|(t, shard)| shard.is_none() || read_as_is(t));
    if params_as_is && lhs.dtype() == rhs.dtype() {
        let (lhs, rhs) = anchored_operands::<B>(lhs, rhs, &lhs_shard, &rhs_shard);
        return (tracked.matmul)(lhs, rhs, lhs_shard, rhs_shard, None);
    }
    // Where the plan casts the f32 parameter operands to the half type and `lowered::matmul`
    // runs `B::float_matmul` on the half operands (a backend without the crate's half
    // kernel, or the backend's own half path chosen): the parameters gathered in the half
    // type, each process casting its slice with autocast's cast, for Burn's node on them.
    if let Some(dtype) = half_operands {
        let (lhs, rhs) = anchored_operands::<B>(lhs, rhs, &lhs_shard, &rhs_shard);
        return (tracked.matmul)(lhs, rhs, lhs_shard, rhs_shard, Some(dtype));
    }
    let lhs = plan.cast_at::<B>(0, resolve::<B>(lhs));
    let rhs = plan.cast_at::<B>(1, resolve::<B>(rhs));
    super::lowered::matmul::<B>(&plan, lhs, rhs)
}

// `matmul` on the crate's half kernel (`half`: `Autodiff<Flex>`, where `lowered::matmul` runs
// it there: batches equal or broadcast), the parameter operands gathered in `half_operands`'
// half type for the product alone; the operands back where the kernel does not take it.
#[cfg(feature = "flex")]
fn half_kernel_matmul<B: Backend>(
    half_operands: Option<FloatDType>,
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
    lhs_shard: &Option<Arc<dyn Shard>>,
    rhs_shard: &Option<Arc<dyn Shard>>,
) -> Result<FloatTensor<B>, (FloatTensor<B>, FloatTensor<B>)> {
    let kernel_applies = super::lowered::broadcast_batches(lhs.shape(), rhs.shape()).is_some();
    let (Some(target), true, Some(half_matmul)) =
        (half_operands, kernel_applies, half_matmul_hook::<B>())
    else {
        return Err((lhs, rhs));
    };
    let Some((_, route)) = super::lowered::chosen::<B>() else {
        return Err((lhs, rhs));
    };
    let (lhs, rhs) = anchored_operands::<B>(lhs, rhs, lhs_shard, rhs_shard);
    Ok(half_matmul(
        lhs,
        rhs,
        lhs_shard.clone(),
        rhs_shard.clone(),
        target,
        route,
    ))
}

// `linear` under bf16/f16 autocast of the registered parameter `weight`: the op's own path
// (`crate::backend::forward`'s `linear`: the cast plan, the casts, `lowered::linear`), with
// the plan decided once (it tallies the call). The parameters are gathered for the op alone:
// in the half type where the op runs in it (on the crate's half kernels where
// `lowered::linear` takes them, else by the backend's own `linear` on the half operands, as
// Burn's node on autocast's casts), in f32 where the plan reads them as they are (the small-op
// rule's f32, the fp32 class); otherwise (parameters of another dtype) gathered whole in f32
// and cast, as every other op reads a parameter.
fn autocast_linear<B: Backend>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: Arc<dyn Shard>,
    tracked: Tracked<B>,
) -> FloatTensor<B> {
    use crate::autocast::{CastInput, CastPlan, Op};
    let plan = CastPlan::new::<B>(
        Op::Linear,
        &[
            CastInput::One(&x),
            CastInput::One(&weight),
            CastInput::Maybe(&bias),
        ],
    );
    let bias_shard = bias.as_ref().and_then(shard_of::<B>);
    let x = plan.cast_at::<B>(0, x);
    let target = plan
        .target()
        .filter(|t| matches!(t, FloatDType::BF16 | FloatDType::F16));
    #[cfg(feature = "flex")]
    let (x, weight, bias) =
        match half_kernel_linear::<B>(target, x, weight, bias, &weight_shard, &bias_shard) {
            Ok(output) => return output,
            Err(inputs) => inputs,
        };
    // The bounded linear on the parameters' anchors, gathered in `half` where given.
    let bounded = |x: FloatTensor<B>, weight, bias: Option<FloatTensor<B>>, half| {
        let (weight, bias) = anchors::<B>(&x, weight, bias, &weight_shard, &bias_shard);
        (tracked.linear)(
            x,
            weight,
            bias,
            weight_shard.clone(),
            bias_shard.clone(),
            half,
        )
    };
    // Where the plan reads the parameters as they are (an op the small-op rule keeps in f32,
    // or an fp32-class one: `lowered::linear` runs `B::linear` on the cast input), the
    // bounded path of autocast off, the parameters gathered in their own dtype.
    let read_as_is = |t: &FloatTensor<B>| {
        t.dtype() == x.dtype()
            && plan
                .target()
                .is_none_or(|target| t.dtype() == DType::from(target))
    };
    if read_as_is(&weight) && bias.as_ref().is_none_or(read_as_is) {
        return bounded(x, weight, bias, None);
    }
    // Where the plan casts the f32 parameters to the half type and `lowered::linear` runs
    // `B::linear` on the half operands (a backend without the crate's half kernels, or the
    // backend's own half path chosen): the parameters gathered in the half type, each process
    // casting its slice with autocast's cast, for Burn's node on them. Where `lowered::linear`
    // would run the crate's kernels instead (a bias that is no parameter, which the kernels' path
    // above leaves to the op's own path), the op's own path, for the kernels' bits.
    let half_input = target.filter(|t| x.dtype() == DType::from(*t));
    let f32_params =
        weight.dtype() == DType::F32 && bias.as_ref().is_none_or(|b| b.dtype() == DType::F32);
    let kernels_run = x.shape().num_dims() >= 2
        && weight.shape().num_dims() == 2
        && super::lowered::chosen::<B>().is_some();
    if let Some(dtype) = half_input
        && f32_params
        && !kernels_run
    {
        // A bias that is no parameter is cast by the plan, as the op's own path casts it.
        let bias = match bias_shard {
            Some(_) => bias,
            None => plan.cast_opt::<B>(bias),
        };
        return bounded(x, weight, bias, Some(dtype));
    }
    let weight = resolve::<B>(weight);
    let bias = resolve_opt::<B>(bias);
    let weight = plan.cast_at::<B>(1, weight);
    let bias = plan.cast_opt::<B>(bias);
    super::lowered::linear::<B>(&plan, x, weight, bias)
}

// `linear` on the crate's half kernels (`half`: `Autodiff<Flex>`, where `lowered::linear`
// runs it there), the parameters gathered in the half type `target` for the op alone; the
// inputs back where the kernels do not take the op.
#[cfg(feature = "flex")]
fn half_kernel_linear<B: Backend>(
    target: Option<FloatDType>,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    weight_shard: &Arc<dyn Shard>,
    bias_shard: &Option<Arc<dyn Shard>>,
) -> Result<FloatTensor<B>, LinearInputs<B>> {
    // `lowered::linear`'s conditions for the kernels: half operands of one dtype (the plan
    // casts the f32 parameters to it), a 2-D weight, an input of two dimensions or more.
    let dims = x.shape().num_dims();
    let kernels_apply = target.is_some_and(|t| x.dtype() == DType::from(t))
        && weight.dtype() == DType::F32
        && bias
            .as_ref()
            .is_none_or(|b| b.dtype() == DType::F32 && bias_shard.is_some())
        && weight.shape().num_dims() == 2
        && dims >= 2;
    let (Some(target), true, Some(half_linear)) = (target, kernels_apply, half_linear_hook::<B>())
    else {
        return Err((x, weight, bias));
    };
    let Some((_, route)) = super::lowered::chosen::<B>() else {
        return Err((x, weight, bias));
    };
    let shape = x.shape();
    let features = shape[dims - 1];
    let rows = shape.num_elements() / features.max(1);
    // As `lowered::linear`: the matrix of the input's rows, reshaped back after.
    let x = match dims {
        2 => x,
        _ => B::float_reshape(x, [rows, features].into()),
    };
    let (weight, bias) = anchors::<B>(&x, weight, bias, weight_shard, bias_shard);
    let mut out_shape = shape.clone();
    out_shape[dims - 1] = weight.shape()[1];
    let product = half_linear(
        x,
        weight,
        bias,
        weight_shard.clone(),
        bias_shard.clone(),
        target,
        route,
    );
    Ok(match dims {
        2 => product,
        _ => B::float_reshape(product, out_shape),
    })
}

/// `matmul(lhs, rhs)` with the per-op bound, where it applies: an operand is a registered
/// parameter, and autocast lowers nothing and the operands share a dtype, or bf16/f16
/// autocast runs the product in the half type (the parameters gathered in it: on the crate's
/// half kernel, or by the backend's own `float_matmul`) or reads the parameters in f32, or
/// fp8 autocast rounds them. Otherwise the inputs back, for the op's usual path.
pub(crate) fn float_matmul<B: Backend>(
    lhs: FloatTensor<B>,
    rhs: FloatTensor<B>,
) -> Result<FloatTensor<B>, (FloatTensor<B>, FloatTensor<B>)> {
    let (lhs_shard, rhs_shard) = (shard_of::<B>(&lhs), shard_of::<B>(&rhs));
    if (lhs_shard.is_some() || rhs_shard.is_some())
        && let Some(crate::Precision::Bf16 | crate::Precision::F16) = crate::autocast::current()
        // The op's own path co-locates the operands first.
        && B::float_device(&lhs) == B::float_device(&rhs)
        && let Some(tracked) = tracked::<B>()
    {
        return Ok(autocast_matmul::<B>(
            lhs,
            rhs,
            [lhs_shard, rhs_shard],
            tracked,
        ));
    }
    if (lhs_shard.is_some() || rhs_shard.is_some()) && fp8::applies::<B>() {
        let hook = tracked::<B>().map(|tracked| tracked.fp8_matmul);
        return Ok(fp8::autocast_matmul::<B>(
            lhs,
            rhs,
            [lhs_shard, rhs_shard],
            hook,
        ));
    }
    let applies = (lhs_shard.is_some() || rhs_shard.is_some())
        && lhs.dtype() == rhs.dtype()
        && crate::autocast::current().is_none();
    let Some(tracked) = tracked::<B>().filter(|_| applies) else {
        return Err((lhs, rhs));
    };
    let (lhs, rhs) = anchored_operands::<B>(lhs, rhs, &lhs_shard, &rhs_shard);
    Ok((tracked.matmul)(lhs, rhs, lhs_shard, rhs_shard, None))
}

/// `embedding(weights, indices)` with the per-op bound, where the weights are a registered
/// parameter: gathered for the lookup alone; the backward needs only their shape. Otherwise
/// the inputs back.
pub(crate) fn embedding<B: Backend>(
    weights: FloatTensor<B>,
    indices: IntTensor<B>,
) -> Result<FloatTensor<B>, (FloatTensor<B>, IntTensor<B>)> {
    let Some(shard) = shard_of::<B>(&weights) else {
        return Err((weights, indices));
    };
    let Some(tracked) = tracked::<B>() else {
        return Err((weights, indices));
    };
    let weights = anchored::<B>(weights, None, shard.clone());
    Ok((tracked.embedding)(weights, indices, shard))
}

// The weight as a backward node keeps it: its placeholder and shard, gathered again where
// the input's gradient needs it.
struct Weight<B: Backend> {
    tensor: FloatTensor<B>,
    shard: Arc<dyn Shard>,
}

impl<B: Backend> Clone for Weight<B> {
    fn clone(&self) -> Self {
        Weight {
            tensor: self.tensor.clone(),
            shard: self.shard.clone(),
        }
    }
}

impl<B: Backend> core::fmt::Debug for Weight<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Weight")
    }
}

// Burn's `linear` node's state: the input where the weight's gradient needs it, the weight
// (kept as its placeholder) where the input's does, and under autocast the half type the
// parameters were gathered in.
type LinearState<B> = (Option<FloatTensor<B>>, Option<Weight<B>>, Option<Half>);

// Burn's linear backward (`burn-autodiff`'s `LinearWithBias`/`LinearNoBias`: the same ops
// in the same order), with the weight gathered for the input's gradient alone; under
// autocast each parameter's gradient then cast to f32, as its cast node's backward casts it.
fn linear_backward<B: Backend>(
    [node_x, node_weight, node_bias]: [Option<NodeId>; 3],
    grad: FloatTensor<B>,
    state: LinearState<B>,
    grads: &mut Gradients,
) {
    let (x, weight, half) = state;
    let dtype = half.map(|h| h.dtype);
    if let Some(node) = node_x {
        let weight = weight.expect("kept where the input is tracked");
        let (gathered, bytes) = gather_in::<B>(weight.shard.as_ref(), &weight.tensor, dtype);
        let grad = B::linear_x_backward(gathered, grad.clone());
        count_dropped(bytes);
        grads.register::<B>(node, grad);
    }
    if let Some(node) = node_weight {
        let x = x.expect("kept where the weight is tracked");
        let grad = B::linear_weight_backward(x, grad.clone());
        grads.register::<B>(node, to_param::<B>(dtype, grad));
    }
    if let Some(node) = node_bias {
        let grad = B::linear_bias_backward(grad);
        let grad = match half {
            Some(Half {
                bias_registered: false,
                ..
            }) => grad,
            _ => to_param::<B>(dtype, grad),
        };
        grads.register::<B>(node, grad);
    }
}

// Burn's linear node, as `linear_backward`.
#[derive(Debug)]
struct BoundedLinear;

impl<B: Backend> WithOptionalThird<B> for BoundedLinear {
    type State = LinearState<B>;

    fn run(
        self,
        parents: [Option<NodeId>; 3],
        grad: FloatTensor<B>,
        state: Self::State,
        grads: &mut Gradients,
    ) {
        linear_backward::<B>(parents, grad, state, grads);
    }
}

/// The backward of a node over an input, a parameter and an optional third input (a
/// layer's bias, a norm's beta): [`UpToThree`] makes it one node of either arity, as Burn's
/// `LinearWithBias` and `LinearNoBias` are two.
trait WithOptionalThird<B: Backend>: core::fmt::Debug + Send + Sized + 'static {
    type State: Clone + core::fmt::Debug + Send + 'static;

    /// The gradients of the node's parents (`None`: untracked, or no third input).
    fn run(
        self,
        parents: [Option<NodeId>; 3],
        grad: FloatTensor<B>,
        state: Self::State,
        grads: &mut Gradients,
    );
}

/// A [`WithOptionalThird`] node over two or three parents.
#[derive(Debug)]
struct UpToThree<T>(T);

impl<B: Backend, T: WithOptionalThird<B>, const N: usize> Backward<B, N> for UpToThree<T> {
    type State = T::State;

    fn backward(self, ops: Ops<Self::State, N>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let ids = ops.parents.map(|parent| parent.map(|node| node.id));
        let parents = core::array::from_fn(|i| ids.get(i).copied().flatten());
        self.0.run(parents, grad, ops.state, grads);
    }
}

/// `output` as the op of `node` over `input`, `parameter` and `third` (where given), keeping
/// `state()` where a parent is tracked.
fn up_to_three<B: Backend, C: CheckpointStrategy, T: WithOptionalThird<B>>(
    node: T,
    [input, parameter]: [&FloatTensor<Autodiff<B, C>>; 2],
    third: Option<&FloatTensor<Autodiff<B, C>>>,
    state: impl FnOnce() -> T::State,
    output: FloatTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    let node = UpToThree(node);
    match third {
        Some(third) => match node
            .prepare::<C>([
                input.node.clone(),
                parameter.node.clone(),
                third.node.clone(),
            ])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state(), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
        None => match node
            .prepare::<C>([input.node.clone(), parameter.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state(), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        },
    }
}

// Burn's `linear` on `Autodiff<B, C>` with the weight (and a registered bias) gathered for the
// forward op alone, in `half` where given (autocast's half type, each process casting its slice),
// and a node that keeps the placeholder instead of the gathered weight.
fn bounded_linear<B: Backend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    weight: FloatTensor<Autodiff<B, C>>,
    bias: Option<FloatTensor<Autodiff<B, C>>>,
    weight_shard: Arc<dyn Shard>,
    bias_shard: Option<Arc<dyn Shard>>,
    half: Option<FloatDType>,
) -> FloatTensor<Autodiff<B, C>> {
    let (x_tracked, weight_tracked) = (x.is_tracked(), weight.is_tracked());
    let (whole_weight, mut bytes) = gather_in::<B>(weight_shard.as_ref(), &weight.primitive, half);
    let whole_bias = bias.as_ref().map(|bias| match &bias_shard {
        Some(shard) => {
            let (whole, counted) = gather_in::<B>(shard.as_ref(), &bias.primitive, half);
            bytes += counted;
            whole
        }
        None => bias.primitive.clone(),
    });
    let output = B::linear(x.primitive.clone(), whole_weight, whole_bias);
    count_dropped(bytes);
    let half = half.map(|dtype| Half {
        dtype,
        bias_registered: bias_shard.is_some(),
    });
    let state = || {
        (
            weight_tracked.then(|| x.primitive.clone()),
            x_tracked.then(|| Weight {
                tensor: weight.primitive.clone(),
                shard: weight_shard.clone(),
            }),
            half,
        )
    };
    up_to_three::<B, C, _>(BoundedLinear, [&x, &weight], bias.as_ref(), state, output)
}

// What an anchor's backward node keeps: the parameter's shard, its node id (the anchor's
// entry), and the input whose order placed the anchor (see `anchor`).
struct AnchorState<B: Backend, C: CheckpointStrategy> {
    shard: Arc<dyn Shard>,
    leaf: u64,
    input: Option<FloatTensor<Autodiff<B, C>>>,
}

impl<B: Backend, C: CheckpointStrategy> Clone for AnchorState<B, C> {
    fn clone(&self) -> Self {
        AnchorState {
            shard: self.shard.clone(),
            leaf: self.leaf,
            input: self.input.clone(),
        }
    }
}

impl<B: Backend, C: CheckpointStrategy> core::fmt::Debug for AnchorState<B, C> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("AnchorState")
    }
}

// The anchor's node: its parents are the parameter and the input (see `anchor`).
#[derive(Debug)]
struct Anchor<C>(core::marker::PhantomData<C>);

impl<B: Backend, C: CheckpointStrategy> Backward<B, 2> for Anchor<C> {
    type State = AnchorState<B, C>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [leaf, _input] = ops.parents;
        anchor_backward::<B, C>(leaf.map(|node| node.id), grad, ops.state, grads);
    }
}

// An anchor with no input to place it (the op's other inputs are not tracked, or the op is
// not one that passes them: see `resolve`): its parent is the parameter alone.
#[derive(Debug)]
struct AnchorAlone<C>(core::marker::PhantomData<C>);

impl<B: Backend, C: CheckpointStrategy> Backward<B, 1> for AnchorAlone<C> {
    type State = AnchorState<B, C>;

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let grad = grads.consume::<B>(&ops.node);
        let [leaf] = ops.parents;
        anchor_backward::<B, C>(leaf.map(|node| node.id), grad, ops.state, grads);
    }
}

// A parameter's anchor: an identity node between the parameter (a leaf) and every op of this
// pass that reads it, so that Burn's autodiff has summed every use's gradient before the
// anchor's backward runs (a layer used twice, tied weights), and the anchor alone hands the
// sum on: as it is while a window accumulates, reduce-scattered on the pass that completes
// it (`Registry::reducing`), each process keeping its slice's mean.
//
// Burn runs a backward pass deepest node first (`depth`: one more than the deepest parent).
// A parameter's depth is 0, so an anchor over the parameter alone would run after every
// other node, every gradient whole until the end of the pass. The anchor's second parent is
// the input of the op that first reads the parameter (a linear layer's `x`): it sits just
// above that input, so it runs right after the backward of the layers above it (its uses are
// deeper still), before anything below. Its backward adds nothing to the input's gradient.
fn anchor<B: Backend, C: CheckpointStrategy>(
    leaf: FloatTensor<Autodiff<B, C>>,
    input: Option<&FloatTensor<Autodiff<B, C>>>,
    shard: Arc<dyn Shard>,
) -> FloatTensor<Autodiff<B, C>> {
    if !leaf.is_tracked() {
        return leaf;
    }
    // An input that is not tracked (the data) places nothing: the parameter's order is kept.
    let input = input.filter(|input| input.is_tracked()).cloned();
    let state = AnchorState::<B, C> {
        shard,
        leaf: leaf.node.id.value,
        input: input.clone(),
    };
    let value = leaf.primitive.clone();
    match input {
        Some(input) => match Anchor::<C>(core::marker::PhantomData)
            .prepare::<C>([leaf.node.clone(), input.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        },
        None => match AnchorAlone::<C>(core::marker::PhantomData)
            .prepare::<C>([leaf.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, value),
            OpsKind::UnTracked(prep) => prep.finish(value),
        },
    }
}

fn anchor_backward<B: Backend, C: CheckpointStrategy>(
    leaf: Option<NodeId>,
    grad: FloatTensor<B>,
    state: AnchorState<B, C>,
    grads: &mut Gradients,
) {
    // An anchor kept from a forward pass whose graph was dropped without a backward (its
    // input is that pass's; one run after the batch started, which `discard_anchors` did
    // not see): that input's node runs in this backward too, and must find a gradient.
    // Zeros: the dropped pass contributes nothing.
    if let Some(input) = &state.input
        && input.grad(grads).is_none()
    {
        let zeros = B::float_zeros(
            input.primitive.shape(),
            &B::float_device(&input.primitive),
            FloatDType::from(input.primitive.dtype()),
        );
        grads.register::<B>(input.node.id, zeros);
    }
    // The next pass makes a new anchor: this one's node is spent.
    let reducing = registry(|r| {
        r.anchors.remove(&state.leaf);
        r.reducing
    });
    let Some(leaf) = leaf else {
        return;
    };
    let grad = if reducing {
        let grad = match take_window::<B>(state.leaf) {
            // The window's sum, in the order the step adds a pass to it (`grads::accumulate`).
            Some(earlier) => B::float_add(earlier, grad),
            None => grad,
        };
        reduce_to_slice::<B>(state.shard.as_ref(), grad)
    } else {
        grad
    };
    grads.register::<B>(leaf, grad);
}

// The window's earlier passes' sum for the parameter of node `leaf`, if any.
fn take_window<B: Backend>(leaf: u64) -> Option<FloatTensor<B>> {
    let earlier = registry(|r| r.window.remove(&leaf))?;
    Some(
        *earlier
            .downcast::<FloatTensor<B>>()
            .unwrap_or_else(|_| unreachable!("the window's gradients are the inner backend's")),
    )
}

/// This process's slice of the mean over the processes of `grad` (this process's whole
/// gradient of the parameter `shard` gathers), reduced in f32 (as ZeRO stage 2 reduces) and
/// cast back to `grad`'s dtype, shaped `[1, .., 1, slice]` in `grad`'s rank: the gradient of
/// the slice the optimizer steps.
pub(crate) fn reduce_to_slice<B: Backend>(
    shard: &dyn Shard,
    grad: FloatTensor<B>,
) -> FloatTensor<B> {
    let (rank, dtype, device) = (
        grad.shape().num_dims(),
        grad.dtype(),
        B::float_device(&grad),
    );
    let grad = if dtype == DType::F32 {
        grad
    } else {
        B::float_cast(grad, FloatDType::F32)
    };
    // The gradient's own buffer where it is not shared (no copy), and the slice's handed to
    // the tensor as it is.
    let grad = data_of::<B>(grad, "a gradient to reduce it")
        .into_vec::<f32>()
        .expect("the gradient was cast to f32");
    let mean = shard.reduce(grad);
    let shape = slice_shape(rank, mean.len());
    let mean = B::float_from_data(TensorData::new(mean, shape), &device);
    if dtype == DType::F32 {
        mean
    } else {
        B::float_cast(mean, FloatDType::from(dtype))
    }
}

/// The shape a slice of `len` values takes in a parameter's rank `rank`: `[1, .., 1, len]`
/// (what the optimizer steps and keeps state for at ZeRO stage 3).
pub(crate) fn slice_shape(rank: usize, len: usize) -> Shape {
    let mut dims = vec![1; rank.max(1)];
    *dims.last_mut().expect("one dimension at least") = len;
    Shape::from(dims)
}

/// The node id of `tensor` and the shard it is registered with, if it is a registered
/// parameter (`B` the decorator over a registered autodiff backend).
pub(crate) fn registered<B: Backend>(tensor: &FloatTensor<B>) -> Option<(u64, Arc<dyn Shard>)> {
    let id = (tracked::<B>()?.node_id)(tensor);
    registry(|r| r.shards.get(&id).cloned()).map(|shard| (id, shard))
}

/// Starts a backward pass that reduce-scatters each parameter's gradient as soon as its
/// anchor has summed it: `window` holds the accumulation window's earlier passes' sums (an
/// inner backend's float primitives) by the parameters' node ids, added in before each
/// reduction.
pub(crate) fn begin_reducing(window: BTreeMap<u64, Box<dyn Any + Send>>) {
    registry(|r| {
        r.reducing = true;
        r.window = window;
    });
}

/// Ends what [`begin_reducing`] started; returns the window's sums that no anchor took (the
/// parameters the pass did not reach), to be reduced by the caller.
pub(crate) fn end_reducing() -> BTreeMap<u64, Box<dyn Any + Send>> {
    registry(|r| {
        r.reducing = false;
        core::mem::take(&mut r.window)
    })
}

// A `matmul` operand as its backward node keeps it: a registered parameter as its placeholder
// and shard, gathered again where the other operand's gradient needs it; any other tensor as
// it is.
struct Operand<B: Backend> {
    tensor: FloatTensor<B>,
    shard: Option<Arc<dyn Shard>>,
    // Under autocast, the half type a registered operand is gathered in (its gradient cast to
    // f32 for the parameter, as its cast node's backward casts it).
    half: Option<FloatDType>,
}

impl<B: Backend> Clone for Operand<B> {
    fn clone(&self) -> Self {
        Operand {
            tensor: self.tensor.clone(),
            shard: self.shard.clone(),
            half: self.half,
        }
    }
}

impl<B: Backend> core::fmt::Debug for Operand<B> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Operand")
    }
}

// Burn's `matmul` node's state (`burn-autodiff`'s `Matmul`: the left operand where the right
// one's gradient needs it, and the reverse), the operands' shapes where they broadcast, and
// the half type each operand was gathered in under autocast (a registered one).
type MatmulState<B> = (
    Option<Operand<B>>,
    Option<Operand<B>>,
    Option<(burn_backend::Shape, burn_backend::Shape)>,
    [Option<FloatDType>; 2],
);

#[derive(Debug)]
struct BoundedMatmul;

impl<B: Backend> Backward<B, 2> for BoundedMatmul {
    type State = MatmulState<B>;

    fn backward(self, ops: Ops<Self::State, 2>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (lhs, rhs, broadcast, [lhs_half, rhs_half]) = ops.state;
        let grad = grads.consume::<B>(&ops.node);
        let [node_lhs, node_rhs] = ops.parents;
        // Burn's `Matmul` backward: the same ops in the same order, each kept operand
        // gathered for its op alone.
        if let Some(node) = node_lhs {
            let rhs = rhs.expect("kept where the left operand is tracked");
            let (whole, bytes) = rhs.whole();
            let out = B::float_matmul(grad.clone(), B::float_transpose(whole));
            count_dropped(bytes);
            let out = match &broadcast {
                Some((lhs_shape, _)) => broadcast_shape::<B>(out, lhs_shape),
                None => out,
            };
            grads.register::<B>(node.id, to_param::<B>(lhs_half, out));
        }
        if let Some(node) = node_rhs {
            let lhs = lhs.expect("kept where the right operand is tracked");
            let (whole, bytes) = lhs.whole();
            let out = B::float_matmul(B::float_transpose(whole), grad);
            count_dropped(bytes);
            let out = match &broadcast {
                Some((_, rhs_shape)) => broadcast_shape::<B>(out, rhs_shape),
                None => out,
            };
            grads.register::<B>(node.id, to_param::<B>(rhs_half, out));
        }
    }
}

impl<B: Backend> Operand<B> {
    // The whole value (gathered where registered), and the bytes a gather counted.
    fn whole(&self) -> (FloatTensor<B>, u64) {
        match &self.shard {
            Some(shard) => gather_in::<B>(shard.as_ref(), &self.tensor, self.half),
            None => (self.tensor.clone(), 0),
        }
    }
}

// Burn's `matmul` on `Autodiff<B, C>` with each registered operand gathered for the forward op
// alone (in `half` where given: autocast's half type, each process casting its slice), and a node
// that keeps its placeholder instead of the gathered value.
fn bounded_matmul<B: Backend, C: CheckpointStrategy>(
    lhs: FloatTensor<Autodiff<B, C>>,
    rhs: FloatTensor<Autodiff<B, C>>,
    lhs_shard: Option<Arc<dyn Shard>>,
    rhs_shard: Option<Arc<dyn Shard>>,
    half: Option<FloatDType>,
) -> FloatTensor<Autodiff<B, C>> {
    // Under autocast a registered operand is an f32 parameter gathered in the half type; the
    // other operand autocast cast already.
    let half_of = |shard: &Option<Arc<dyn Shard>>| half.filter(|_| shard.is_some());
    let halves = [half_of(&lhs_shard), half_of(&rhs_shard)];
    let (lhs_tracked, rhs_tracked) = (lhs.is_tracked(), rhs.is_tracked());
    let (lhs_shape, rhs_shape) = (lhs.primitive.shape(), rhs.primitive.shape());
    // Burn's `BinaryOpsBroadcast`: any dimension that differs.
    let broadcast = (0..lhs_shape.num_dims())
        .any(|i| lhs_shape[i] != rhs_shape[i])
        .then_some((lhs_shape, rhs_shape));
    let lhs_kept = Operand {
        tensor: lhs.primitive.clone(),
        shard: lhs_shard,
        half: halves[0],
    };
    let rhs_kept = Operand {
        tensor: rhs.primitive.clone(),
        shard: rhs_shard,
        half: halves[1],
    };
    let (lhs_whole, lhs_bytes) = lhs_kept.whole();
    let (rhs_whole, rhs_bytes) = rhs_kept.whole();
    let output = B::float_matmul(lhs_whole, rhs_whole);
    count_dropped(lhs_bytes + rhs_bytes);
    match BoundedMatmul
        .prepare::<C>([lhs.node.clone(), rhs.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (
                rhs_tracked.then_some(lhs_kept),
                lhs_tracked.then_some(rhs_kept),
                broadcast,
                halves,
            ),
            output,
        ),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}

#[derive(Debug)]
struct BoundedEmbedding;

impl<B: Backend> Backward<B, 1> for BoundedEmbedding {
    // The weights' placeholder (their shape, device and dtype: all `embedding_backward`
    // reads of them) and the indices.
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
        let (weights, indices) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |grad| {
            B::embedding_backward(weights, grad, indices)
        });
    }
}

// Burn's `embedding` on `Autodiff<B, C>` with the weights gathered for the lookup alone.
// Burn's backward reads the weights' shape only (`ModuleOps::embedding_backward`'s default,
// and Flex's): the node keeps the placeholder.
fn bounded_embedding<B: Backend, C: CheckpointStrategy>(
    weights: FloatTensor<Autodiff<B, C>>,
    indices: IntTensor<Autodiff<B, C>>,
    shard: Arc<dyn Shard>,
) -> FloatTensor<Autodiff<B, C>> {
    let bytes = counted(&weights.primitive);
    let whole = gather::<B>(shard.as_ref(), &weights.primitive);
    let output = B::embedding(whole, indices.clone());
    count_dropped(bytes);
    match BoundedEmbedding
        .prepare::<C>([weights.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish((weights.primitive.clone(), indices), output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    }
}
