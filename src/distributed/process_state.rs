//! [`ProcessState`]: Accelerate's `PartialState`: the process's place in the run (the
//! Burn-free [`ProcessLayout`] read from the environment), with the process group, the guards
//! and the collectives on it.

use burn_accelerate_comm::ProcessLayout;

use super::Rendezvous;
use super::error::DistributedError;

/// Which process of a run this is, and how to reach the others: Accelerate's `PartialState`.
///
/// Read it with [`from_env`](Self::from_env) from the variables `burn-accelerate launch` (or
/// torchrun) sets; with none of them set, it is a single process. The collectives
/// ([`wait_for_everyone`](Self::wait_for_everyone), the guards, and the gradient
/// synchronisation of the [`Accelerator`](crate::Accelerator) and the training strategy) join
/// the process group on first use.
///
/// ```
/// use burn_accelerate::distributed::ProcessState;
///
/// // What `burn-accelerate launch --num-processes 2` gives its second process.
/// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
///     ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
/// let state = ProcessState::from_vars(|name| {
///     vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
/// })?;
/// assert_eq!((state.process_index(), state.num_processes()), (1, 2));
/// assert!(!state.is_main_process() && !state.is_local_main_process());
///
/// // Nothing set: one process.
/// let single = ProcessState::from_vars(|_| None)?;
/// assert!(single.is_main_process() && single.num_processes() == 1);
/// # Ok::<(), burn_accelerate::distributed::DistributedError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessState(ProcessLayout);

impl ProcessState {
    /// One process: rank 0 of 1, on machine 0 of 1.
    pub fn single() -> Self {
        Self(ProcessLayout::single())
    }

    /// Reads the process's place in the run from the environment (see [`env`](super::env)
    /// for the variables); a single process when no launcher's variables are set.
    ///
    /// A program started directly in a Slurm allocation of several tasks (`salloc -n 2
    /// PROGRAM`, or a batch script's own line) is not a step of that many tasks: it runs as one
    /// process, and the first call says so on stderr (`srun` starts the tasks).
    ///
    /// # Errors
    /// A [`DistributedError`] naming the first variable that is missing, unparsable or
    /// inconsistent with the others.
    pub fn from_env() -> Result<Self, DistributedError> {
        ProcessLayout::from_env().map(Self)
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistributedError> {
        ProcessLayout::from_vars(var).map(Self)
    }

    /// The layout alone, as the crates below Burn know it.
    pub fn layout(&self) -> &ProcessLayout {
        &self.0
    }

    /// Number of processes in the run (Accelerate's `num_processes`).
    pub fn num_processes(&self) -> usize {
        self.0.num_processes()
    }

    /// This process's global rank (Accelerate's `process_index`).
    pub fn process_index(&self) -> usize {
        self.0.process_index()
    }

    /// This process's rank on its machine (`local_process_index`).
    pub fn local_process_index(&self) -> usize {
        self.0.local_process_index()
    }

    /// Processes per machine.
    pub fn local_num_processes(&self) -> usize {
        self.0.local_num_processes()
    }

    /// Number of machines (`num_machines`).
    pub fn num_machines(&self) -> usize {
        self.0.num_machines()
    }

    /// This machine's rank (`machine_rank`).
    pub fn machine_rank(&self) -> usize {
        self.0.machine_rank()
    }

    /// Whether this is the main process of the run (rank 0).
    pub fn is_main_process(&self) -> bool {
        self.0.is_main_process()
    }

    /// Whether this is the main process of its machine (local rank 0).
    pub fn is_local_main_process(&self) -> bool {
        self.0.is_local_main_process()
    }

    /// Whether there is more than one process.
    pub fn is_distributed(&self) -> bool {
        self.0.is_distributed()
    }

    /// Where the processes meet (`None` for a single process, and under MPI, whose own wiring
    /// replaces it).
    pub fn rendezvous(&self) -> Option<&Rendezvous> {
        self.0.rendezvous()
    }

    /// Whether MPI carries the run's collectives (an MPI launch, built with the `mpi` feature).
    pub fn over_mpi(&self) -> bool {
        self.0.over_mpi()
    }

    /// The line the main process prints when it joins the run: which engine carries the
    /// collectives, and why (`None` for a single process, which has none).
    pub(crate) fn engine_line(&self) -> Option<String> {
        self.0.engine_line()
    }

    /// Whether the launcher (`mpirun`, `srun`) binds each process to CPUs of its own, so that
    /// a process's CPU mask is its share of the machine.
    #[cfg_attr(not(feature = "flex"), allow(dead_code))] // Read by `threads` only.
    pub(crate) fn bound_by_launcher(&self) -> bool {
        self.0.bound_by_launcher()
    }
}

impl From<ProcessLayout> for ProcessState {
    fn from(layout: ProcessLayout) -> Self {
        Self(layout)
    }
}
