//! [`ProcessLayout`]: Accelerate's `PartialState` as a small value read from the environment:
//! which process of a run this is, and how to reach the others. burn-accelerate's
//! `distributed::ProcessState` is this value with the process group and the collectives on it;
//! the launcher reads it alone (`burn-accelerate env`).

use std::time::Duration;

use crate::Rendezvous;
use crate::env;
use crate::error::DistributedError;
use crate::secret::RunSecret;

/// Which process of a run this is, and how to reach the others: Accelerate's `PartialState`.
///
/// Read it with [`from_env`](Self::from_env) from the variables `burn-accelerate launch` (or
/// torchrun, `srun`, `mpirun`) sets; with none of them set, it is a single process. It does no
/// I/O: burn-accelerate's `ProcessState` joins the process group on it.
///
/// ```
/// use burn_accelerate_comm::ProcessLayout;
///
/// // What `burn-accelerate launch --num-processes 2` gives its second process.
/// let vars = [("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
///     ("LOCAL_WORLD_SIZE", "2"), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")];
/// let state = ProcessLayout::from_vars(|name| {
///     vars.iter().find(|(n, _)| *n == name).map(|(_, v)| v.to_string())
/// })?;
/// assert_eq!((state.process_index(), state.num_processes()), (1, 2));
/// assert!(!state.is_main_process() && !state.is_local_main_process());
///
/// // Nothing set: one process.
/// let single = ProcessLayout::from_vars(|_| None)?;
/// assert!(single.is_main_process() && single.num_processes() == 1);
/// # Ok::<(), burn_accelerate_comm::DistributedError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProcessLayout {
    num_processes: usize,
    process_index: usize,
    local_process_index: usize,
    local_num_processes: usize,
    num_machines: usize,
    machine_rank: usize,
    rendezvous: Option<Rendezvous>,
    /// The MPI launch whose MPI carries the collectives (the variable that shows it).
    mpi: Option<&'static str>,
    /// Started by `mpirun` or `srun`, which bind each process to CPUs of its own (by default,
    /// or when asked), rather than by torchrun or this crate's launcher, which bind none.
    bound_by_launcher: bool,
}

/// The longest wait [`env::TIMEOUT`] and [`env::LIVENESS_TIMEOUT`] may set (about 31
/// years): longer ones are refused rather than overflow a deadline.
pub const MAX_WAIT_SECS: f64 = 1e9;

impl ProcessLayout {
    /// One process: rank 0 of 1, on machine 0 of 1.
    pub fn single() -> Self {
        Self {
            num_processes: 1,
            process_index: 0,
            local_process_index: 0,
            local_num_processes: 1,
            num_machines: 1,
            machine_rank: 0,
            rendezvous: None,
            mpi: None,
            bound_by_launcher: false,
        }
    }

    /// Reads the process's place in the run from the environment (see [`env`](mod@crate::env)
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
        let var = |name: &str| std::env::var(name).ok();
        let state = Self::from_vars(var)?;
        static NOTED: std::sync::Once = std::sync::Once::new();
        if let Some(note) = Self::allocation_note(&var) {
            NOTED.call_once(|| eprintln!("{note}"));
        }
        Ok(state)
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistributedError> {
        let set = |names: &Names| {
            [names.rank, names.world_size, names.local_rank]
                .iter()
                .any(|name| var(name).is_some())
        };
        if set(&TORCHRUN) || var(env::LOCAL_WORLD_SIZE).is_some() {
            return Self::from_layout(&var, &TORCHRUN, true);
        }
        if let Some((names, launcher)) = [(&OPEN_MPI, env::OMPI_SIZE), (&PMI, env::PMI_SIZE)]
            .into_iter()
            .find(|(names, _)| set(names))
        {
            return Self::from_mpi(&var, names, launcher);
        }
        match var(env::SLURM_STEP_ID) {
            Some(step) if is_srun_step(&step) => Self::from_slurm_step(&var),
            // Started directly in an allocation (`salloc`, a batch script), which sets the
            // job's SLURM_NTASKS (and SLURM_PROCID=0 in a batch script) without being a step
            // of that many tasks: one process, as Accelerate takes it. `from_env` says so.
            _ => Ok(Self::single()),
        }
    }

    // The layout of a task of an `srun` step, from the step's own variables: a step may be
    // smaller than its job, whose SLURM_NTASKS_PER_NODE it inherits.
    fn from_slurm_step(var: &impl Fn(&str) -> Option<String>) -> Result<Self, DistributedError> {
        let per_node = match var(env::SLURM_STEP_TASKS_PER_NODE) {
            Some(value) => Some(uniform_tasks_per_node(value)?.to_string()),
            // Not named (an older Slurm): the step's tasks over its nodes, which must then
            // divide evenly.
            None => match var(env::SLURM_STEP_NUM_NODES) {
                None => None,
                Some(nodes) => {
                    let tasks =
                        var(env::SLURM_STEP_NUM_TASKS).and_then(|t| t.trim().parse::<usize>().ok());
                    match (tasks, nodes.trim().parse::<usize>()) {
                        (Some(tasks), Ok(n)) if n > 0 && tasks.is_multiple_of(n) => {
                            Some((tasks / n).to_string())
                        }
                        (Some(tasks), _) => {
                            return Err(DistributedError::InvalidVariable {
                                name: env::SLURM_STEP_NUM_NODES,
                                value: nodes,
                                expected: format!(
                                    "a divisor of SLURM_STEP_NUM_TASKS={tasks}: every node \
                                     runs as many tasks (srun --ntasks-per-node)"
                                ),
                            });
                        }
                        (None, _) => None,
                    }
                }
            },
        };
        let slurm = |name: &str| {
            if name == SLURM.local_world_size {
                per_node.clone()
            } else {
                var(name)
            }
        };
        // `srun --mpi=pmix` starts MPI programs itself: MPI carries the collectives.
        if var(env::PMIX_RANK).is_some() {
            return Self::from_mpi(&slurm, &SLURM, env::PMIX_RANK);
        }
        if requested_engine(var)? == Some(Engine::Mpi) {
            return Err(DistributedError::MpiNotLaunched {
                launcher: "srun",
                missing: env::PMIX_RANK,
                fix: "start the step with `srun --mpi=pmix` (or set MpiDefault=pmix in \
                      slurm.conf); Open MPI under `srun --mpi=pmi2` needs Slurm's PMI \
                      support, which Debian's Open MPI lacks",
            });
        }
        Self::from_layout(&slurm, &SLURM, true)
    }

    /// The note [`from_env`](Self::from_env) prints for a program started directly in a Slurm
    /// allocation of several tasks, which runs as one process; `None` elsewhere.
    fn allocation_note(var: &impl Fn(&str) -> Option<String>) -> Option<String> {
        if var(env::SLURM_STEP_ID).is_some_and(|step| is_srun_step(&step))
            || [&TORCHRUN, &OPEN_MPI, &PMI].iter().any(|names| {
                [names.rank, names.world_size, names.local_rank]
                    .iter()
                    .any(|name| var(name).is_some())
            })
        {
            return None;
        }
        let tasks = var(env::SLURM_NTASKS)?.trim().parse::<usize>().ok()?;
        (tasks > 1).then(|| {
            format!(
                "burn-accelerate: one process: this program was started directly in a Slurm \
                 allocation of {tasks} tasks (SLURM_NTASKS={tasks}, and no SLURM_STEP_ID: not \
                 a task of an `srun` step); `srun PROGRAM` there starts {tasks}"
            )
        })
    }

    // The layout of an MPI launch (`launcher` shows it), whose collectives go over MPI unless
    // BURN_ACCELERATE_ENGINE=tcp asks for the built-in engine.
    fn from_mpi(
        var: &impl Fn(&str) -> Option<String>,
        names: &Names,
        launcher: &'static str,
    ) -> Result<Self, DistributedError> {
        let over_mpi = match requested_engine(var)? {
            Some(engine) => engine == Engine::Mpi,
            // Without MPI built in, the built-in engine's variables choose it: on a cluster
            // whose srun starts every step with PMIx (MpiDefault=pmix), every program looks
            // started by MPI.
            None => cfg!(feature = "mpi") || var(env::MASTER_ADDR).is_none(),
        };
        if !over_mpi {
            return Self::from_layout(var, names, true);
        }
        if !cfg!(feature = "mpi") {
            return Err(DistributedError::MpiNotBuilt { launcher });
        }
        // MPI's own wiring replaces the rendezvous: none is read.
        let mut state = Self::from_layout(var, names, false)?;
        state.mpi = (state.num_processes > 1).then_some(launcher);
        Ok(state)
    }

    // The layout `var` gives under the variables `names`, with where the processes meet
    // when `rendezvous`.
    fn from_layout(
        var: &impl Fn(&str) -> Option<String>,
        names: &Names,
        rendezvous: bool,
    ) -> Result<Self, DistributedError> {
        let number = |name: &'static str| -> Result<Option<usize>, DistributedError> {
            var(name)
                .map(|value| {
                    value
                        .trim()
                        .parse::<usize>()
                        .map_err(|_| DistributedError::InvalidVariable {
                            name,
                            value,
                            expected: "a non-negative integer".into(),
                        })
                })
                .transpose()
        };
        let required = |name: &'static str| -> Result<usize, DistributedError> {
            number(name)?.ok_or(DistributedError::MissingVariable {
                name,
                because: "other process-layout variables are set",
                fix: names.fix,
            })
        };
        let Names {
            rank: rank_name,
            world_size: world_name,
            local_rank: local_rank_name,
            local_world_size: local_world_name,
            machine_rank: machine_name,
            binds_processes,
            ..
        } = *names;
        let world = required(world_name)?;
        let rank = required(rank_name)?;
        if world == 0 {
            return Err(invalid(world_name, world, "at least 1".into()));
        }
        if rank >= world {
            return Err(invalid(
                rank_name,
                rank,
                format!("below {world_name}={world} (ranks are 0..{world})"),
            ));
        }
        // Set by hand without the local variables: one machine.
        let local_world = number(local_world_name)?.unwrap_or(world);
        if local_world == 0 || local_world > world || !world.is_multiple_of(local_world) {
            return Err(invalid(
                local_world_name,
                local_world,
                format!(
                    "a divisor of {world_name}={world} (processes per machine, the same on \
                     every machine)"
                ),
            ));
        }
        let local_rank = number(local_rank_name)?.unwrap_or(rank % local_world);
        if local_rank >= local_world {
            return Err(invalid(
                local_rank_name,
                local_rank,
                format!("below {local_world_name}={local_world}"),
            ));
        }
        let num_machines = world / local_world;
        let machine_rank = rank / local_world;
        if rank % local_world != local_rank {
            return Err(invalid(
                local_rank_name,
                local_rank,
                format!(
                    "{rank_name} mod {local_world_name} = {} ({rank_name}={rank}, \
                     {local_world_name}={local_world}: ranks are numbered machine by machine{})",
                    rank % local_world,
                    if names.rank == SLURM.rank {
                        "; use srun --distribution=block"
                    } else {
                        ""
                    }
                ),
            ));
        }
        if let Some(machine_name) = machine_name
            && let Some(group_rank) = number(machine_name)?
            && group_rank != machine_rank
        {
            return Err(invalid(
                machine_name,
                group_rank,
                format!("{rank_name} / {local_world_name} = {machine_rank} ({rank_name}={rank})"),
            ));
        }
        let rendezvous = if world > 1 && rendezvous {
            Some(Self::read_rendezvous(var, names, local_rank)?)
        } else {
            None
        };
        Ok(Self {
            num_processes: world,
            process_index: rank,
            local_process_index: local_rank,
            local_num_processes: local_world,
            num_machines,
            machine_rank,
            rendezvous,
            mpi: None,
            bound_by_launcher: binds_processes,
        })
    }

    fn read_rendezvous(
        var: &impl Fn(&str) -> Option<String>,
        names: &Names,
        local_rank: usize,
    ) -> Result<Rendezvous, DistributedError> {
        const MEET: &str = "the run has several processes and they must meet somewhere";
        let main_addr = var(env::MASTER_ADDR)
            .filter(|a| !a.trim().is_empty())
            .ok_or(DistributedError::MissingVariable {
                name: env::MASTER_ADDR,
                because: MEET,
                fix: names.rendezvous_fix,
            })?;
        let port = |name: &'static str, value: String| {
            value
                .trim()
                .parse::<u16>()
                .ok()
                .filter(|p| *p != 0)
                .ok_or_else(|| DistributedError::InvalidVariable {
                    name,
                    value,
                    expected: "a port number in 1..=65535".into(),
                })
        };
        let main_port = var(env::MASTER_PORT)
            .ok_or(DistributedError::MissingVariable {
                name: env::MASTER_PORT,
                because: MEET,
                fix: names.rendezvous_fix,
            })
            .and_then(|v| port(env::MASTER_PORT, v))?;
        let hosted_by_launcher = match var(env::ORCHESTRATOR) {
            None => false,
            Some(v) if v == env::ORCHESTRATOR_LAUNCHER => true,
            Some(value) => {
                return Err(DistributedError::InvalidVariable {
                    name: env::ORCHESTRATOR,
                    value,
                    expected: format!(
                        "{:?} (the launcher hosts the rendezvous) or unset (rank 0 hosts it)",
                        env::ORCHESTRATOR_LAUNCHER
                    ),
                });
            }
        };
        // Under torchrun, its own store holds MASTER_PORT: rank 0's rendezvous takes the next
        // port, and the processes the ones after it.
        let under_torchrun = !hosted_by_launcher && var(env::TORCHRUN_RUN_ID).is_some();
        let main_port = if under_torchrun {
            main_port
                .checked_add(1)
                .ok_or_else(|| DistributedError::InvalidVariable {
                    name: env::MASTER_PORT,
                    value: main_port.to_string(),
                    expected: "below 65535: under torchrun the rendezvous takes the next port"
                        .into(),
                })?
        } else {
            main_port
        };
        let data_port = match var(env::DATA_PORT) {
            // 0: any port the system gives; the peers learn it from the rendezvous.
            Some(value) if value.trim() == "0" => 0,
            Some(value) => port(env::DATA_PORT, value)?,
            None => u16::try_from(usize::from(main_port) + 1 + local_rank).map_err(|_| {
                DistributedError::InvalidVariable {
                    name: env::MASTER_PORT,
                    value: main_port.to_string(),
                    expected: format!(
                        "low enough that MASTER_PORT + 1 + LOCAL_RANK ({local_rank}) is a port, \
                         or set {}",
                        env::DATA_PORT
                    ),
                }
            })?,
        };
        let seconds = |name: &'static str, default: u64| match var(name) {
            None => Ok(Duration::from_secs(default)),
            Some(value) => value
                .trim()
                .parse::<f64>()
                .ok()
                // Past the bound, `Duration::from_secs_f64` panics (found by the property
                // test: 18446744073709551614) and a deadline `now + wait` overflows.
                .filter(|s| s.is_finite() && *s > 0.0 && *s <= MAX_WAIT_SECS)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| DistributedError::InvalidVariable {
                    name,
                    value,
                    expected: format!("a positive number of seconds, at most {MAX_WAIT_SECS}"),
                }),
        };
        let timeout = seconds(env::TIMEOUT, env::DEFAULT_TIMEOUT_SECS)?;
        let liveness = seconds(env::LIVENESS_TIMEOUT, env::DEFAULT_LIVENESS_SECS)?;
        Ok(Rendezvous {
            main_addr: main_addr.trim().to_string(),
            main_port,
            data_port,
            node_host: var(env::NODE_HOST).filter(|h| !h.trim().is_empty()),
            timeout,
            liveness,
            hosted_by_launcher,
            secret: match RunSecret::from_vars(var)? {
                // Nothing but the job script sets it under srun: said now, with the rest of
                // the job script's variables, rather than when the engine starts.
                None if names.secret_from_script => {
                    return Err(DistributedError::MissingVariable {
                        name: env::SECRET,
                        because: "every connection of a run proves it knows the run's secret",
                        fix: names.rendezvous_fix,
                    });
                }
                secret => secret,
            },
        })
    }

    /// Number of processes in the run (Accelerate's `num_processes`).
    pub fn num_processes(&self) -> usize {
        self.num_processes
    }

    /// This process's global rank (Accelerate's `process_index`).
    pub fn process_index(&self) -> usize {
        self.process_index
    }

    /// This process's rank on its machine (`local_process_index`).
    pub fn local_process_index(&self) -> usize {
        self.local_process_index
    }

    /// Processes per machine.
    pub fn local_num_processes(&self) -> usize {
        self.local_num_processes
    }

    /// Number of machines (`num_machines`).
    pub fn num_machines(&self) -> usize {
        self.num_machines
    }

    /// This machine's rank (`machine_rank`).
    pub fn machine_rank(&self) -> usize {
        self.machine_rank
    }

    /// Whether this is the main process of the run (rank 0).
    pub fn is_main_process(&self) -> bool {
        self.process_index == 0
    }

    /// Whether this is the main process of its machine (local rank 0).
    pub fn is_local_main_process(&self) -> bool {
        self.local_process_index == 0
    }

    /// Whether there is more than one process.
    pub fn is_distributed(&self) -> bool {
        self.num_processes > 1
    }

    /// Where the processes meet (`None` for a single process, and under MPI, whose own wiring
    /// replaces it).
    pub fn rendezvous(&self) -> Option<&Rendezvous> {
        self.rendezvous.as_ref()
    }

    /// Whether MPI carries the run's collectives (an MPI launch, built with the `mpi` feature).
    pub fn over_mpi(&self) -> bool {
        self.mpi.is_some()
    }

    /// The line the main process prints when it joins the run: which engine carries the
    /// collectives, and why (`None` for a single process, which has none).
    pub fn engine_line(&self) -> Option<String> {
        let machines = match self.num_machines {
            1 => "1 machine".to_string(),
            n => format!("{n} machines"),
        };
        let why = match (self.mpi, &self.rendezvous) {
            (Some(launcher), _) => format!("an MPI launch: {launcher} is set"),
            (None, Some(r)) => format!("rendezvous at {}:{}", r.main_addr, r.main_port),
            (None, None) => return None,
        };
        let engine = if self.over_mpi() { "mpi" } else { "tcp" };
        Some(format!(
            "burn-accelerate: engine {engine} for {} processes on {machines} ({why})",
            self.num_processes
        ))
    }

    /// Whether the launcher (`mpirun`, `srun`) binds each process to CPUs of its own, so that
    /// a process's CPU mask is its share of the machine; torchrun and this crate's launcher
    /// bind none, and their processes share the machine's.
    pub fn bound_by_launcher(&self) -> bool {
        self.bound_by_launcher
    }
}

/// The variables a launcher gives a process's place in.
#[derive(Clone, Copy)]
struct Names {
    rank: &'static str,
    world_size: &'static str,
    local_rank: &'static str,
    local_world_size: &'static str,
    /// `None` where the launcher does not name it (it follows from the ranks).
    machine_rank: Option<&'static str>,
    /// Whether the launcher binds each process to CPUs of its own.
    binds_processes: bool,
    /// What to change when one of these variables is missing.
    fix: &'static str,
    /// What to change when the built-in engine's variables (`MASTER_ADDR`, `MASTER_PORT`, the
    /// secret) are missing.
    rendezvous_fix: &'static str,
    /// Whether only the user sets the run's secret (no launcher makes one), so that its
    /// absence is an error of the layout.
    secret_from_script: bool,
}

const LAUNCH: &str =
    "start the processes with `burn-accelerate launch` (or torchrun), which sets all of them";

/// torchrun's (and `burn-accelerate launch`'s, and Accelerate's).
const TORCHRUN: Names = Names {
    rank: env::RANK,
    world_size: env::WORLD_SIZE,
    local_rank: env::LOCAL_RANK,
    local_world_size: env::LOCAL_WORLD_SIZE,
    machine_rank: Some(env::GROUP_RANK),
    binds_processes: false,
    fix: LAUNCH,
    rendezvous_fix: LAUNCH,
    secret_from_script: false,
};

const MPI_RENDEZVOUS: &str = "the built-in engine needs MASTER_ADDR, MASTER_PORT and \
     BURN_ACCELERATE_SECRET in every process's environment (`mpirun -x NAME`); for MPI's own, \
     build with `--features mpi` and leave BURN_ACCELERATE_ENGINE unset";

/// Open MPI's, under its `mpirun`.
const OPEN_MPI: Names = Names {
    rank: env::OMPI_RANK,
    world_size: env::OMPI_SIZE,
    local_rank: env::OMPI_LOCAL_RANK,
    local_world_size: env::OMPI_LOCAL_SIZE,
    machine_rank: None,
    binds_processes: true,
    fix: "start the processes with Open MPI's `mpirun`, which sets all of them",
    rendezvous_fix: MPI_RENDEZVOUS,
    secret_from_script: false,
};

/// PMI's (MPICH's Hydra `mpirun`, Slurm with PMI), with MPICH's local ranks.
const PMI: Names = Names {
    rank: env::PMI_RANK,
    world_size: env::PMI_SIZE,
    local_rank: env::MPI_LOCALRANKID,
    local_world_size: env::MPI_LOCALNRANKS,
    machine_rank: None,
    binds_processes: true,
    fix: "start the processes with MPICH's `mpirun`, which sets all of them",
    rendezvous_fix: MPI_RENDEZVOUS,
    secret_from_script: false,
};

/// Slurm's, in a task of an `srun` step (with `MASTER_ADDR`, `MASTER_PORT` and the secret set
/// by the job script, or MPI's wiring under `srun --mpi=pmix`).
const SLURM: Names = Names {
    rank: env::SLURM_PROCID,
    world_size: env::SLURM_STEP_NUM_TASKS,
    local_rank: env::SLURM_LOCALID,
    local_world_size: env::SLURM_STEP_TASKS_PER_NODE,
    machine_rank: Some(env::SLURM_NODEID),
    binds_processes: true,
    fix: "srun sets it in every task of a step (SLURM_STEP_ID is set here): start the \
          program with `srun`, not by hand",
    rendezvous_fix: SLURM_RENDEZVOUS,
    secret_from_script: true,
};

const SLURM_RENDEZVOUS: &str = if cfg!(feature = "mpi") {
    "for the built-in engine, export MASTER_ADDR (the first node: `scontrol show hostnames \
     \"$SLURM_JOB_NODELIST\" | head -n 1`), MASTER_PORT and BURN_ACCELERATE_SECRET in the job \
     script before `srun`; or start the program with `srun --mpi=pmix` for MPI (this build has \
     it)"
} else {
    "for the built-in engine, export MASTER_ADDR (the first node: `scontrol show hostnames \
     \"$SLURM_JOB_NODELIST\" | head -n 1`), MASTER_PORT and BURN_ACCELERATE_SECRET in the job \
     script before `srun`; or build the program with `--features mpi` and start it with \
     `srun --mpi=pmix`"
};

/// Slurm numbers the batch script's, the interactive and the extern steps from here up
/// (`SLURM_BATCH_SCRIPT` and its neighbours in `slurm.h`); a program in one of them is one
/// process, should SLURM_STEP_ID name it.
const SLURM_SPECIAL_STEPS: u32 = 0xFFFF_FFF0;

/// Whether a SLURM_STEP_ID names a step `srun` started, of SLURM_STEP_NUM_TASKS tasks.
fn is_srun_step(step: &str) -> bool {
    step.trim()
        .parse::<u32>()
        .is_ok_and(|id| id < SLURM_SPECIAL_STEPS)
}

/// The tasks per node of a step whose SLURM_STEP_TASKS_PER_NODE is `value`, in Slurm's form
/// (`4`, `2(x3)`, `2(x3),1`): the same on every node, or an error saying how to ask for that.
fn uniform_tasks_per_node(value: String) -> Result<usize, DistributedError> {
    let counts: Option<Vec<usize>> = value
        .split(',')
        .map(|entry| {
            let count = match entry.trim().split_once('(') {
                Some((count, repeat)) => {
                    let times = repeat.strip_prefix('x')?.strip_suffix(')')?;
                    times.parse::<usize>().ok().filter(|t| *t > 0)?;
                    count
                }
                None => entry.trim(),
            };
            count.parse::<usize>().ok().filter(|c| *c > 0)
        })
        .collect();
    let Some(counts) = counts else {
        return Err(DistributedError::InvalidVariable {
            name: env::SLURM_STEP_TASKS_PER_NODE,
            value,
            expected: "Slurm's list of tasks per node, such as `4` or `2(x3),1`".into(),
        });
    };
    match counts[..] {
        [first, ref rest @ ..] if rest.iter().all(|c| *c == first) => Ok(first),
        _ => Err(DistributedError::InvalidVariable {
            name: env::SLURM_STEP_TASKS_PER_NODE,
            value,
            expected: "the same number of tasks on every node: start the step with `srun \
                       --ntasks-per-node=N` (and -n a multiple of -N)"
                .into(),
        }),
    }
}

/// The engine BURN_ACCELERATE_ENGINE asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Engine {
    Mpi,
    Tcp,
}

fn requested_engine(
    var: &impl Fn(&str) -> Option<String>,
) -> Result<Option<Engine>, DistributedError> {
    match var(env::ENGINE) {
        None => Ok(None),
        Some(engine) if engine.trim() == "mpi" => Ok(Some(Engine::Mpi)),
        Some(engine) if engine.trim() == "tcp" => Ok(Some(Engine::Tcp)),
        Some(value) => Err(DistributedError::InvalidVariable {
            name: env::ENGINE,
            value,
            expected: "`mpi` or `tcp`".into(),
        }),
    }
}

fn invalid(name: &'static str, value: usize, expected: String) -> DistributedError {
    DistributedError::InvalidVariable {
        name,
        value: value.to_string(),
        expected,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(vars: &[(&str, &str)]) -> Result<ProcessLayout, DistributedError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        ProcessLayout::from_vars(move |name| {
            vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone())
        })
    }

    const TWO_BY_TWO: [(&str, &str); 7] = [
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("LOCAL_WORLD_SIZE", "2"),
        ("GROUP_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ];

    #[test]
    fn reads_a_torchrun_layout() {
        let s = state(&TWO_BY_TWO).unwrap();
        assert_eq!(
            (
                s.num_processes(),
                s.process_index(),
                s.local_process_index(),
                s.local_num_processes(),
                s.num_machines(),
                s.machine_rank()
            ),
            (4, 3, 1, 2, 2, 1)
        );
        assert!(!s.is_main_process() && !s.is_local_main_process());
        let r = s.rendezvous().unwrap();
        assert_eq!(
            (r.main_addr.as_str(), r.main_port, r.data_port),
            ("10.0.0.1", 29500, 29502)
        );
        assert_eq!(r.timeout, Duration::from_secs(1800));
        assert!(!r.hosted_by_launcher);
    }

    fn layout(s: &ProcessLayout) -> [usize; 6] {
        [
            s.num_processes(),
            s.process_index(),
            s.local_process_index(),
            s.local_num_processes(),
            s.num_machines(),
            s.machine_rank(),
        ]
    }

    #[test]
    fn under_torchrun_the_rendezvous_keeps_off_its_store_port() {
        let mut vars = TWO_BY_TWO.to_vec();
        vars.push(("TORCHELASTIC_RUN_ID", "a1b2"));
        let s = state(&vars).unwrap();
        let r = s.rendezvous().unwrap();
        // torchrun's store holds 29500: the rendezvous takes 29501, local rank 1 29503.
        assert_eq!((r.main_port, r.data_port), (29501, 29503));
        assert_eq!(r.secret, Some(crate::RunSecret::from_text("torchrun:a1b2")));
        // Under the launcher, torchrun's variables change nothing.
        vars.push(("BURN_ACCELERATE_ORCHESTRATOR", "launcher"));
        let r = state(&vars).unwrap().rendezvous().unwrap().clone();
        assert_eq!((r.main_port, r.data_port), (29500, 29502));
    }

    #[test]
    fn data_port_0_is_left_to_the_system_and_master_port_0_is_refused() {
        let mut vars = TWO_BY_TWO.to_vec();
        vars.push(("BURN_ACCELERATE_DATA_PORT", "0"));
        let r = state(&vars).unwrap().rendezvous().unwrap().clone();
        assert_eq!((r.main_port, r.data_port), (29500, 0));
        // The others must be told the rendezvous's port: 0 names none.
        vars.retain(|(name, _)| *name != "MASTER_PORT");
        vars.push(("MASTER_PORT", "0"));
        assert!(state(&vars).is_err());
    }

    /// Task 3 of `srun -N 2 -n 4` in a job of its own, as Slurm 22.05 sets it, with the job
    /// script's variables of the built-in engine.
    const SLURM_2X2: [(&str, &str); 12] = [
        ("SLURM_STEP_ID", "0"),
        ("SLURM_PROCID", "3"),
        ("SLURM_NTASKS", "4"),
        ("SLURM_LOCALID", "1"),
        ("SLURM_NODEID", "1"),
        ("SLURM_NNODES", "2"),
        ("SLURM_STEP_NUM_TASKS", "4"),
        ("SLURM_STEP_NUM_NODES", "2"),
        ("SLURM_STEP_TASKS_PER_NODE", "2(x2)"),
        ("MASTER_ADDR", "node-0"),
        ("MASTER_PORT", "29500"),
        ("BURN_ACCELERATE_SECRET", "the job script's"),
    ];

    type Vars = Vec<(&'static str, &'static str)>;

    // `base` with the variables of `over` replaced (an empty value removes the variable).
    fn overriding(
        base: &[(&'static str, &'static str)],
        over: &[(&'static str, &'static str)],
    ) -> Vars {
        let mut vars: Vars = base
            .iter()
            .filter(|(n, _)| !over.iter().any(|(o, _)| o == n))
            .copied()
            .collect();
        vars.extend(over.iter().filter(|(_, v)| !v.is_empty()).copied());
        vars
    }

    fn slurm_with(over: &[(&'static str, &'static str)]) -> Vars {
        overriding(&SLURM_2X2, over)
    }

    #[test]
    fn reads_a_slurm_layout() {
        let s = state(&SLURM_2X2).unwrap();
        assert_eq!(layout(&s), [4, 3, 1, 2, 2, 1]);
        let r = s.rendezvous().unwrap();
        assert_eq!(
            (r.main_addr.as_str(), r.main_port, r.data_port),
            ("node-0", 29500, 29502)
        );
        // Without the tasks per node (an older Slurm): the step's tasks over its nodes.
        let vars = slurm_with(&[("SLURM_STEP_TASKS_PER_NODE", "")]);
        assert_eq!(layout(&state(&vars).unwrap()), [4, 3, 1, 2, 2, 1]);
        // One task: one process.
        let one = state(&[
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_STEP_NUM_TASKS", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "1"),
        ])
        .unwrap();
        assert!(!one.is_distributed() && one.rendezvous().is_none());
        // torchrun's variables, where both are set (torchrun under srun), win.
        let mut both = TWO_BY_TWO.to_vec();
        both.extend([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert_eq!(layout(&state(&both).unwrap()), [4, 3, 1, 2, 2, 1]);
    }

    #[test]
    fn a_step_smaller_than_its_job_has_its_own_layout() {
        // `srun -n 2` in a job of `-N 1 --ntasks-per-node=4`, as Slurm 22.05 sets it: the step
        // keeps the job's SLURM_NTASKS_PER_NODE and SLURM_JOB_CPUS_PER_NODE.
        let step = [
            ("SLURM_STEP_ID", "0"),
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_TASKS_PER_NODE", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "1"),
            ("SLURM_STEP_NUM_TASKS", "2"),
            ("SLURM_STEP_NUM_NODES", "1"),
            ("SLURM_STEP_TASKS_PER_NODE", "2"),
            ("PMIX_RANK", "1"),
        ];
        if cfg!(feature = "mpi") {
            let s = state(&step).unwrap();
            assert!(s.over_mpi());
            assert_eq!(layout(&s), [2, 1, 1, 2, 1, 0]);
        } else {
            let err = state(&step).unwrap_err();
            assert!(matches!(err, DistributedError::MpiNotBuilt { .. }), "{err}");
        }
        // Slurm's repeated counts, the same on every node.
        let vars = slurm_with(&[
            ("SLURM_STEP_NUM_TASKS", "6"),
            ("SLURM_STEP_NUM_NODES", "3"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3)"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NODEID", "2"),
        ]);
        assert_eq!(layout(&state(&vars).unwrap()), [6, 5, 1, 2, 3, 2]);
        assert_eq!(uniform_tasks_per_node("2,2(x2)".into()).unwrap(), 2);
        // Uneven nodes cannot be numbered machine by machine: said with the flag to change.
        let uneven = slurm_with(&[
            ("SLURM_STEP_NUM_TASKS", "7"),
            ("SLURM_STEP_TASKS_PER_NODE", "2(x3),1"),
        ]);
        let msg = error_names(&uneven, "SLURM_STEP_TASKS_PER_NODE");
        assert!(msg.contains("--ntasks-per-node"), "{msg}");
        for bad in ["", "2(x", "2(3)", "0", "x", "2(x0)"] {
            let err = uniform_tasks_per_node(bad.into()).unwrap_err();
            assert!(err.to_string().contains("`2(x3),1`"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_program_started_directly_in_an_allocation_is_one_process_with_a_note() {
        let map = |vars: &'static [(&'static str, &'static str)]| {
            move |name: &str| {
                vars.iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, v)| v.to_string())
            }
        };
        // `salloc -n 2 PROGRAM`, and the batch step of `sbatch --ntasks-per-node=4`, as Slurm
        // 22.05 sets them: no SLURM_STEP_ID.
        let salloc: &[(&str, &str)] = &[("SLURM_NTASKS", "2"), ("SLURM_NNODES", "1")];
        let batch: &[(&str, &str)] = &[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_NTASKS_PER_NODE", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
        ];
        // A batch step that names itself (Slurm's SLURM_BATCH_SCRIPT id), as a later Slurm
        // might.
        let named: &[(&str, &str)] = &[
            ("SLURM_STEP_ID", "4294967291"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
        ];
        for (vars, tasks) in [(salloc, 2), (batch, 4), (named, 4)] {
            let var = map(vars);
            assert_eq!(
                ProcessLayout::from_vars(var).unwrap(),
                ProcessLayout::single()
            );
            let note = ProcessLayout::allocation_note(&var).unwrap();
            assert!(
                note.contains(&format!("`srun PROGRAM` there starts {tasks}")),
                "{note}"
            );
        }
        // No note for one task, for a task of a step, or under another launcher.
        assert_eq!(
            ProcessLayout::allocation_note(&map(&[("SLURM_NTASKS", "1")])),
            None
        );
        assert_eq!(ProcessLayout::allocation_note(&map(&SLURM_2X2)), None);
        let torchrun: &[(&str, &str)] =
            &[("RANK", "0"), ("WORLD_SIZE", "1"), ("SLURM_NTASKS", "2")];
        assert_eq!(ProcessLayout::allocation_note(&map(torchrun)), None);
    }

    #[test]
    fn under_srun_the_engine_follows_the_wiring_and_the_variables() {
        // The MPI engine asked for, but srun started the step without PMIx.
        let mut vars = SLURM_2X2.to_vec();
        vars.push(("BURN_ACCELERATE_ENGINE", "mpi"));
        let err = state(&vars).unwrap_err();
        assert!(
            matches!(err, DistributedError::MpiNotLaunched { .. }),
            "{err}"
        );
        assert!(err.to_string().contains("srun --mpi=pmix"), "{err}");
        // srun --mpi=pmix with the built-in engine's variables: MPI where it is built in,
        // the built-in engine otherwise (a cluster whose MpiDefault is pmix).
        let mut pmix = SLURM_2X2.to_vec();
        pmix.push(("PMIX_RANK", "3"));
        let s = state(&pmix).unwrap();
        assert_eq!(s.over_mpi(), cfg!(feature = "mpi"));
        assert_eq!(s.rendezvous().is_some(), !cfg!(feature = "mpi"));
        let line = s.engine_line().unwrap();
        let engine = if cfg!(feature = "mpi") { "mpi" } else { "tcp" };
        assert!(
            line.starts_with(&format!(
                "burn-accelerate: engine {engine} for 4 processes on 2 machines"
            )),
            "{line}"
        );
        // ... and the built-in engine on request.
        pmix.push(("BURN_ACCELERATE_ENGINE", "tcp"));
        assert!(!state(&pmix).unwrap().over_mpi());
        assert_eq!(ProcessLayout::single().engine_line(), None);
    }

    const OPEN_MPI_2X2: [(&str, &str); 4] = [
        ("OMPI_COMM_WORLD_RANK", "3"),
        ("OMPI_COMM_WORLD_SIZE", "4"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
        ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
    ];

    #[test]
    fn an_mpi_launch_is_recognised_and_needs_the_mpi_build() {
        let pmi = [
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALRANKID", "1"),
            ("MPI_LOCALNRANKS", "2"),
        ];
        if cfg!(feature = "mpi") {
            let s = state(&OPEN_MPI_2X2).unwrap();
            assert_eq!(layout(&s), [4, 3, 1, 2, 2, 1]);
            assert!(s.over_mpi() && s.rendezvous().is_none());
            let s = state(&pmi).unwrap();
            assert_eq!(layout(&s), [2, 1, 1, 2, 1, 0]);
            assert!(s.over_mpi());
        } else {
            let err = state(&OPEN_MPI_2X2).unwrap_err();
            assert!(
                matches!(
                    err,
                    DistributedError::MpiNotBuilt {
                        launcher: "OMPI_COMM_WORLD_SIZE"
                    }
                ),
                "{err}"
            );
            assert!(err.to_string().contains("--features mpi"), "{err}");
            assert!(state(&pmi).is_err());
        }
        // The built-in engine on request, which then needs its rendezvous.
        let mut tcp = OPEN_MPI_2X2.to_vec();
        tcp.push(("BURN_ACCELERATE_ENGINE", "tcp"));
        error_names(&tcp, "MASTER_ADDR");
        tcp.extend([("MASTER_ADDR", "node-0"), ("MASTER_PORT", "29500")]);
        let s = state(&tcp).unwrap();
        assert!(!s.over_mpi() && s.rendezvous().is_some());
        let mut bad = OPEN_MPI_2X2.to_vec();
        bad.push(("BURN_ACCELERATE_ENGINE", "nccl"));
        error_names(&bad, "BURN_ACCELERATE_ENGINE");
        // torchrun's variables win over MPI's (torchrun started under mpirun).
        let mut both = TWO_BY_TWO.to_vec();
        both.extend(OPEN_MPI_2X2);
        assert!(!state(&both).unwrap().over_mpi());
    }

    #[test]
    fn mpirun_and_srun_bind_their_processes_torchrun_and_ours_do_not() {
        let mut mpi = OPEN_MPI_2X2.to_vec();
        mpi.extend([
            ("BURN_ACCELERATE_ENGINE", "tcp"),
            ("MASTER_ADDR", "node-0"),
            ("MASTER_PORT", "29500"),
        ]);
        assert!(state(&mpi).unwrap().bound_by_launcher());
        assert!(state(&SLURM_2X2).unwrap().bound_by_launcher());
        assert!(!state(&TWO_BY_TWO).unwrap().bound_by_launcher());
        assert!(!state(&[]).unwrap().bound_by_launcher());
        // torchrun started under srun: torchrun's processes share the node.
        let mut both = TWO_BY_TWO.to_vec();
        both.extend([("SLURM_PROCID", "0"), ("SLURM_NTASKS", "1")]);
        assert!(!state(&both).unwrap().bound_by_launcher());
    }

    #[test]
    fn srun_with_pmix_is_an_mpi_launch() {
        let mut vars = slurm_with(&[("MASTER_ADDR", ""), ("MASTER_PORT", "")]);
        vars.push(("PMIX_RANK", "3"));
        match state(&vars) {
            Ok(s) => {
                assert!(cfg!(feature = "mpi") && s.over_mpi());
                assert_eq!(layout(&s), [4, 3, 1, 2, 2, 1]);
            }
            Err(err) => {
                assert!(
                    !cfg!(feature = "mpi")
                        && matches!(
                            err,
                            DistributedError::MpiNotBuilt {
                                launcher: "PMIX_RANK"
                            }
                        ),
                    "{err}"
                );
                // What to change under srun, not under another launcher.
                let msg = err.to_string();
                assert!(msg.contains("in the job script before `srun`"), "{msg}");
                assert!(!msg.contains("burn-accelerate launch"), "{msg}");
            }
        }
    }

    #[test]
    fn a_bad_slurm_layout_names_slurm_variables() {
        // Tasks dealt round the nodes (srun's cyclic distribution): rank 1 on node 1.
        let cyclic = slurm_with(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
        ]);
        let msg = error_names(&cyclic, "SLURM_LOCALID");
        assert!(msg.contains("--distribution=block"), "{msg}");
        let msg = error_names(
            &slurm_with(&[("SLURM_STEP_NUM_TASKS", "")]),
            "SLURM_STEP_NUM_TASKS",
        );
        assert!(msg.contains("start the program with `srun`"), "{msg}");
        let msg = error_names(
            &slurm_with(&[
                ("SLURM_STEP_NUM_TASKS", "3"),
                ("SLURM_PROCID", "0"),
                ("SLURM_LOCALID", "0"),
                ("SLURM_NODEID", "0"),
                ("SLURM_STEP_TASKS_PER_NODE", ""),
            ]),
            "SLURM_STEP_NUM_NODES",
        );
        assert!(msg.contains("a divisor of SLURM_STEP_NUM_TASKS=3"), "{msg}");
        // The built-in engine's variables, each missing: the job script's to set, and MPI the
        // other way (never the launcher of another world).
        for name in ["MASTER_ADDR", "MASTER_PORT", "BURN_ACCELERATE_SECRET"] {
            let msg = error_names(&slurm_with(&[(name, "")]), name);
            assert!(msg.contains("not set"), "{msg}");
            assert!(msg.contains("in the job script before `srun`"), "{msg}");
            assert!(msg.contains("srun --mpi=pmix"), "{msg}");
            assert!(!msg.contains("burn-accelerate launch"), "{msg}");
        }
    }

    #[test]
    fn nothing_set_is_one_process_and_rank_without_locals_is_one_machine() {
        assert_eq!(state(&[]).unwrap(), ProcessLayout::single());
        let s = state(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "3"),
            ("MASTER_ADDR", "localhost"),
            ("MASTER_PORT", "1234"),
            ("BURN_ACCELERATE_TIMEOUT", "2.5"),
            ("BURN_ACCELERATE_ORCHESTRATOR", "launcher"),
        ])
        .unwrap();
        assert_eq!((s.local_process_index(), s.num_machines()), (2, 1));
        let r = s.rendezvous().unwrap();
        assert_eq!(r.timeout, Duration::from_millis(2500));
        assert!(r.hosted_by_launcher);
        // A world of one needs no rendezvous.
        let one = state(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert!(one.rendezvous().is_none() && !one.is_distributed());
    }

    fn error_names(vars: &[(&str, &str)], name: &str) -> String {
        let err = state(vars).unwrap_err();
        let named = match &err {
            DistributedError::MissingVariable { name, .. }
            | DistributedError::InvalidVariable { name, .. } => *name,
            other => panic!("not a variable error: {other}"),
        };
        assert_eq!(named, name, "{err}");
        err.to_string()
    }

    fn with(over: &[(&'static str, &'static str)]) -> Vars {
        overriding(&TWO_BY_TWO, over)
    }

    #[test]
    fn every_inconsistency_is_an_error_naming_its_variable() {
        let msg = error_names(&with(&[("RANK", "")]), "RANK");
        assert!(msg.contains("burn-accelerate launch"), "{msg}");
        error_names(&with(&[("WORLD_SIZE", "")]), "WORLD_SIZE");
        error_names(&with(&[("RANK", "x")]), "RANK");
        let msg = error_names(&with(&[("RANK", "4")]), "RANK");
        assert!(msg.contains("below WORLD_SIZE=4"), "{msg}");
        error_names(&with(&[("WORLD_SIZE", "0"), ("RANK", "0")]), "WORLD_SIZE");
        error_names(&with(&[("LOCAL_WORLD_SIZE", "3")]), "LOCAL_WORLD_SIZE");
        error_names(&with(&[("LOCAL_WORLD_SIZE", "0")]), "LOCAL_WORLD_SIZE");
        error_names(&with(&[("LOCAL_RANK", "2")]), "LOCAL_RANK");
        let msg = error_names(&with(&[("LOCAL_RANK", "0")]), "LOCAL_RANK");
        assert!(msg.contains("machine by machine"), "{msg}");
        error_names(&with(&[("GROUP_RANK", "0")]), "GROUP_RANK");
        error_names(&with(&[("MASTER_ADDR", "")]), "MASTER_ADDR");
        error_names(&with(&[("MASTER_PORT", "")]), "MASTER_PORT");
        error_names(&with(&[("MASTER_PORT", "0")]), "MASTER_PORT");
        error_names(&with(&[("MASTER_PORT", "70000")]), "MASTER_PORT");
        error_names(&with(&[("MASTER_PORT", "65535")]), "MASTER_PORT");
        error_names(
            &with(&[("BURN_ACCELERATE_DATA_PORT", "nope")]),
            "BURN_ACCELERATE_DATA_PORT",
        );
        error_names(
            &with(&[("BURN_ACCELERATE_TIMEOUT", "-1")]),
            "BURN_ACCELERATE_TIMEOUT",
        );
        error_names(
            &with(&[("BURN_ACCELERATE_LIVENESS_TIMEOUT", "0")]),
            "BURN_ACCELERATE_LIVENESS_TIMEOUT",
        );
        error_names(
            &with(&[("BURN_ACCELERATE_ORCHESTRATOR", "rank0")]),
            "BURN_ACCELERATE_ORCHESTRATOR",
        );
    }

    // The property test of issue 49 (SECURITY.md): every variable the layout reads, set to
    // anything a launcher, a scheduler or a person could write.

    use proptest::prelude::*;

    use crate::fuzz;

    const NAMES: [&str; 36] = [
        env::RANK,
        env::WORLD_SIZE,
        env::LOCAL_RANK,
        env::LOCAL_WORLD_SIZE,
        env::GROUP_RANK,
        env::MASTER_ADDR,
        env::MASTER_PORT,
        env::DATA_PORT,
        env::NODE_HOST,
        env::TIMEOUT,
        env::LIVENESS_TIMEOUT,
        env::SECRET,
        env::TORCHRUN_RUN_ID,
        env::ORCHESTRATOR,
        env::RESTART_COUNT,
        env::TORCHRUN_RESTART_COUNT,
        env::MAX_RESTARTS,
        env::TORCHRUN_MAX_RESTARTS,
        env::SLURM_STEP_ID,
        env::SLURM_PROCID,
        env::SLURM_NTASKS,
        env::SLURM_STEP_NUM_TASKS,
        env::SLURM_STEP_NUM_NODES,
        env::SLURM_STEP_TASKS_PER_NODE,
        env::SLURM_LOCALID,
        env::SLURM_NODEID,
        env::OMPI_RANK,
        env::OMPI_SIZE,
        env::OMPI_LOCAL_RANK,
        env::OMPI_LOCAL_SIZE,
        env::PMI_RANK,
        env::PMI_SIZE,
        env::PMIX_RANK,
        env::MPI_LOCALRANKID,
        env::MPI_LOCALNRANKS,
        env::ENGINE,
    ];

    const VALUES: [&str; 14] = [
        "0",
        "1",
        "2",
        "3",
        "4",
        "29500",
        "10.0.0.1",
        "127.0.0.1",
        "launcher",
        "2(x3),1",
        "tcp",
        "mpi",
        "",
        " 7 ",
    ];

    // Each variable unset or set to a value; `base`: the unset torchrun ones take a valid
    // 2x2 layout's, so that the values reach the checks past the first.
    fn environments() -> impl Strategy<Value = Vec<(String, String)>> {
        (
            any::<bool>(),
            prop::collection::vec(
                prop::option::weighted(0.3, fuzz::text(&VALUES)),
                NAMES.len(),
            ),
        )
            .prop_map(|(base, values)| {
                let mut vars: Vec<(String, String)> = NAMES
                    .iter()
                    .zip(values)
                    .filter_map(|(n, v)| Some((n.to_string(), v?)))
                    .collect();
                if base {
                    for (n, v) in TWO_BY_TWO {
                        if !vars.iter().any(|(set, _)| set == n) {
                            vars.push((n.into(), v.into()));
                        }
                    }
                }
                vars
            })
    }

    fn layout_is_read_or_named(vars: Vec<(String, String)>) -> Result<(), TestCaseError> {
        let lookup = |name: &str| vars.iter().find(|(n, _)| n == name).map(|(_, v)| v.clone());
        let results = [
            ProcessLayout::from_vars(lookup).map(|layout| {
                assert!(layout.process_index() < layout.num_processes());
                assert!(layout.local_process_index() < layout.local_num_processes());
            }),
            crate::RunSecret::from_vars(&lookup).map(|_| ()),
            crate::secret::restart_count(&lookup).map(|_| ()),
        ];
        for result in results {
            if let Err(err) = result {
                let said = err.to_string();
                prop_assert!(
                    NAMES.iter().any(|n| said.contains(n)),
                    "no variable named in: {said}"
                );
            }
        }
        Ok(())
    }

    #[test]
    fn any_environment_is_read_or_names_the_variable() {
        fuzz::check(3000, environments(), layout_is_read_or_named);
    }

    #[test]
    #[ignore = "long run: BURN_ACCELERATE_FUZZ_CASES cases, for SECURITY.md"]
    fn long_run_environment() {
        fuzz::long_run("environment", environments(), layout_is_read_or_named);
    }
}
