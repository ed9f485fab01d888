//! [`ProcessState`]: Accelerate's `PartialState` as a small value read from the environment.

use std::time::Duration;

use super::env;
use super::error::DistributedError;
use super::secret::RunSecret;

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
pub struct ProcessState {
    num_processes: usize,
    process_index: usize,
    local_process_index: usize,
    local_num_processes: usize,
    num_machines: usize,
    machine_rank: usize,
    rendezvous: Option<Rendezvous>,
}

/// Where the processes of a run meet, and how long they wait for each other.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rendezvous {
    /// Host of the rendezvous (the main machine).
    pub main_addr: String,
    /// Its port.
    pub main_port: u16,
    /// The port this process accepts its peers' tensors on.
    pub data_port: u16,
    /// The host the others reach this process at (`None`: found from the route to
    /// `main_addr`).
    pub node_host: Option<String>,
    /// How long any wait on the other processes may last.
    pub timeout: Duration,
    /// How long a process may be silent (no heartbeat) before the run fails.
    pub liveness: Duration,
    /// Whether the launcher hosts the rendezvous (otherwise rank 0 does).
    pub hosted_by_launcher: bool,
    /// The run's secret (`None`: none given, and not under torchrun; joining then fails).
    pub secret: Option<RunSecret>,
}

impl ProcessState {
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
        }
    }

    /// Reads the process's place in the run from the environment (see [`env`](super::env)
    /// for the variables); a single process when none of `RANK`, `WORLD_SIZE`, `LOCAL_RANK`
    /// and `LOCAL_WORLD_SIZE` is set.
    ///
    /// # Errors
    /// A [`DistributedError`] naming the first variable that is missing, unparsable or
    /// inconsistent with the others.
    pub fn from_env() -> Result<Self, DistributedError> {
        Self::from_vars(|name| std::env::var(name).ok())
    }

    /// [`from_env`](Self::from_env) over any source of variables.
    ///
    /// # Errors
    /// As [`from_env`](Self::from_env).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Self, DistributedError> {
        let layout = [
            env::RANK,
            env::WORLD_SIZE,
            env::LOCAL_RANK,
            env::LOCAL_WORLD_SIZE,
        ];
        if layout.iter().all(|name| var(name).is_none()) {
            return Ok(Self::single());
        }
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
            })
        };
        let world = required(env::WORLD_SIZE)?;
        let rank = required(env::RANK)?;
        if world == 0 {
            return Err(invalid(env::WORLD_SIZE, world, "at least 1".into()));
        }
        if rank >= world {
            return Err(invalid(
                env::RANK,
                rank,
                format!("below WORLD_SIZE={world} (ranks are 0..{world})"),
            ));
        }
        // Set by hand without the local variables: one machine.
        let local_world = number(env::LOCAL_WORLD_SIZE)?.unwrap_or(world);
        if local_world == 0 || local_world > world || !world.is_multiple_of(local_world) {
            return Err(invalid(
                env::LOCAL_WORLD_SIZE,
                local_world,
                format!(
                    "a divisor of WORLD_SIZE={world} (processes per machine, the same on every \
                     machine)"
                ),
            ));
        }
        let local_rank = number(env::LOCAL_RANK)?.unwrap_or(rank % local_world);
        if local_rank >= local_world {
            return Err(invalid(
                env::LOCAL_RANK,
                local_rank,
                format!("below LOCAL_WORLD_SIZE={local_world}"),
            ));
        }
        let num_machines = world / local_world;
        let machine_rank = rank / local_world;
        if rank % local_world != local_rank {
            return Err(invalid(
                env::LOCAL_RANK,
                local_rank,
                format!(
                    "RANK mod LOCAL_WORLD_SIZE = {} (RANK={rank}, LOCAL_WORLD_SIZE={local_world}: \
                     ranks are numbered machine by machine)",
                    rank % local_world
                ),
            ));
        }
        if let Some(group_rank) = number(env::GROUP_RANK)?
            && group_rank != machine_rank
        {
            return Err(invalid(
                env::GROUP_RANK,
                group_rank,
                format!("RANK / LOCAL_WORLD_SIZE = {machine_rank} (RANK={rank})"),
            ));
        }
        let rendezvous = if world == 1 {
            None
        } else {
            Some(Self::read_rendezvous(&var, local_rank)?)
        };
        Ok(Self {
            num_processes: world,
            process_index: rank,
            local_process_index: local_rank,
            local_num_processes: local_world,
            num_machines,
            machine_rank,
            rendezvous,
        })
    }

    fn read_rendezvous(
        var: &impl Fn(&str) -> Option<String>,
        local_rank: usize,
    ) -> Result<Rendezvous, DistributedError> {
        let main_addr = var(env::MASTER_ADDR)
            .filter(|a| !a.trim().is_empty())
            .ok_or(DistributedError::MissingVariable {
                name: env::MASTER_ADDR,
                because: "WORLD_SIZE is above 1 and the processes must meet somewhere",
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
                because: "WORLD_SIZE is above 1 and the processes must meet somewhere",
            })
            .and_then(|v| port(env::MASTER_PORT, v))?;
        let data_port = match var(env::DATA_PORT) {
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
                .filter(|s| s.is_finite() && *s > 0.0)
                .map(Duration::from_secs_f64)
                .ok_or_else(|| DistributedError::InvalidVariable {
                    name,
                    value,
                    expected: "a positive number of seconds".into(),
                }),
        };
        let timeout = seconds(env::TIMEOUT, env::DEFAULT_TIMEOUT_SECS)?;
        let liveness = seconds(env::LIVENESS_TIMEOUT, env::DEFAULT_LIVENESS_SECS)?;
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
        Ok(Rendezvous {
            main_addr: main_addr.trim().to_string(),
            main_port,
            data_port,
            node_host: var(env::NODE_HOST).filter(|h| !h.trim().is_empty()),
            timeout,
            liveness,
            hosted_by_launcher,
            secret: RunSecret::from_vars(var)?,
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

    /// Where the processes meet (`None` for a single process).
    pub fn rendezvous(&self) -> Option<&Rendezvous> {
        self.rendezvous.as_ref()
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

    fn state(vars: &[(&str, &str)]) -> Result<ProcessState, DistributedError> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(n, v)| (n.to_string(), v.to_string()))
            .collect();
        ProcessState::from_vars(move |name| {
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

    #[test]
    fn nothing_set_is_one_process_and_rank_without_locals_is_one_machine() {
        assert_eq!(state(&[]).unwrap(), ProcessState::single());
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

    fn with(over: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
        let mut vars: Vec<_> = TWO_BY_TWO
            .iter()
            .filter(|(n, _)| !over.iter().any(|(o, _)| o == n))
            .copied()
            .collect();
        vars.extend(over.iter().filter(|(_, v)| !v.is_empty()).copied());
        vars
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
}
