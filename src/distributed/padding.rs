//! The padded duplicates of a gathered last batch, dropped from its end: what
//! [`ProcessGroup::gather_for_metrics`](super::ProcessGroup::gather_for_metrics) and the data
//! loader's [`gather_for_metrics`](crate::data::gather_for_metrics) do, knowing how many to
//! drop from the loader's shard plan ([`crate::data`]'s `metrics` docs say why the duplicates
//! come last).

use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Tensor};

/// Drops `padding` duplicates from the end of an already gathered batch.
pub fn drop_padding<T>(mut gathered: Vec<T>, padding: usize) -> Vec<T> {
    gathered.truncate(gathered.len().saturating_sub(padding));
    gathered
}

/// [`drop_padding`] for a gathered tensor whose first dimension is the batch.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::tensor::Tensor;
/// use burn_accelerate::data::drop_padding_tensor;
/// type B = burn::backend::Flex;
///
/// let gathered = Tensor::<B, 1>::from_floats([4.0, 0.0, 1.0, 2.0], &Default::default());
/// assert_eq!(drop_padding_tensor(gathered, 3).dims(), [1]);
/// # }
/// ```
pub fn drop_padding_tensor<B, const D: usize, K>(
    gathered: Tensor<B, D, K>,
    padding: usize,
) -> Tensor<B, D, K>
where
    B: Backend,
    K: BasicOps<B>,
{
    let len = gathered.dims()[0];
    let keep = len.saturating_sub(padding);
    if keep == len {
        gathered
    } else {
        gathered.narrow(0, 0, keep)
    }
}
