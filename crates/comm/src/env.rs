//! The environment a launcher gives each process: torchrun's and Accelerate's variable names,
//! plus the few this crate's transport needs. The launcher writes them and
//! `ProcessState::from_env` (in burn-accelerate) reads them, both from here.

/// Global rank of the process, `0..WORLD_SIZE`.
pub const RANK: &str = "RANK";
/// Number of processes in the run, over all machines.
pub const WORLD_SIZE: &str = "WORLD_SIZE";
/// Rank of the process on its machine, `0..LOCAL_WORLD_SIZE`.
pub const LOCAL_RANK: &str = "LOCAL_RANK";
/// Number of processes on this machine (the same on every machine).
pub const LOCAL_WORLD_SIZE: &str = "LOCAL_WORLD_SIZE";
/// Rank of this machine (torchrun's name for it), `0..num_machines`.
pub const GROUP_RANK: &str = "GROUP_RANK";
/// Host of the main machine, where the rendezvous (orchestrator) listens.
pub const MASTER_ADDR: &str = "MASTER_ADDR";
/// Port of the rendezvous on the main machine.
pub const MASTER_PORT: &str = "MASTER_PORT";

/// Port on which this process accepts its peers' tensors (default: `MASTER_PORT + 1 +
/// LOCAL_RANK`); 0 for any port the system gives (the peers learn it from the rendezvous).
pub const DATA_PORT: &str = "BURN_ACCELERATE_DATA_PORT";
/// Host the other processes reach this one at (default: the address this machine uses to
/// reach `MASTER_ADDR`).
pub const NODE_HOST: &str = "BURN_ACCELERATE_NODE_HOST";
/// Seconds any wait on the other processes may last before it fails (default 1800, torch's).
pub const TIMEOUT: &str = "BURN_ACCELERATE_TIMEOUT";
/// Seconds a process may send nothing to its ring neighbours (not even the heartbeats its
/// network thread sends whatever the training loop does) before the run's collectives fail on
/// every process (default 60).
pub const LIVENESS_TIMEOUT: &str = "BURN_ACCELERATE_LIVENESS_TIMEOUT";
/// The run's secret, which every connection proves it knows (set by `burn-accelerate launch`;
/// `burn-accelerate secret` writes one). Never printed.
pub const SECRET: &str = "BURN_ACCELERATE_SECRET";
/// torchrun's run id: random with `--standalone`, the run's secret's source when
/// [`SECRET`] is not set.
pub const TORCHRUN_RUN_ID: &str = "TORCHELASTIC_RUN_ID";
/// Set to `launcher` by `burn-accelerate launch`, which hosts the rendezvous itself;
/// otherwise (torchrun, or variables set by hand) rank 0 hosts it, as torch's TCP store does.
pub const ORCHESTRATOR: &str = "BURN_ACCELERATE_ORCHESTRATOR";
/// The value of [`ORCHESTRATOR`] that says the launcher hosts the rendezvous.
pub const ORCHESTRATOR_LAUNCHER: &str = "launcher";

/// Which start of the run this process belongs to: 0 at the first, `n` after `n` restarts
/// (`burn-accelerate launch --max-restarts`). Wins over [`TORCHRUN_RESTART_COUNT`], which the
/// launcher sets beside it. The rendezvous refuses a process of another attempt.
pub const RESTART_COUNT: &str = "BURN_ACCELERATE_RESTART_COUNT";
/// torchrun's name for [`RESTART_COUNT`], set by torchrun's elastic agent (and by
/// `burn-accelerate launch`, so that scripts written for torchrun read it).
pub const TORCHRUN_RESTART_COUNT: &str = "TORCHELASTIC_RESTART_COUNT";
/// How many restarts the run may have in all (`--max-restarts`).
pub const MAX_RESTARTS: &str = "BURN_ACCELERATE_MAX_RESTARTS";
/// torchrun's name for [`MAX_RESTARTS`].
pub const TORCHRUN_MAX_RESTARTS: &str = "TORCHELASTIC_MAX_RESTARTS";
/// The restart variables above, for `burn-accelerate env`.
pub const RESTARTS: [&str; 4] = [
    RESTART_COUNT,
    TORCHRUN_RESTART_COUNT,
    MAX_RESTARTS,
    TORCHRUN_MAX_RESTARTS,
];

/// Slurm's id of a job step, set in the tasks `srun` starts: what tells them from a program
/// started directly in an allocation (`salloc`, a batch script), which sees the job's
/// [`SLURM_NTASKS`] but is one process.
pub const SLURM_STEP_ID: &str = "SLURM_STEP_ID";
/// Slurm's rank of a task in its `srun` step (read when torchrun's variables are not set).
pub const SLURM_PROCID: &str = "SLURM_PROCID";
/// Slurm's number of tasks of the job (in an allocation: what `srun` starts by default).
pub const SLURM_NTASKS: &str = "SLURM_NTASKS";
/// Slurm's number of tasks of the `srun` step, which may be fewer than the job's.
pub const SLURM_STEP_NUM_TASKS: &str = "SLURM_STEP_NUM_TASKS";
/// Slurm's number of nodes of the `srun` step.
pub const SLURM_STEP_NUM_NODES: &str = "SLURM_STEP_NUM_NODES";
/// Slurm's tasks of the `srun` step on each of its nodes, in Slurm's form (`2(x3),1`: two
/// on each of three nodes, then one).
pub const SLURM_STEP_TASKS_PER_NODE: &str = "SLURM_STEP_TASKS_PER_NODE";
/// Slurm's rank of a task on its node.
pub const SLURM_LOCALID: &str = "SLURM_LOCALID";
/// Slurm's rank of a node in the step.
pub const SLURM_NODEID: &str = "SLURM_NODEID";

/// Open MPI's rank of a process under `mpirun` (read when neither torchrun's nor Slurm's are).
pub const OMPI_RANK: &str = "OMPI_COMM_WORLD_RANK";
/// Open MPI's number of processes.
pub const OMPI_SIZE: &str = "OMPI_COMM_WORLD_SIZE";
/// Open MPI's rank of a process on its node.
pub const OMPI_LOCAL_RANK: &str = "OMPI_COMM_WORLD_LOCAL_RANK";
/// Open MPI's number of processes on the node.
pub const OMPI_LOCAL_SIZE: &str = "OMPI_COMM_WORLD_LOCAL_SIZE";
/// PMI's rank (MPICH's Hydra, Slurm with PMI).
pub const PMI_RANK: &str = "PMI_RANK";
/// PMI's number of processes.
pub const PMI_SIZE: &str = "PMI_SIZE";
/// PMIx's rank, set by `srun --mpi=pmix` (the layout then comes from Slurm's variables).
pub const PMIX_RANK: &str = "PMIX_RANK";
/// MPICH's rank of a process on its node.
pub const MPI_LOCALRANKID: &str = "MPI_LOCALRANKID";
/// MPICH's number of processes on the node.
pub const MPI_LOCALNRANKS: &str = "MPI_LOCALNRANKS";
/// Which engine carries the run's collectives: `mpi` (the default under an MPI launch, with
/// the `mpi` feature) or `tcp` (the built-in one; the default otherwise).
pub const ENGINE: &str = "BURN_ACCELERATE_ENGINE";

/// Every variable above, for `burn-accelerate env` (which shows [`SECRET`] only as set) and for
/// tests that must clear them.
pub const ALL: [&str; 32] = [
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    LOCAL_WORLD_SIZE,
    GROUP_RANK,
    MASTER_ADDR,
    MASTER_PORT,
    DATA_PORT,
    NODE_HOST,
    TIMEOUT,
    LIVENESS_TIMEOUT,
    SECRET,
    TORCHRUN_RUN_ID,
    ORCHESTRATOR,
    SLURM_STEP_ID,
    SLURM_PROCID,
    SLURM_NTASKS,
    SLURM_STEP_NUM_TASKS,
    SLURM_STEP_NUM_NODES,
    SLURM_STEP_TASKS_PER_NODE,
    SLURM_LOCALID,
    SLURM_NODEID,
    OMPI_RANK,
    OMPI_SIZE,
    OMPI_LOCAL_RANK,
    OMPI_LOCAL_SIZE,
    PMI_RANK,
    PMI_SIZE,
    PMIX_RANK,
    MPI_LOCALRANKID,
    MPI_LOCALNRANKS,
    ENGINE,
];

/// The rendezvous port when none is given (Accelerate's and torchrun's default).
pub const DEFAULT_MAIN_PORT: u16 = 29500;
/// Seconds a collective or the rendezvous may wait by default (torch's process-group
/// default: a slow rank, e.g. one writing a checkpoint, must not fail the others).
pub const DEFAULT_TIMEOUT_SECS: u64 = 1800;
/// Seconds of silence after which a process counts as frozen or cut off, by default.
pub const DEFAULT_LIVENESS_SECS: u64 = 60;
