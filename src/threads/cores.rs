//! Which CPUs a process's step threads are pinned to, as pure arithmetic over a list of CPUs
//! (reading that list from the machine is [`super::affinity`]'s).
//!
//! - The CPUs this process may run on are split among the processes a launcher started on the
//!   machine, in contiguous runs of whole physical cores: two processes never share a core, so
//!   neither's threads slow the other's through a shared core's caches and units.
//! - Within a process's share, threads take one hardware thread of every core before any
//!   core's second: two threads on a 2-core, 4-thread share run on two cores, not one.
//! - With more processes than cores, the processes split the hardware threads instead (a core's
//!   siblings side by side); with more processes than CPUs there is nothing to pin to.

use std::collections::BTreeMap;

/// A logical CPU and the physical core it is a hardware thread of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Cpu {
    /// The kernel's number for it (what `taskset` and `sched_setaffinity` take).
    pub id: usize,
    /// Its core: (package, core within the package).
    pub core: (usize, usize),
}

/// More processes on this machine than CPUs they may run on.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooManyProcesses {
    pub processes: usize,
    pub cpus: usize,
}

/// More threads asked for than CPUs in this process's share.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TooManyThreads {
    pub threads: usize,
    pub cpus: usize,
}

/// The CPUs of process `local_index` of the `local_count` a launcher started on this machine,
/// in the order its threads take them.
pub(crate) fn process_share(
    cpus: &[Cpu],
    local_index: usize,
    local_count: usize,
) -> Result<Vec<usize>, TooManyProcesses> {
    let mut by_core = BTreeMap::<(usize, usize), Vec<usize>>::new();
    for cpu in cpus {
        by_core.entry(cpu.core).or_default().push(cpu.id);
    }
    // Cores in the order of their lowest CPU, each core's CPUs in ascending order: the
    // kernel's numbering, which is what users read in `lscpu` and `taskset`.
    let mut cores = by_core.into_values().collect::<Vec<_>>();
    for siblings in &mut cores {
        siblings.sort_unstable();
    }
    cores.sort_unstable_by_key(|siblings| siblings[0]);
    let split = |len: usize| {
        (len * local_index / local_count.max(1))..(len * (local_index + 1) / local_count.max(1))
    };
    if local_count <= cores.len() {
        let share = &cores[split(cores.len())];
        let widest = share.iter().map(Vec::len).max().unwrap_or(0);
        Ok((0..widest)
            .flat_map(|thread| {
                share
                    .iter()
                    .filter_map(move |core| core.get(thread).copied())
            })
            .collect())
    } else if local_count <= cpus.len() {
        let siblings_together = cores.concat();
        Ok(siblings_together[split(siblings_together.len())].to_vec())
    } else {
        Err(TooManyProcesses {
            processes: local_count,
            cpus: cpus.len(),
        })
    }
}

/// The CPU of each of `threads` threads, thread `i` on `share[i]`.
pub(crate) fn thread_cpus(share: &[usize], threads: usize) -> Result<Vec<usize>, TooManyThreads> {
    share
        .get(..threads)
        .map(<[usize]>::to_vec)
        .ok_or(TooManyThreads {
            threads,
            cpus: share.len(),
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    // `cores` cores of `siblings` hardware threads each, numbered as Linux numbers x86 CPUs:
    // every core's first thread, then every core's second (CPU `c` and `c + cores` share a
    // core).
    fn machine(cores: usize, siblings: usize) -> Vec<Cpu> {
        (0..cores * siblings)
            .map(|id| Cpu {
                id,
                core: (0, id % cores),
            })
            .collect()
    }

    #[test]
    fn one_process_takes_every_core_before_any_sibling() {
        assert_eq!(process_share(&machine(2, 1), 0, 1), Ok(vec![0, 1]));
        assert_eq!(
            process_share(&machine(4, 2), 0, 1),
            Ok(vec![0, 1, 2, 3, 4, 5, 6, 7])
        );
        // Siblings numbered side by side (as on some ARM and AMD firmware).
        let adjacent = (0..8)
            .map(|id| Cpu {
                id,
                core: (0, id / 2),
            })
            .collect::<Vec<_>>();
        assert_eq!(
            process_share(&adjacent, 0, 1),
            Ok(vec![0, 2, 4, 6, 1, 3, 5, 7])
        );
    }

    #[test]
    fn processes_on_one_machine_get_disjoint_whole_cores() {
        let cpus = machine(4, 2);
        let shares = (0..2)
            .map(|p| process_share(&cpus, p, 2).unwrap())
            .collect::<Vec<_>>();
        assert_eq!(shares, [vec![0, 1, 4, 5], vec![2, 3, 6, 7]]);
        // Three processes on five cores: shares as even as they can be, all cores used once.
        let cpus = machine(5, 1);
        let shares = (0..3)
            .map(|p| process_share(&cpus, p, 3).unwrap())
            .collect::<Vec<_>>();
        assert_eq!(shares, [vec![0], vec![1, 2], vec![3, 4]]);
    }

    #[test]
    fn more_processes_than_cores_split_the_hardware_threads() {
        let cpus = machine(2, 2);
        let shares = (0..4)
            .map(|p| process_share(&cpus, p, 4).unwrap())
            .collect::<Vec<_>>();
        assert_eq!(shares, [vec![0], vec![2], vec![1], vec![3]]);
        assert_eq!(
            process_share(&cpus, 0, 5),
            Err(TooManyProcesses {
                processes: 5,
                cpus: 4
            })
        );
    }

    #[test]
    fn a_restricted_process_shares_only_the_cpus_it_may_run_on() {
        // `taskset -c 2,3,6` on a 4-core, 8-thread machine: cores 2 and 3, core 2's sibling.
        let cpus = machine(4, 2)
            .into_iter()
            .filter(|cpu| [2, 3, 6].contains(&cpu.id))
            .collect::<Vec<_>>();
        assert_eq!(process_share(&cpus, 0, 1), Ok(vec![2, 3, 6]));
        assert_eq!(process_share(&cpus, 1, 2), Ok(vec![3]));
        // Two packages whose core numbers repeat: four cores, not two.
        let two_packages = (0..4)
            .map(|id| Cpu {
                id,
                core: (id / 2, id % 2),
            })
            .collect::<Vec<_>>();
        assert_eq!(process_share(&two_packages, 1, 4), Ok(vec![1]));
    }

    #[test]
    fn threads_take_the_share_in_order_and_never_double_up() {
        assert_eq!(thread_cpus(&[0, 1, 4, 5], 2), Ok(vec![0, 1]));
        assert_eq!(thread_cpus(&[0, 1, 4, 5], 4), Ok(vec![0, 1, 4, 5]));
        assert_eq!(
            thread_cpus(&[2, 3], 3),
            Err(TooManyThreads {
                threads: 3,
                cpus: 2
            })
        );
    }
}
