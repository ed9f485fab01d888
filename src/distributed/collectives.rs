//! Accelerate's collectives on tensors, for a training script's own use: `gather`,
//! `gather_for_metrics`, `reduce`, `broadcast`, `broadcast_object` and
//! `pad_across_processes`, as methods of [`ProcessGroup`].
//!
//! They travel as the tensors' own bytes (any dtype: int labels and bool masks arrive
//! exactly), gathered in rank order, so every process computes the same result; every
//! process must call them in the same order. For one process they return their input.

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Bytes, DType, ElementConversion, Numeric, Tensor, TensorData};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::DistributedError;
use super::group::{ProcessGroup, ReduceOp};
use crate::data::drop_padding_tensor;

impl ProcessGroup {
    /// Every process's `tensor`, concatenated along the first dimension in rank order, on
    /// every process (Accelerate's `gather`). The tensors may differ in their first dimension
    /// only.
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
        let all = self.gather_each(tensor)?;
        if all.len() == 1 {
            return Ok(all.into_iter().next().expect("one tensor"));
        }
        let first = all[0].dims();
        for (rank, t) in all.iter().enumerate() {
            if t.dims()[1..] != first[1..] {
                return Err(DistributedError::Mismatch {
                    rank,
                    detail: format!(
                        "its tensor has shape {:?} where process 0's has {first:?}: gather \
                         needs the same shape beyond the first dimension (see \
                         pad_across_processes)",
                        t.dims()
                    ),
                });
            }
        }
        Ok(Tensor::cat(all, 0))
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
    /// summed in rank order in the tensor's own dtype (an integer mean divides as integers
    /// do).
    ///
    /// # Errors
    /// As [`gather`](Self::gather); [`DistributedError::Mismatch`] for tensors of different
    /// shapes.
    pub fn reduce<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        op: ReduceOp,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: Numeric<B>,
    {
        let dims = tensor.dims();
        let all = self.gather_each(tensor)?;
        let n = all.len();
        if let Some(rank) = all.iter().position(|t| t.dims() != dims) {
            return Err(DistributedError::Mismatch {
                rank,
                detail: format!(
                    "its tensor has shape {:?} where this process's has {dims:?}: reduce needs \
                     the same shape everywhere",
                    all[rank].dims()
                ),
            });
        }
        let sum = all
            .into_iter()
            .reduce(|sum, t| sum + t)
            .expect("at least this process");
        Ok(match op {
            ReduceOp::Sum => sum,
            ReduceOp::Mean => sum.div_scalar(n as u32),
        })
    }

    /// Process `from`'s `tensor` on every process (Accelerate's `broadcast`): the others pass
    /// a tensor too (of any value), which is replaced.
    ///
    /// # Errors
    /// As [`gather`](Self::gather); [`DistributedError::Mismatch`] for `from` out of range.
    pub fn broadcast<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
        from: usize,
    ) -> Result<Tensor<B, D, K>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        let device = tensor.device();
        let bytes = self.broadcast_bytes(from, encode(tensor.into_data()))?;
        Ok(Tensor::from_data(decode(&bytes, from)?, &device))
    }

    /// Process `from`'s `value` on every process (Accelerate's `broadcast_object_list`, for
    /// small values: a seed, a flag, a path).
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
        let sizes = self.all_gather_bytes((dims[dim] as u64).to_le_bytes().to_vec())?;
        let largest = sizes
            .iter()
            .map(|b| u64::from_le_bytes(b[..8].try_into().unwrap_or([0; 8])) as usize)
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

    // Every process's tensor, in rank order, on this tensor's device.
    fn gather_each<B, const D: usize, K>(
        &self,
        tensor: Tensor<B, D, K>,
    ) -> Result<Vec<Tensor<B, D, K>>, DistributedError>
    where
        B: Backend,
        K: BasicOps<B>,
    {
        if self.world_size() == 1 {
            return Ok(vec![tensor]);
        }
        let (device, dtype) = (tensor.device(), tensor.dtype());
        let all = self.all_gather_bytes(encode(tensor.into_data()))?;
        all.iter()
            .enumerate()
            .map(|(rank, bytes)| {
                let data = decode(bytes, rank)?;
                if data.dtype != dtype {
                    return Err(DistributedError::Mismatch {
                        rank,
                        detail: format!(
                            "its tensor is {:?} where this process's is {dtype:?}",
                            data.dtype
                        ),
                    });
                }
                Ok(Tensor::from_data(data, &device))
            })
            .collect()
    }
}

// A tensor's data on the wire: its dtype and shape (JSON, behind their length), then its bytes.
fn encode(data: TensorData) -> Vec<u8> {
    let header = serde_json::to_vec(&(data.dtype, data.shape.to_vec())).expect("dtype and shape");
    let mut bytes = Vec::with_capacity(4 + header.len() + data.bytes.len());
    bytes.extend_from_slice(&(header.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&header);
    bytes.extend_from_slice(&data.bytes);
    bytes
}

fn decode(bytes: &[u8], rank: usize) -> Result<TensorData, DistributedError> {
    let unreadable = || DistributedError::Mismatch {
        rank,
        detail: "it sent something that is not a tensor".into(),
    };
    let len = u32::from_le_bytes(
        bytes
            .get(..4)
            .ok_or_else(unreadable)?
            .try_into()
            .unwrap_or([0; 4]),
    ) as usize;
    let header = bytes.get(4..4 + len).ok_or_else(unreadable)?;
    let (dtype, shape): (DType, Vec<usize>) =
        serde_json::from_slice(header).map_err(|_| unreadable())?;
    let values = &bytes[4 + len..];
    if values.len() != shape.iter().product::<usize>() * dtype.size() {
        return Err(unreadable());
    }
    Ok(TensorData {
        bytes: Bytes::from_bytes_vec(values.to_vec()),
        shape: shape.into(),
        dtype,
    })
}
