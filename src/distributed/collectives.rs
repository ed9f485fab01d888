//! Accelerate's collectives on tensors, for a training script's own use: `gather`,
//! `gather_for_metrics`, `reduce`, `broadcast`, `broadcast_object` and
//! `pad_across_processes`, plus `all_reduce_tensor` and `reduce_scatter_tensor` for sharded
//! training, as methods of [`ProcessGroup`].
//!
//! They move the tensors' own bytes (any dtype: int labels and bool masks arrive exactly;
//! sums are computed in the tensor's dtype), of any size, in rank order, so every process
//! computes the same result; every process must call them in the same order. For one process
//! they return their input.

use burn::tensor::backend::Backend;
use burn::tensor::{
    BasicOps, DType, ElementConversion, Numeric, Tensor, TensorCreationOptions, TensorData,
};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::dtype::ElementOf;
use super::element::Element;
use super::error::DistributedError;
use super::group::{ProcessGroup, ReduceOp, gather_buffer};
use super::padding::drop_padding_tensor;

/// What the processes must agree on before a tensor's bytes are combined.
type Meta = (DType, Vec<usize>);

impl ProcessGroup {
    /// Every process's `tensor`, concatenated along the first dimension in rank order, on
    /// every process (Accelerate's `gather`, torch's `all_gather_into_tensor` with uneven
    /// first dimensions). The tensors may differ in their first dimension only.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::tensor::{Int, Tensor};
    /// use burn_accelerate::distributed::ProcessState;
    /// type B = burn::backend::Flex;
    ///
    /// let group = ProcessState::single().group()?;
    /// let labels = Tensor::<B, 1, Int>::from_ints([3, 1], &Default::default());
    /// assert_eq!(group.gather(labels)?.dims(), [2]); // [2 × processes] under the launcher
    /// # }
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// What [`all_reduce`](Self::all_reduce) returns; [`DistributedError::Mismatch`] when
    /// the processes' tensors differ in dtype or beyond the first dimension.
    pub fn gather<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        if self.world_size() == 1 {
            return Ok(tensor);
        }
        let (dtype, dims) = (tensor.dtype(), tensor.dims());
        let metas = self.agree(
            dtype,
            &dims,
            |theirs| theirs.0 != dtype || theirs.1[1..] != dims[1..],
            "gather needs the same dtype and the same shape beyond the first dimension (see \
             pad_across_processes)",
        )?;
        let row = dims[1..].iter().product::<usize>() * dtype.size();
        // Another process's first dimension, as it claims it: a product past usize is its
        // error, not this process's overflow.
        let counts = metas
            .iter()
            .enumerate()
            .map(|(rank, (_, d))| {
                d[0].checked_mul(row)
                    .ok_or_else(|| DistributedError::Malformed {
                        rank,
                        detail: format!(
                            "its tensor of shape {d:?} has more bytes than usize holds"
                        ),
                    })
            })
            .collect::<Result<Vec<usize>, _>>()?;
        let mut gathered = gather_buffer::<u8>(&counts)?;
        let own: usize = counts[..self.rank()].iter().sum();
        let device = tensor.device();
        let data = tensor.into_data();
        gathered[own..own + data.bytes.len()].copy_from_slice(&data.bytes);
        self.all_gather_in_place(&mut gathered, &counts)?;
        let mut shape = dims.to_vec();
        shape[0] = metas.iter().map(|(_, d)| d[0]).sum();
        Ok(from_bytes(gathered, shape, dtype, &device))
    }

    /// [`gather`](Self::gather), then drops the last `padding` samples: the duplicates
    /// `even_batches` added to the last batch (Accelerate's `gather_for_metrics`), so that a
    /// metric sees every sample of the dataset once. Pass the loader's
    /// [`ShardIter::metrics_padding`](crate::data::ShardIter::metrics_padding) for each batch
    /// (0 except on the last).
    ///
    /// # Errors
    /// As [`gather`](Self::gather).
    pub fn gather_for_metrics<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        padding: usize,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        Ok(drop_padding_tensor(self.gather(tensor)?, padding))
    }

    /// The sum or mean of every process's `tensor` on every process (Accelerate's `reduce`),
    /// computed in the tensor's own dtype by the ring all-reduce (an integer mean divides as
    /// integers do; integers are exact).
    ///
    /// # Errors
    /// As [`gather`](Self::gather); [`DistributedError::Mismatch`] for tensors of different
    /// shapes or dtypes.
    pub fn reduce<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: Numeric<B>,
    {
        if self.world_size() == 1 {
            return Ok(tensor);
        }
        let (dtype, dims) = (tensor.dtype(), tensor.dims());
        self.agree(
            dtype,
            &dims,
            |theirs| theirs.0 != dtype || theirs.1 != dims,
            "reduce needs the same shape everywhere (and the same dtype)",
        )?;
        self.all_reduce_tensor_data(tensor, op)
    }

    /// [`all_reduce`](Self::all_reduce) of a float tensor, in its own dtype, on its device;
    /// without [`reduce`](Self::reduce)'s agreement on shapes first (one collective, not two).
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce).
    pub fn all_reduce_tensor<B: Backend, const D: usize>(
        &self,
        tensor: Tensor<B, D>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D>, DistributedError> {
        if self.world_size() == 1 {
            return Ok(tensor);
        }
        self.all_reduce_tensor_data(tensor, op)
    }

    fn all_reduce_tensor_data<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        let device = tensor.device();
        let mut data = tensor.into_data();
        let element = reducible(data.dtype)?;
        self.all_reduce_bytes(element, &mut data.bytes, op)?;
        let dtype = data.dtype;
        Ok(Tensor::from_data(data, options::<B>(&device, dtype)))
    }

    /// Sums (or averages) every process's `tensor` and gives each process its own rows of the
    /// result: process `r` gets the `counts[r]` rows (along the first dimension) after the
    /// first `counts[..r].sum()`, as [`reduce_scatter`](Self::reduce_scatter) does for flat
    /// buffers (MPI's per-process counts; [`shard_counts`](super::shard_counts) gives torch's
    /// even split). Computed in the tensor's dtype.
    ///
    /// ```
    /// # #[cfg(feature = "flex")] {
    /// use burn::tensor::Tensor;
    /// use burn_accelerate::distributed::{ProcessState, ReduceOp, shard_counts};
    /// type B = burn::backend::Flex;
    ///
    /// let group = ProcessState::single().group()?;
    /// let grads = Tensor::<B, 2>::ones([5, 3], &Default::default());
    /// let counts = shard_counts(5, group.world_size());
    /// let mine = group.reduce_scatter_tensor(grads, &counts, ReduceOp::Sum)?;
    /// assert_eq!(mine.dims(), [5, 3]); // [counts[rank], 3]
    /// # }
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// [`DistributedError::InvalidCall`] when `counts` does not have a count per process
    /// summing to the first dimension, or for a bool tensor; otherwise as
    /// [`all_reduce`](Self::all_reduce).
    pub fn reduce_scatter_tensor<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: Numeric<B>,
    {
        let dims = tensor.dims();
        let device = tensor.device();
        let mut data = tensor.into_data();
        let element = reducible(data.dtype)?;
        let row: usize = dims[1..].iter().product();
        if counts.iter().sum::<usize>() != dims[0] || counts.len() != self.world_size() {
            return Err(DistributedError::InvalidCall(format!(
                "reduce_scatter_tensor: counts {counts:?} must have one count per process ({}) \
                 summing to the tensor's first dimension ({})",
                self.world_size(),
                dims[0]
            )));
        }
        let values: Vec<usize> = counts.iter().map(|c| c * row).collect();
        let mine = self.reduce_scatter_bytes(element, &mut data.bytes, &values, op)?;
        let mut shape = dims.to_vec();
        shape[0] = counts[self.rank()];
        let dtype = data.dtype;
        Ok(from_bytes(data.bytes[mine].to_vec(), shape, dtype, &device))
    }

    /// Process `from`'s `tensor` on every process (Accelerate's `broadcast`): the others pass
    /// a tensor too (of any value), which is replaced.
    ///
    /// # Errors
    /// As [`gather`](Self::gather); [`DistributedError::InvalidCall`] for `from` out of range.
    pub fn broadcast<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        from: usize,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        if self.world_size() == 1 && from == 0 {
            return Ok(tensor);
        }
        let device = tensor.device();
        let meta: Meta = (tensor.dtype(), tensor.dims().to_vec());
        let data = tensor.into_data();
        let (dtype, shape): Meta = self.broadcast_object(&meta, from)?;
        let bytes = self.broadcast_bytes(from, data.bytes.to_vec())?;
        if bytes.len() != shape.iter().product::<usize>() * dtype.size() {
            return Err(DistributedError::Mismatch {
                rank: from,
                detail: format!(
                    "it sent {} bytes for a {dtype:?} tensor of shape {shape:?}",
                    bytes.len()
                ),
            });
        }
        Ok(from_bytes(bytes, shape, dtype, &device))
    }

    /// Process `from`'s `value` on every process (Accelerate's `broadcast_object_list`:
    /// a seed, a flag, a path, a configuration).
    ///
    /// ```
    /// # use burn_accelerate::distributed::ProcessState;
    /// let group = ProcessState::single().group()?;
    /// let seed: u64 = group.broadcast_object(&42u64, 0)?;
    /// assert_eq!(seed, 42);
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// As [`broadcast`](Self::broadcast).
    pub fn broadcast_object<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
        from: usize,
    ) -> Result<T, DistributedError> {
        let bytes = serde_json::to_vec(value).map_err(|e| DistributedError::Io {
            what: "serialising a broadcast value".into(),
            reason: e.to_string(),
        })?;
        let bytes = self.broadcast_bytes(from, bytes)?;
        serde_json::from_slice(&bytes).map_err(|e| DistributedError::Mismatch {
            rank: from,
            detail: format!("its value is not of the type this process expects: {e}"),
        })
    }

    /// Pads `tensor` along `dim` with `value`, at the end (or the start with `pad_first`), to
    /// the largest size any process has there (Accelerate's `pad_across_processes`), so that
    /// the processes' tensors can be gathered.
    ///
    /// # Errors
    /// As [`gather`](Self::gather).
    pub fn pad_across_processes<B, const D: usize, K, E>(
        &self,
        tensor: Tensor<B, D, K>,
        dim: usize,
        value: E,
        pad_first: bool,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
        E: ElementConversion,
    {
        let dims = tensor.dims();
        let largest = self
            .counts(dims[dim])?
            .into_iter()
            .max()
            .unwrap_or(dims[dim]);
        if largest == dims[dim] {
            return Ok(tensor);
        }
        let mut pad_dims = dims;
        pad_dims[dim] = largest - dims[dim];
        let pad = Tensor::<B, D, K>::full(pad_dims, value, &tensor.device());
        let parts = if pad_first {
            vec![pad, tensor]
        } else {
            vec![tensor, pad]
        };
        Ok(Tensor::cat(parts, dim))
    }

    // Every process's dtype and shape, once `differs` (given another process's) finds none
    // that cannot be combined with this one's; the error says what the call `needs`.
    fn agree(
        &self,
        dtype: DType,
        dims: &[usize],
        differs: impl Fn(&Meta) -> bool,
        needs: &str,
    ) -> Result<Vec<Meta>, DistributedError> {
        let ours = serde_json::to_vec(&(dtype, dims)).expect("dtypes and shapes serialise");
        let all = self.all_gather_bytes(&ours)?;
        all.iter()
            .enumerate()
            .map(|(rank, bytes)| {
                let meta: Meta =
                    serde_json::from_slice(bytes).map_err(|e| DistributedError::Malformed {
                        rank,
                        detail: format!("its tensor's dtype and shape are unreadable: {e}"),
                    })?;
                if !differs(&meta) {
                    return Ok(meta);
                }
                let detail = format!(
                    "its tensor is {:?} of shape {:?} where this process's is {dtype:?} of \
                     shape {dims:?}: {needs}",
                    meta.0, meta.1
                );
                Err(DistributedError::Mismatch { rank, detail })
            })
            .collect()
    }

    /// Every process's `bytes`, in rank order (of any lengths).
    pub(crate) fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>, DistributedError> {
        let counts = self.counts(bytes.len())?;
        let mut gathered = gather_buffer::<u8>(&counts)?;
        let own: usize = counts[..self.rank()].iter().sum();
        gathered[own..own + bytes.len()].copy_from_slice(bytes);
        self.all_gather_in_place(&mut gathered, &counts)?;
        let mut rest = gathered.as_slice();
        Ok(counts
            .iter()
            .map(|count| {
                let (one, after) = rest.split_at(*count);
                rest = after;
                one.to_vec()
            })
            .collect())
    }
}

/// The element a collective sums a tensor of `dtype` in.
fn reducible(dtype: DType) -> Result<Element, DistributedError> {
    Element::of(dtype).ok_or_else(|| {
        DistributedError::InvalidCall(format!(
            "a {dtype:?} tensor cannot be summed: reduce numbers (cast a mask to int first)"
        ))
    })
}

fn options<B: Backend>(device: &B::Device, dtype: DType) -> TensorCreationOptions<B> {
    TensorCreationOptions::new(device.clone()).with_dtype(dtype)
}

/// A tensor of `dtype` and `shape` on `device` from its bytes, without converting them.
fn from_bytes<B, const D: usize, K>(
    bytes: Vec<u8>,
    shape: Vec<usize>,
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    B: Backend,
    K: BasicOps<B>,
{
    let data = TensorData::from_bytes_vec(bytes, shape, dtype);
    Tensor::from_data(data, options::<B>(device, dtype))
}

impl ProcessGroup {
    /// Every process's `value`, in rank order, on every process (torch's
    /// `all_gather_object`): the values travel as JSON, so they may differ in size (a process's
    /// metric entries, a list of any length).
    ///
    /// ```
    /// # use burn_accelerate::distributed::ProcessState;
    /// let group = ProcessState::single().group()?;
    /// let counts: Vec<Vec<u32>> = group.all_gather_object(&vec![7u32, 1])?;
    /// assert_eq!(counts, [vec![7, 1]]); // one entry per process, in rank order
    /// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
    /// ```
    ///
    /// # Errors
    /// As [`all_reduce`](Self::all_reduce); [`DistributedError::Malformed`] when a process's
    /// value does not read as `T` (the processes called it with different types).
    pub fn all_gather_object<T: Serialize + DeserializeOwned>(
        &self,
        value: &T,
    ) -> Result<Vec<T>, DistributedError> {
        let bytes = serde_json::to_vec(value).map_err(|e| DistributedError::Io {
            what: "serialising a gathered value".into(),
            reason: e.to_string(),
        })?;
        self.all_gather_bytes(&bytes)?
            .iter()
            .enumerate()
            .map(|(rank, bytes)| {
                serde_json::from_slice(bytes).map_err(|e| DistributedError::Malformed {
                    rank,
                    detail: format!("its value is not of the type this process expects: {e}"),
                })
            })
            .collect()
    }
}
