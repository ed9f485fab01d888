//! The machine's side of pinning: the CPUs this thread may run on, the core each belongs to,
//! and pinning the calling thread to one of them. Linux only; elsewhere each call says so.

use super::cores::Cpu;

/// The CPUs the calling thread may run on (its affinity mask: `taskset`, a cgroup's cpuset, a
/// job scheduler's allocation), each with its core from sysfs.
pub(crate) fn allowed_cpus() -> Result<Vec<Cpu>, String> {
    imp::allowed_cpus()
}

/// How many CPUs the machine has online (`/sys/devices/system/cpu/online`), whichever this
/// process may use; `None` where the kernel does not say.
pub(crate) fn online_cpus() -> Option<usize> {
    let list = std::fs::read_to_string("/sys/devices/system/cpu/online").ok()?;
    count_cpu_list(&list)
}

// The CPUs in a kernel CPU list such as `0-3,8-11` or `0`.
fn count_cpu_list(list: &str) -> Option<usize> {
    list.trim().split(',').try_fold(0, |count, range| {
        let (first, last) = match range.split_once('-') {
            Some((first, last)) => (first.parse::<usize>().ok()?, last.parse::<usize>().ok()?),
            None => {
                let cpu = range.parse::<usize>().ok()?;
                (cpu, cpu)
            }
        };
        Some(count + last.checked_sub(first)? + 1)
    })
}

/// Runs the calling thread on CPU `cpu` only.
pub(crate) fn pin_current(cpu: usize) -> Result<(), String> {
    imp::set_current(&[cpu])
}

/// Lets the calling thread run on the CPUs `mask` again (as [`allowed_cpus`] read them).
pub(crate) fn restore(mask: &[usize]) -> Result<(), String> {
    imp::set_current(mask)
}

#[cfg(target_os = "linux")]
mod imp {
    use super::Cpu;
    use nix::sched::{CpuSet, sched_getaffinity, sched_setaffinity};
    use nix::unistd::Pid;

    pub(super) fn allowed_cpus() -> Result<Vec<Cpu>, String> {
        // Pid 0: the calling thread.
        let mask = sched_getaffinity(Pid::from_raw(0))
            .map_err(|errno| format!("sched_getaffinity failed: {errno}"))?;
        Ok((0..CpuSet::count())
            .filter(|&id| mask.is_set(id).unwrap_or(false))
            .map(|id| Cpu {
                id,
                core: core_of(id),
            })
            .collect())
    }

    // Where sysfs does not say (some containers hide it), each CPU counts as a core of its own:
    // pinning then still keeps threads apart, only without knowing which are siblings.
    fn core_of(id: usize) -> (usize, usize) {
        let read = |name: &str| {
            std::fs::read_to_string(format!("/sys/devices/system/cpu/cpu{id}/topology/{name}"))
                .ok()?
                .trim()
                .parse::<usize>()
                .ok()
        };
        match (read("physical_package_id"), read("core_id")) {
            (Some(package), Some(core)) => (package, core),
            _ => (usize::MAX, id),
        }
    }

    pub(super) fn set_current(cpus: &[usize]) -> Result<(), String> {
        let mut mask = CpuSet::new();
        for &cpu in cpus {
            mask.set(cpu)
                .map_err(|errno| format!("CPU {cpu} is beyond the kernel's mask: {errno}"))?;
        }
        sched_setaffinity(Pid::from_raw(0), &mask)
            .map_err(|errno| format!("sched_setaffinity to CPUs {cpus:?} failed: {errno}"))
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    use super::Cpu;

    const UNSUPPORTED: &str = "pinning threads to CPUs is implemented for Linux only";

    pub(super) fn allowed_cpus() -> Result<Vec<Cpu>, String> {
        Err(UNSUPPORTED.into())
    }

    pub(super) fn set_current(_cpus: &[usize]) -> Result<(), String> {
        Err(UNSUPPORTED.into())
    }
}

#[cfg(test)]
mod tests {
    use super::count_cpu_list;

    #[test]
    fn kernel_cpu_lists_are_counted() {
        assert_eq!(count_cpu_list("0-1\n"), Some(2));
        assert_eq!(count_cpu_list("0"), Some(1));
        assert_eq!(count_cpu_list("0-3,8-11,16"), Some(9));
        assert_eq!(count_cpu_list(""), None);
        assert_eq!(count_cpu_list("3-1"), None);
        assert_eq!(count_cpu_list("0-x"), None);
    }
}
