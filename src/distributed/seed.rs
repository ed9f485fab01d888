//! Accelerate's `set_seed`.

use burn::tensor::backend::Backend;

use super::error::DistributedError;
use super::process_state::ProcessState;

/// Seeds `B`'s generator on `device` with `seed`, plus this process's index when
/// `device_specific` (Accelerate's `set_seed(seed, device_specific=True)`: every process
/// draws different random numbers, e.g. for dropout, while the same run stays reproducible).
/// Returns the seed used.
///
/// Without `device_specific` every process gets the same seed: initialise the model after it
/// and every process starts from the same weights, as DDP needs.
///
/// ```
/// # #[cfg(feature = "flex")] {
/// use burn::backend::Flex;
/// use burn_accelerate::distributed::set_seed;
///
/// let device = Default::default();
/// assert_eq!(set_seed::<Flex>(42, true, &device)?, 42); // rank 0 of one process
/// # }
/// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
/// ```
///
/// # Errors
/// What [`ProcessState::from_env`] returns for a bad launch environment.
pub fn set_seed<B: Backend>(
    seed: u64,
    device_specific: bool,
    device: &B::Device,
) -> Result<u64, DistributedError> {
    let state = ProcessState::from_env()?;
    let seed = seed_for(seed, device_specific, &state);
    B::seed(device, seed);
    Ok(seed)
}

/// The seed process `state` uses for `seed` (what [`set_seed`] applies).
pub fn seed_for(seed: u64, device_specific: bool, state: &ProcessState) -> u64 {
    if device_specific {
        seed.wrapping_add(state.process_index() as u64)
    } else {
        seed
    }
}
