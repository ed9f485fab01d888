//! The backend decorator: `Accelerated<B>` is `B` with autocast in front of its ops.

mod forward;
pub(crate) mod hooks;
mod placement;
mod rewrap;
pub(crate) mod tracked_move;

use burn_backend::tensor::{BoolTensor, FloatTensor, IntTensor, QuantizedTensor};
use burn_backend::{
    AutodiffBackend, Backend, BackendTypes, DType, DTypeUsageSet, ExecutionError, TensorData,
};
use core::marker::PhantomData;

/// A Burn backend that runs `B` with mixed-precision autocast.
///
/// Every op of every Burn ops trait is forwarded to `B` on `B`'s own tensor primitives (no
/// wrapper per tensor, nothing lost of `B`'s own kernels); ops in the autocast table first
/// have their float inputs cast as the current precision and the op's class say
/// (see [`autocast`](crate::autocast)).
///
/// Stack it above autodiff, `Accelerated<Autodiff<B>>`, the way PyTorch's autocast sits above
/// autograd: autodiff then records the casts, the backward pass runs in the same precision as
/// the forward one, and every parameter's gradient comes back in the parameter's own dtype.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::{Autodiff, Flex};
/// use burn::tensor::{DType, Tensor};
/// use burn_accelerate::{Accelerated, Precision, autocast};
///
/// type B = Accelerated<Autodiff<Flex>>; // was: Autodiff<Flex>
///
/// let device = Default::default();
/// let x = Tensor::<B, 2>::ones([2, 3], &device);
/// let w = Tensor::<B, 2>::ones([3, 4], &device).require_grad();
/// let _bf16 = autocast::enable(Precision::Bf16);
/// let y = x.matmul(w.clone());
/// assert_eq!(y.dtype(), DType::BF16);
/// let grads = y.sum().backward();
/// assert_eq!(w.grad(&grads).unwrap().dtype(), DType::F32); // the parameter's dtype
/// # }
/// ```
#[derive(Clone, Default, Debug)]
pub struct Accelerated<B> {
    _inner: PhantomData<B>,
}

impl<B: Backend> BackendTypes for Accelerated<B> {
    type Device = B::Device;
    type FloatTensorPrimitive = B::FloatTensorPrimitive;
    type FloatElem = B::FloatElem;
    type IntTensorPrimitive = B::IntTensorPrimitive;
    type IntElem = B::IntElem;
    type BoolTensorPrimitive = B::BoolTensorPrimitive;
    type BoolElem = B::BoolElem;
    type QuantizedTensorPrimitive = B::QuantizedTensorPrimitive;
}

impl<B: Backend> Backend for Accelerated<B> {
    fn ad_enabled(device: &Self::Device) -> bool {
        B::ad_enabled(device)
    }

    fn memory_persistent_allocations<
        Output: Send,
        Input: Send,
        Func: Fn(Input) -> Output + Send,
    >(
        device: &Self::Device,
        input: Input,
        func: Func,
    ) -> Output {
        B::memory_persistent_allocations(device, input, func)
    }

    fn memory_cleanup(device: &Self::Device) {
        B::memory_cleanup(device)
    }

    fn name(device: &Self::Device) -> String {
        format!("accelerated<{}>", B::name(device))
    }

    fn seed(device: &Self::Device, seed: u64) {
        B::seed(device, seed)
    }

    fn sync(device: &Self::Device) -> Result<(), ExecutionError> {
        B::sync(device)
    }

    fn staging<'a, Iter>(data: Iter, device: &Self::Device)
    where
        Iter: Iterator<Item = &'a mut TensorData>,
    {
        B::staging(data, device)
    }

    fn supports_dtype(device: &Self::Device, dtype: DType) -> bool {
        B::supports_dtype(device, dtype)
    }

    fn dtype_usage(device: &Self::Device, dtype: DType) -> DTypeUsageSet {
        B::dtype_usage(device, dtype)
    }

    fn device_count(type_id: u16) -> usize {
        B::device_count(type_id)
    }
}

/// `Accelerated<Autodiff<B>>` trains: its inner backend is `Accelerated<B>`, so a model's
/// `valid()` copy keeps autocast for evaluation.
impl<B: AutodiffBackend> AutodiffBackend for Accelerated<B> {
    type InnerBackend = Accelerated<B::InnerBackend>;
    type Gradients = B::Gradients;

    /// Differentiates `tensor`, first multiplied by the armed loss scale if one is armed
    /// ([`ArmedLossScale`](crate::scaler::ArmedLossScale)), so that an unmodified
    /// `loss.backward()` in a training step yields scaled gradients.
    fn backward(tensor: FloatTensor<Self>) -> Self::Gradients {
        let tensor = match crate::scaler::armed() {
            Some(scale) => B::float_mul_scalar(tensor, scale.into()),
            None => tensor,
        };
        B::backward(tensor)
    }

    fn grad(
        tensor: &FloatTensor<Self>,
        grads: &Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        B::grad(tensor, grads)
    }

    fn grad_remove(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
    ) -> Option<FloatTensor<Self::InnerBackend>> {
        B::grad_remove(tensor, grads)
    }

    fn grad_replace(
        tensor: &FloatTensor<Self>,
        grads: &mut Self::Gradients,
        grad: FloatTensor<Self::InnerBackend>,
    ) {
        B::grad_replace(tensor, grads, grad)
    }

    fn inner(tensor: FloatTensor<Self>) -> FloatTensor<Self::InnerBackend> {
        B::inner(tensor)
    }

    fn int_inner(tensor: IntTensor<Self>) -> IntTensor<Self::InnerBackend> {
        B::int_inner(tensor)
    }

    fn bool_inner(tensor: BoolTensor<Self>) -> BoolTensor<Self::InnerBackend> {
        B::bool_inner(tensor)
    }

    fn q_inner(tensor: QuantizedTensor<Self>) -> QuantizedTensor<Self::InnerBackend> {
        B::q_inner(tensor)
    }

    fn from_inner(tensor: FloatTensor<Self::InnerBackend>) -> FloatTensor<Self> {
        B::from_inner(tensor)
    }

    fn int_from_inner(tensor: IntTensor<Self::InnerBackend>) -> IntTensor<Self> {
        B::int_from_inner(tensor)
    }

    fn bool_from_inner(tensor: BoolTensor<Self::InnerBackend>) -> BoolTensor<Self> {
        B::bool_from_inner(tensor)
    }

    fn q_from_inner(tensor: QuantizedTensor<Self::InnerBackend>) -> QuantizedTensor<Self> {
        B::q_from_inner(tensor)
    }
}
