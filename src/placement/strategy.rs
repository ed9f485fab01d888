//! Refusing what cannot work: a model spread over devices, trained data-parallel.

use burn::module::Module;
use burn::tensor::backend::Backend;

use super::PlacementError;
use super::key::describe;
use super::report::report;

/// How many parameter paths an error names per device.
const EXAMPLES_PER_DEVICE: usize = 3;

/// Checks that `module` can be trained data-parallel over `devices`, as the training hook
/// does before it starts ([`AccelerateStrategy::data_parallel`](crate::train::AccelerateStrategy::data_parallel),
/// and again when Burn's `fit` starts): with more than one device, each worker needs a whole
/// replica of the model on its own device, so a model spread over several devices (see
/// [`verify_device_map`](super::verify_device_map)) is refused with
/// [`SpreadForDataParallel`](PlacementError::SpreadForDataParallel), which names the model's
/// devices and a few parameter paths on each.
///
/// One device (or none) is not data-parallel, and anything goes: a spread model under the
/// single-device `Accelerator` is model-parallel, as under Accelerate without a distributed
/// type.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn::nn::LinearConfig;
/// use burn_accelerate::placement;
///
/// let device = Default::default();
/// let layer = LinearConfig::new(4, 2).init::<Flex>(&device);
/// placement::check_data_parallel(&layer, &[device, device])?; // whole on one device: fine
/// # }
/// # Ok::<(), burn_accelerate::placement::PlacementError>(())
/// ```
pub fn check_data_parallel<B: Backend, M: Module<B>>(
    module: &M,
    devices: &[B::Device],
) -> Result<(), PlacementError> {
    if devices.len() < 2 {
        return Ok(());
    }
    let report = report(module);
    if !report.is_spread() {
        return Ok(());
    }
    let workers: Vec<String> = devices.iter().map(describe).collect();
    Err(PlacementError::SpreadForDataParallel {
        devices: report.examples(EXAMPLES_PER_DEVICE),
        workers: format!("{} devices ({})", devices.len(), workers.join(", ")),
    })
}
