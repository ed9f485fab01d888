//! The CPUs the calling thread may run on, as the kernel says (`sched_getaffinity`): what the
//! pinning tests read back after `StepThreadsConfig::install`.

use nix::sched::{CpuSet, sched_getaffinity};
use nix::unistd::Pid;

/// The calling thread's affinity mask, as CPU numbers in ascending order.
pub fn thread_mask() -> Vec<usize> {
    // Pid 0: the calling thread.
    let mask = sched_getaffinity(Pid::from_raw(0)).expect("sched_getaffinity");
    (0..CpuSet::count())
        .filter(|&cpu| mask.is_set(cpu).unwrap_or(false))
        .collect()
}
