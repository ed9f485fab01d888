//! `burn-accelerate`: `launch` runs one training program on several processes (and machines),
//! as `accelerate launch` does; `env` reports what this machine and build can run, as
//! `accelerate env` does.
//!
//! ```text
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! burn-accelerate launch --num-processes 2 --max-restarts 3 -- \
//!     target/release/examples/train_mlp --checkpoint-dir run/checkpoints
//! burn-accelerate env
//! ```
//!
//! With `--max-restarts N`, a failed run (a process that exits non-zero or is killed; a frozen
//! or cut-off one makes the others fail) is stopped whole and started again, up to `N` times,
//! as torchrun's elastic agent does: each start is an attempt, numbered in the processes'
//! environment and in every line the launcher writes, with a rendezvous that hears only its
//! own attempt's processes.
//!
//! With several processes on a machine, each gets `RAYON_NUM_THREADS` and `OMP_NUM_THREADS`
//! = max(1, cores / processes on the machine) where the launcher's environment does not set
//! them (a variable set there is kept), and the launcher says once what it set: as torchrun
//! sets `OMP_NUM_THREADS=1`, so that each process's thread pool does not take every core.
//! The training library's numbers do not depend on the thread count.
//!
//! With `--num-machines MIN:MAX` (torchrun's `--nnodes`), machine 0's launcher decides each
//! attempt's machines among the launchers connected to it (`distributed::membership`): a lost
//! machine's attempt is restarted with the machines that are left, if at least MIN.
//!
//! This crate is the launcher alone: it needs no Burn (its tree holds the process group's
//! Burn-free layer, `burn-accelerate-comm`, and clap), so `cargo install burn-accelerate-launch`
//! builds it in a fraction of the time the training library takes, and a project on any Burn
//! version can start its processes with it. Its command line is a library function, [`main`],
//! which the `burn-accelerate` crate's own `burn-accelerate` binary calls too, adding to `env`
//! what only a build with Burn can say (each backend's precisions, found by running them).

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicI32, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use burn_accelerate_comm::layout::MAX_WAIT_SECS;
use burn_accelerate_comm::{self as distributed, DistributedError, ProcessLayout, RunSecret, env};
use clap::{Args, Parser, Subcommand};

pub mod cpu;

#[derive(Parser)]
#[command(
    name = "burn-accelerate",
    version,
    about = "Run Burn training programs on several \
    processes and machines, like `accelerate launch`"
)]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Run PROGRAM on this machine's share of the run's processes
    ///
    /// Each process gets the environment it reads its place from (RANK, WORLD_SIZE,
    /// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
    /// BURN_ACCELERATE_DATA_PORT, BURN_ACCELERATE_TIMEOUT, BURN_ACCELERATE_LIVENESS_TIMEOUT);
    /// machine 0 hosts the rendezvous.
    /// Output lines are prefixed with the rank; Ctrl-C is forwarded; when any process fails,
    /// the others are stopped, and the run is started again while --max-restarts allows
    /// (otherwise the launcher exits non-zero, naming the rank of each attempt's failure).
    /// With --num-machines MIN:MAX, a restart takes the machines that are left, if at least MIN.
    ///
    /// Threads: with several processes on a machine, each gets RAYON_NUM_THREADS and
    /// OMP_NUM_THREADS = max(1, cores / processes on the machine), its share of the cores,
    /// so that every process's thread pool does not start a thread per core (torchrun sets
    /// OMP_NUM_THREADS=1 for the same reason). A variable set in the launcher's environment
    /// is kept as it is (`RAYON_NUM_THREADS=2 burn-accelerate launch ...`); the launcher
    /// says once what it set.
    Launch(Launch),
    /// Write a fresh run secret (64 hex characters) to PATH (readable by its owner only), or
    /// print it
    ///
    /// A run of several machines needs the same secret on every machine: give the file to
    /// each launcher with --secret-file (or set BURN_ACCELERATE_SECRET). Every connection of
    /// the run proves it knows it; it never crosses the wire.
    Secret {
        /// Where to write it (standard output when absent).
        path: Option<std::path::PathBuf>,
    },
    /// Print the versions, the process layout and what each backend runs
    ///
    /// Like `accelerate env`: the process layout this environment describes, and the
    /// precisions each compiled-in backend really runs (found by running them).
    Env,
}

#[derive(Args, Debug)]
struct Launch {
    /// Processes in the whole run, over all machines (as `accelerate launch`'s
    /// --num_processes); each machine starts NUM_PROCESSES / NUM_MACHINES of them.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    num_processes: u32,
    /// Machines taking part: N, or MIN:MAX for an elastic run (torchrun's --nnodes), which
    /// starts with the machines whose launchers are there (MAX at once, at least MIN after
    /// --join-window) and, when one is lost, restarts with those left (while --max-restarts
    /// allows) if at least MIN are; a machine that comes back joins at the next restart.
    /// Each machine runs NUM_PROCESSES / MAX processes; machine 0's launcher coordinates, and
    /// the run ends if it is lost.
    #[arg(long, default_value = "1", value_name = "N|MIN:MAX", value_parser = parse_machines)]
    num_machines: Machines,
    /// This machine's rank, 0..NUM_MACHINES (0..MAX); machine 0 hosts the rendezvous. In an
    /// elastic run it names the machine, and each attempt numbers its machines anew (0 stays 0).
    #[arg(long, default_value_t = 0)]
    machine_rank: u32,
    /// Address of machine 0, reachable from every machine (required with several machines).
    #[arg(long)]
    main_process_ip: Option<String>,
    /// Port of the rendezvous on machine 0. 0: ports the system picks, for the rendezvous
    /// and for each process's own (one machine only: the others could not be told them), so
    /// that launches on one host at once never pick the same.
    #[arg(long, default_value_t = env::DEFAULT_MAIN_PORT)]
    main_process_port: u16,
    /// Seconds any wait between processes (the rendezvous, a collective) may last before the
    /// run fails.
    #[arg(long, default_value_t = env::DEFAULT_TIMEOUT_SECS as f64)]
    timeout: f64,
    /// Seconds a process may send nothing (its network thread sends heartbeats whatever the
    /// training does) before every process's collectives fail: a frozen process or a cut link
    /// ends the run after this.
    #[arg(long, default_value_t = env::DEFAULT_LIVENESS_SECS as f64)]
    liveness_timeout: f64,
    /// Seconds the other processes get to exit after one failed (or after Ctrl-C) before
    /// they are killed.
    #[arg(long, default_value_t = 5.0)]
    grace: f64,
    /// A file holding the run's secret (as `burn-accelerate secret` writes it); the same on
    /// every machine. Without it: BURN_ACCELERATE_SECRET if set, else a fresh one for a run of
    /// one machine; a run of several machines without one is refused.
    #[arg(long, value_name = "PATH")]
    secret_file: Option<std::path::PathBuf>,
    /// Run several machines without a secret: anyone who reaches the ports can join the run or
    /// send it values. Only on a network no one else reaches.
    #[arg(long)]
    insecure_no_secret: bool,
    /// Times the run may be started again after a process fails (torchrun's --max-restarts):
    /// the whole group is stopped and started afresh, each start with its number in
    /// BURN_ACCELERATE_RESTART_COUNT and TORCHELASTIC_RESTART_COUNT (0, 1, ...) and a
    /// rendezvous that refuses the processes of earlier starts. A program training with
    /// `with_accelerate` and a checkpoint directory (train_mlp --checkpoint-dir) resumes from
    /// its newest complete checkpoint. With several machines, give every launcher the same
    /// number.
    #[arg(long, default_value_t = 0, value_name = "N",
        value_parser = clap::value_parser!(u32).range(0..=1_000_000))]
    max_restarts: u32,
    /// With --num-machines MIN:MAX: seconds machine 0's launcher waits, at each start, for
    /// more machines once MIN are there (torchrun's last call); with MAX it starts at once.
    #[arg(long, default_value_t = 30.0, value_name = "SECONDS")]
    join_window: f64,
    /// The program to run, and its arguments (after `--`).
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM"
    )]
    command: Vec<String>,
}

/// `--num-machines`: a fixed count, or an elastic range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Machines {
    min: u32,
    max: u32,
    elastic: bool,
}

fn parse_machines(text: &str) -> Result<Machines, String> {
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .ok()
            .filter(|&n| n >= 1)
            .ok_or_else(|| format!("{part:?} is not a number of machines (1 or more)"))
    };
    match text.split_once(':') {
        None => {
            let n = number(text)?;
            Ok(Machines {
                min: n,
                max: n,
                elastic: false,
            })
        }
        Some((min, max)) => {
            let (min, max) = (number(min)?, number(max)?);
            if min > max {
                return Err(format!(
                    "MIN:MAX {min}:{max}: MIN is more than MAX (write {max}:{min}?)"
                ));
            }
            Ok(Machines {
                min,
                max,
                elastic: true,
            })
        }
    }
}

/// What `burn-accelerate env` reports after the launcher's own lines (its version, the cores,
/// the process layout the environment describes, the launch variables that are set): a
/// program that links a training library passes what that library can say about this
/// environment (what each backend runs); [`launcher_only`] for the launcher alone.
pub type EnvReport = fn();

/// The `env` report of the launcher alone, which has no backend to probe: it says where that
/// report is.
pub fn launcher_only() {
    println!(
        "backends: not probed by the launcher alone (it has no Burn); the `burn-accelerate` \
         binary of the burn-accelerate crate (`cargo install burn-accelerate`) reports what \
         each compiled-in backend runs"
    );
}

/// The `burn-accelerate` command line (`launch`, `secret`, `env`), on this process's
/// arguments; `env` ends with `env_report`. Returns the process's exit code.
pub fn main(env_report: EnvReport) -> ExitCode {
    match Cli::parse().task {
        Task::Launch(launch) => match run(&launch) {
            Ok(code) => code,
            Err(err) => {
                eprintln!("burn-accelerate launch: {err}");
                ExitCode::from(2)
            }
        },
        Task::Secret { path } => match write_secret(path.as_deref()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("burn-accelerate secret: {err}");
                ExitCode::from(2)
            }
        },
        Task::Env => {
            report_env();
            env_report();
            ExitCode::SUCCESS
        }
    }
}

// Writes a fresh secret to `path` (owner-only) or standard output.
fn write_secret(path: Option<&std::path::Path>) -> Result<(), DistributedError> {
    let text = RunSecret::generate()?.to_text();
    let Some(path) = path else {
        println!("{text}");
        return Ok(());
    };
    let io = |e: std::io::Error| DistributedError::Io {
        what: format!("writing {}", path.display()),
        reason: e.to_string(),
    };
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create(true).truncate(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut options, 0o600);
    options
        .open(path)
        .and_then(|mut file| file.write_all(format!("{text}\n").as_bytes()))
        .map_err(io)
}

/// The secret of a run launched with --insecure-no-secret: the same on every machine without
/// being shared, so it keeps no one out.
const INSECURE: &str = "burn-accelerate:insecure-no-secret";

impl Launch {
    fn secret(&self) -> Result<RunSecret, DistributedError> {
        if let Some(path) = &self.secret_file {
            let text = std::fs::read_to_string(path).map_err(|e| DistributedError::Io {
                what: format!("reading the secret file {}", path.display()),
                reason: e.to_string(),
            })?;
            if text.trim().is_empty() {
                return Err(DistributedError::InvalidLaunch(format!(
                    "--secret-file {} is empty: `burn-accelerate secret {}` writes one",
                    path.display(),
                    path.display()
                )));
            }
            return Ok(RunSecret::from_text(&text));
        }
        if let Some(text) = std::env::var(env::SECRET)
            .ok()
            .filter(|t| !t.trim().is_empty())
        {
            return Ok(RunSecret::from_text(&text));
        }
        if self.insecure_no_secret {
            return Ok(RunSecret::from_text(INSECURE));
        }
        if self.num_machines.max == 1 {
            return RunSecret::generate();
        }
        Err(DistributedError::InvalidLaunch(format!(
            "a run of {} machines needs the same secret on every machine: write one with \
             `burn-accelerate secret run.secret`, copy it to each machine, and pass \
             --secret-file run.secret to every launcher (or set {}); --insecure-no-secret \
             runs without one, for a network no one else reaches",
            self.num_machines.max,
            env::SECRET
        )))
    }
}

/// The processes this machine starts, and the environment they share.
#[derive(Debug)]
struct Plan {
    local: u32,
    world: u32,
    first_rank: u32,
    /// This machine's rank in the run (in an elastic run, in the attempt).
    machine_rank: u32,
    main_addr: String,
    /// The rendezvous's port: `--main-process-port`, or the system's pick for 0 once the
    /// rendezvous listens.
    main_port: u16,
}

impl Launch {
    fn plan(&self) -> Result<Plan, DistributedError> {
        let bad = |msg: String| Err(DistributedError::InvalidLaunch(msg));
        let machines = self.num_machines;
        // An elastic run's flags name MAX where a fixed run's name its one count.
        let (count, named) = if machines.elastic {
            (
                machines.max,
                format!("MAX of --num-machines {}:{}", machines.min, machines.max),
            )
        } else {
            (machines.max, format!("--num-machines {}", machines.max))
        };
        if self.machine_rank >= count {
            return bad(format!(
                "--machine-rank {} is not below {named}",
                self.machine_rank
            ));
        }
        if !self.num_processes.is_multiple_of(count) {
            return bad(format!(
                "--num-processes {} (processes in the whole run) is not a multiple of \
                 {named}: every machine runs the same number",
                self.num_processes
            ));
        }
        if machines.elastic
            && !(self.join_window.is_finite() && (0.0..=MAX_WAIT_SECS).contains(&self.join_window))
        {
            return bad(format!(
                "--join-window {} is not a number of seconds (at most {MAX_WAIT_SECS})",
                self.join_window
            ));
        }
        if !(self.timeout > 0.0 && self.timeout <= MAX_WAIT_SECS) {
            return bad(format!(
                "--timeout {} is not a positive number of seconds (at most {MAX_WAIT_SECS})",
                self.timeout
            ));
        }
        if !(self.liveness_timeout > 0.0 && self.liveness_timeout <= MAX_WAIT_SECS) {
            return bad(format!(
                "--liveness-timeout {} is not a positive number of seconds (at most {MAX_WAIT_SECS})",
                self.liveness_timeout
            ));
        }
        if !(0.0..=MAX_WAIT_SECS).contains(&self.grace) {
            return bad(format!(
                "--grace {} is not a number of seconds (at most {MAX_WAIT_SECS})",
                self.grace
            ));
        }
        if self.main_process_port == 0 && count > 1 {
            return bad(format!(
                "--main-process-port 0 (a port the system picks) with {named}: the other \
                 machines' launchers must be told machine 0's port; give one (every machine \
                 the same)"
            ));
        }
        let main_addr = match (&self.main_process_ip, count) {
            (Some(ip), _) => ip.clone(),
            (None, 1) => "127.0.0.1".into(),
            (None, _) => {
                return bad(format!(
                    "--main-process-ip is required with {named}: the address of machine 0 \
                     that every machine can reach"
                ));
            }
        };
        let local = self.num_processes / count;
        Ok(Plan {
            local,
            world: self.num_processes,
            first_rank: self.machine_rank * local,
            machine_rank: self.machine_rank,
            main_addr,
            main_port: self.main_process_port,
        })
    }
}

// The signal that asked the launcher to stop (0: none yet).
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// Which start of the run a launcher line belongs to: `[attempt 2/4]` is the first restart of
/// a run that may restart 3 times.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Attempt {
    /// 0 for the first start, `n` after `n` restarts (the processes' restart count).
    number: u64,
    /// Starts the run may have in all: `--max-restarts` + 1.
    of: u64,
}

impl std::fmt::Display for Attempt {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "burn-accelerate launch [attempt {}/{}]",
            self.number + 1,
            self.of
        )
    }
}

// What the launcher says when the last allowed attempt failed: every attempt's failure, in
// order, so that one look tells a flaky machine (different failures) from a bug (the same).
fn budget_spent(max_restarts: u32, failures: &[String]) -> String {
    let each: Vec<String> = failures
        .iter()
        .enumerate()
        .map(|(i, failure)| format!("attempt {}: {failure}", i + 1))
        .collect();
    format!(
        "burn-accelerate launch: the run failed {} times and --max-restarts {max_restarts} \
         allows no more restarts ({}); raise --max-restarts to try again from the last \
         checkpoint",
        failures.len(),
        each.join("; ")
    )
}

fn run(launch: &Launch) -> Result<ExitCode, DistributedError> {
    let mut plan = launch.plan()?;
    if launch.num_machines.elastic {
        return elastic::run(launch, plan);
    }
    let io = |what: &str| {
        let what = what.to_string();
        move |e: std::io::Error| DistributedError::Io {
            what,
            reason: e.to_string(),
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .map_err(io("starting the launcher's runtime"))?;
    let timeout = Duration::from_secs_f64(launch.timeout);
    let secret = launch.secret()?;
    let host = if launch.machine_rank == 0 && plan.world > 1 {
        // On the address the other machines were told (loopback for one machine), not on
        // every interface. One rendezvous for every attempt: the port stays the one the other
        // machines were given, and it refuses the processes of attempts that have ended.
        let host = distributed::serve_rendezvous(
            &plan.main_addr,
            launch.main_process_port,
            timeout,
            secret.clone(),
            runtime.handle(),
        )?;
        plan.main_port = host.port();
        Some(host)
    } else {
        None
    };
    runtime.spawn(forward_stop_signals());

    let attempts = u64::from(launch.max_restarts) + 1;
    let threads = threads_per_process(
        plan.local,
        Attempt {
            number: 0,
            of: attempts,
        },
    );
    let grace = Duration::from_secs_f64(launch.grace);
    let mut failures = Vec::new();
    for number in 0..attempts {
        let attempt = Attempt {
            number,
            of: attempts,
        };
        if let Some(host) = &host {
            host.begin_attempt(number);
        }
        if number > 0 {
            eprintln!(
                "{attempt}: starting the run's {} processes on this machine again (restart \
                 {number} of {}; {}={number})",
                plan.local,
                launch.max_restarts,
                env::RESTART_COUNT
            );
        }
        let mut children = match start(launch, &plan, &secret, attempt, threads) {
            Ok(children) => children,
            Err(err) => {
                eprintln!("{attempt}: {err}");
                return Ok(ExitCode::from(2));
            }
        };
        let outcome = supervise(&mut children, grace, || None);
        for child in &mut children {
            child.finish_output();
        }
        match outcome {
            Outcome::AllSucceeded => {
                if number > 0 {
                    eprintln!("{attempt}: every process succeeded");
                }
                return Ok(ExitCode::SUCCESS);
            }
            Outcome::Stopped(signal) => {
                eprintln!("{attempt}: stopped by signal {signal}; so were the processes");
                return Ok(ExitCode::from((128 + signal).clamp(0, 255) as u8));
            }
            Outcome::Interrupted(why) => unreachable!("a fixed run is never interrupted: {why}"),
            Outcome::Failed { rank, status } => {
                let failure = format!("process {rank} {}", describe(status));
                eprintln!("{attempt}: {failure}; the other processes were stopped");
                failures.push(failure);
                // Ctrl-C while the group was being stopped ends the run rather than restarting
                // it.
                let signal = STOP_SIGNAL.load(Ordering::SeqCst);
                if signal != 0 {
                    eprintln!("{attempt}: stopped by signal {signal}; no restart");
                    return Ok(ExitCode::from((128 + signal).clamp(0, 255) as u8));
                }
                if number + 1 < attempts {
                    eprintln!(
                        "{attempt}: restarting the run ({} of {} restarts left after this one)",
                        attempts - number - 2,
                        launch.max_restarts
                    );
                }
            }
        }
    }
    if launch.max_restarts > 0 {
        eprintln!("{}", budget_spent(launch.max_restarts, &failures));
    }
    Ok(ExitCode::FAILURE)
}

/// `--num-machines MIN:MAX`: machine 0's launcher coordinates the attempts, the others follow
/// (see `burn_accelerate_comm::membership`).
mod elastic {
    use super::*;
    use burn_accelerate_comm::membership::{AttemptState, Coordinator, MemberLink, Order, Shape};

    fn signalled() -> Option<ExitCode> {
        let signal = STOP_SIGNAL.load(Ordering::SeqCst);
        (signal != 0).then(|| ExitCode::from((128 + signal).clamp(0, 255) as u8))
    }

    pub(super) fn run(launch: &Launch, plan: Plan) -> Result<ExitCode, DistributedError> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| DistributedError::Io {
                what: "starting the launcher's runtime".into(),
                reason: e.to_string(),
            })?;
        let secret = launch.secret()?;
        runtime.spawn(forward_stop_signals());
        let shape = Shape {
            min: launch.num_machines.min,
            max: launch.num_machines.max,
            local: plan.local,
        };
        if launch.machine_rank == 0 {
            coordinate(launch, plan, shape, &secret, &runtime)
        } else {
            follow(launch, plan, shape, &secret, &runtime)
        }
    }

    // Machine 0: decides each attempt's machines, runs its own share, and restarts the run
    // when any machine fails or is lost.
    fn coordinate(
        launch: &Launch,
        mut plan: Plan,
        shape: Shape,
        secret: &RunSecret,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<ExitCode, DistributedError> {
        let timeout = Duration::from_secs_f64(launch.timeout);
        let liveness = Duration::from_secs_f64(launch.liveness_timeout);
        let window = Duration::from_secs_f64(launch.join_window);
        let grace = Duration::from_secs_f64(launch.grace);
        // Listening from the start, whatever the first attempt's size: the other machines'
        // launchers reach this one through the rendezvous's port.
        let host = distributed::serve_rendezvous(
            &plan.main_addr,
            launch.main_process_port,
            timeout,
            secret.clone(),
            runtime.handle(),
        )?;
        plan.main_port = host.port();
        let mut coordinator = Coordinator::start(&host, shape, liveness, runtime.handle());
        let attempts = u64::from(launch.max_restarts) + 1;
        let threads = threads_per_process(
            plan.local,
            Attempt {
                number: 0,
                of: attempts,
            },
        );
        let mut failures = Vec::new();
        for number in 0..attempts {
            let attempt = Attempt {
                number,
                of: attempts,
            };
            host.begin_attempt(number);
            eprintln!(
                "{attempt}: waiting for the machines' launchers (--num-machines {}:{}: all {} \
                 at once, or at least {} after --join-window {}s)",
                shape.min, shape.max, shape.max, shape.min, launch.join_window
            );
            let machines = match coordinator.gather(window, timeout, || signalled().is_some()) {
                Ok(Some(machines)) => machines,
                Ok(None) => {
                    eprintln!("{attempt}: stopped by a signal while waiting for the machines");
                    coordinator.finish(false, "machine 0's launcher was stopped by a signal");
                    return Ok(signalled().unwrap_or(ExitCode::FAILURE));
                }
                Err(err) => {
                    eprintln!("{attempt}: {err}");
                    coordinator.finish(false, &err.to_string());
                    return Ok(signalled().unwrap_or(ExitCode::FAILURE));
                }
            };
            let world = plan.local * machines.len() as u32;
            eprintln!(
                "{attempt}: {} of at most {} machines take part (by --machine-rank: {machines:?}), \
                 {world} processes; {}={world}",
                machines.len(),
                shape.max,
                env::WORLD_SIZE
            );
            coordinator.begin(number, &machines);
            let this = Plan {
                local: plan.local,
                world,
                first_rank: 0,
                machine_rank: 0,
                main_addr: plan.main_addr.clone(),
                main_port: plan.main_port,
            };
            let mut children = match start(launch, &this, secret, attempt, threads) {
                Ok(children) => children,
                Err(err) => {
                    eprintln!("{attempt}: {err}");
                    coordinator.stop(number);
                    coordinator.finish(false, "machine 0 could not start its processes");
                    return Ok(ExitCode::from(2));
                }
            };
            let outcome = supervise(&mut children, grace, || match coordinator.state(number) {
                AttemptState::Failed(why) => Some(why),
                _ => None,
            });
            for child in &mut children {
                child.finish_output();
            }
            let failure = match outcome {
                Outcome::AllSucceeded => match wait_for_members(&mut coordinator, number) {
                    Ok(()) => {
                        eprintln!("{attempt}: every process succeeded, on every machine");
                        coordinator.finish(true, "every process succeeded");
                        return Ok(ExitCode::SUCCESS);
                    }
                    Err(why) => why,
                },
                Outcome::Stopped(signal) => {
                    eprintln!("{attempt}: stopped by signal {signal}; so were the processes");
                    coordinator.stop(number);
                    coordinator.finish(false, "machine 0's launcher was stopped by a signal");
                    return Ok(ExitCode::from((128 + signal).clamp(0, 255) as u8));
                }
                Outcome::Interrupted(why) => why,
                Outcome::Failed { rank, status } => format!("process {rank} {}", describe(status)),
            };
            eprintln!("{attempt}: {failure}; the other processes were stopped");
            coordinator.stop(number);
            failures.push(failure);
            if let Some(code) = signalled() {
                eprintln!("{attempt}: stopped by a signal; no restart");
                coordinator.finish(false, "machine 0's launcher was stopped by a signal");
                return Ok(code);
            }
            if number + 1 < attempts {
                eprintln!(
                    "{attempt}: restarting the run with the machines that are ready ({} of {} \
                     restarts left after this one)",
                    attempts - number - 2,
                    launch.max_restarts
                );
            }
        }
        coordinator.finish(
            false,
            "the run failed and --max-restarts allows no more restarts",
        );
        if launch.max_restarts > 0 {
            eprintln!("{}", budget_spent(launch.max_restarts, &failures));
        }
        Ok(ExitCode::FAILURE)
    }

    // Once machine 0's processes succeeded: the other members' end. Their launchers' liveness
    // bounds the wait (a lost one fails the attempt).
    fn wait_for_members(coordinator: &mut Coordinator, attempt: u64) -> Result<(), String> {
        loop {
            match coordinator.state(attempt) {
                AttemptState::Succeeded => return Ok(()),
                AttemptState::Failed(why) => return Err(why),
                AttemptState::Running if signalled().is_some() => {
                    return Err("stopped by a signal while the other machines ran".into());
                }
                AttemptState::Running => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    }

    // Another machine: runs what machine 0's launcher says, attempt after attempt, until it
    // says the run is over (or is lost for longer than --timeout).
    fn follow(
        launch: &Launch,
        plan: Plan,
        shape: Shape,
        secret: &RunSecret,
        runtime: &tokio::runtime::Runtime,
    ) -> Result<ExitCode, DistributedError> {
        let timeout = Duration::from_secs_f64(launch.timeout);
        let liveness = Duration::from_secs_f64(launch.liveness_timeout);
        let grace = Duration::from_secs_f64(launch.grace);
        let main = format!("{}:{}", plan.main_addr, plan.main_port);
        let machine = launch.machine_rank;
        let connect = |timeout: Duration| {
            MemberLink::connect(
                &main,
                machine,
                shape,
                secret,
                liveness,
                timeout,
                runtime.handle(),
                || signalled().is_some(),
            )
        };
        let said = |what: String| eprintln!("burn-accelerate launch [machine {machine}]: {what}");
        let stopped = || {
            said("stopped by a signal".into());
            Ok(signalled().unwrap_or(ExitCode::FAILURE))
        };
        let mut link = match connect(timeout) {
            Ok(Some(link)) => link,
            Ok(None) => return stopped(),
            Err(err) => {
                said(err.to_string());
                return Ok(ExitCode::FAILURE);
            }
        };
        said(format!(
            "connected to machine 0's launcher at {main}; waiting for the next attempt"
        ));
        let attempts = u64::from(launch.max_restarts) + 1;
        let threads = threads_per_process(
            plan.local,
            Attempt {
                number: 0,
                of: attempts,
            },
        );
        let mut pending = None;
        // Since when machine 0's launcher has been lost, with no attempt started since: the
        // reconnections share one --timeout (a machine 0 that closes every connection at once,
        // one started with a plain --num-machines, is not waited for forever).
        let mut lost_since: Option<Instant> = None;
        loop {
            let order = match pending.take() {
                Some(order) => order,
                None => loop {
                    if let Some(order) = link.try_next() {
                        break order;
                    }
                    if signalled().is_some() {
                        return stopped();
                    }
                    std::thread::sleep(Duration::from_millis(20));
                },
            };
            let plan_of = match order {
                Order::Start(plan_of) => {
                    lost_since = None;
                    plan_of
                }
                Order::Stop(_) => continue,
                Order::Finished { ok, why } => {
                    said(format!("the run is over: {why}"));
                    return Ok(if ok {
                        ExitCode::SUCCESS
                    } else {
                        ExitCode::FAILURE
                    });
                }
                Order::Refused(why) => {
                    said(format!("machine 0's launcher refused this one: {why}"));
                    return Ok(ExitCode::from(2));
                }
                Order::Lost(why) => {
                    let since = *lost_since.get_or_insert_with(Instant::now);
                    let left = timeout.saturating_sub(since.elapsed());
                    if left.is_zero() {
                        said(format!(
                            "lost machine 0's launcher ({why}) for --timeout {}s: giving up \
                             (is it running, with the same --num-machines MIN:MAX?)",
                            launch.timeout
                        ));
                        return Ok(ExitCode::FAILURE);
                    }
                    said(format!(
                        "lost machine 0's launcher ({why}); trying to reach it again for {}s \
                         (the run cannot go on without machine 0)",
                        left.as_secs()
                    ));
                    std::thread::sleep(Duration::from_millis(500));
                    link = match connect(left) {
                        Ok(Some(link)) => link,
                        Ok(None) => return stopped(),
                        Err(err) => {
                            said(err.to_string());
                            return Ok(ExitCode::FAILURE);
                        }
                    };
                    said(
                        "connected to machine 0's launcher again; waiting for the next attempt"
                            .into(),
                    );
                    continue;
                }
            };
            let attempt = Attempt {
                number: plan_of.attempt,
                of: attempts,
            };
            let world = plan.local * plan_of.machines.len() as u32;
            let this = Plan {
                local: plan.local,
                world,
                first_rank: plan_of.machine_rank * plan.local,
                machine_rank: plan_of.machine_rank,
                main_addr: plan.main_addr.clone(),
                main_port: plan.main_port,
            };
            eprintln!(
                "{attempt}: machine {machine} is machine rank {} of {} (by --machine-rank: \
                 {:?}), processes {}..{world}",
                plan_of.machine_rank,
                plan_of.machines.len(),
                plan_of.machines,
                this.first_rank,
            );
            let mut children = match start(launch, &this, secret, attempt, threads) {
                Ok(children) => children,
                Err(err) => {
                    eprintln!("{attempt}: {err}");
                    link.ended(plan_of.attempt, false, &err.to_string());
                    continue;
                }
            };
            let outcome = supervise(&mut children, grace, || match link.try_next()? {
                Order::Stop(number) if number == plan_of.attempt => {
                    Some("machine 0's launcher stopped the attempt".into())
                }
                Order::Stop(_) => None,
                other => {
                    let why = match &other {
                        Order::Lost(why) => format!("lost machine 0's launcher ({why})"),
                        Order::Finished { why, .. } => format!("the run is over ({why})"),
                        Order::Refused(why) => format!("refused by machine 0's launcher ({why})"),
                        Order::Start(plan) => format!("told to start attempt {}", plan.attempt + 1),
                        Order::Stop(_) => unreachable!("matched above"),
                    };
                    pending = Some(other);
                    Some(why)
                }
            });
            for child in &mut children {
                child.finish_output();
            }
            let (ok, what) = match outcome {
                Outcome::AllSucceeded => (true, "every process succeeded".to_string()),
                Outcome::Failed { rank, status } => {
                    (false, format!("process {rank} {}", describe(status)))
                }
                Outcome::Interrupted(why) => (false, format!("stopped: {why}")),
                Outcome::Stopped(signal) => {
                    eprintln!("{attempt}: stopped by signal {signal}; so were the processes");
                    return Ok(ExitCode::from((128 + signal).clamp(0, 255) as u8));
                }
            };
            eprintln!("{attempt}: {what}");
            link.ended(plan_of.attempt, ok, &what);
        }
    }
}

// Starts this machine's processes for `attempt`, each with its place in the run and the
// attempt's number.
fn start(
    launch: &Launch,
    plan: &Plan,
    secret: &RunSecret,
    attempt: Attempt,
    threads: Option<usize>,
) -> Result<Vec<Rank>, DistributedError> {
    // Each machine starts at its first rank's place, so that machines sharing a host (a test)
    // do not pick the same ports. Chosen anew each attempt: a process of an earlier one that
    // outlived its group may still hold its port. With `--main-process-port 0`, each process
    // listens on a port the system picks (0) and tells the others at the rendezvous: nothing
    // is probed, so launches at once on one host cannot pick the same.
    let ports = if launch.main_process_port == 0 {
        vec![0; plan.local as usize]
    } else {
        let first_port = u16::try_from(u32::from(launch.main_process_port) + 1 + plan.first_rank)
            .unwrap_or(u16::MAX);
        free_ports(first_port, plan.local as usize).map_err(|e| DistributedError::Io {
            what: "choosing the processes' ports".into(),
            reason: e.to_string(),
        })?
    };
    let mut children = Vec::new();
    for (local_rank, port) in (0..plan.local).zip(ports) {
        let rank = plan.first_rank + local_rank;
        let mut command = Command::new(&launch.command[0]);
        command
            .args(&launch.command[1..])
            .env(env::RANK, rank.to_string())
            .env(env::WORLD_SIZE, plan.world.to_string())
            .env(env::LOCAL_RANK, local_rank.to_string())
            .env(env::LOCAL_WORLD_SIZE, plan.local.to_string())
            .env(env::GROUP_RANK, plan.machine_rank.to_string())
            .env(env::MASTER_ADDR, &plan.main_addr)
            .env(env::MASTER_PORT, plan.main_port.to_string())
            .env(env::DATA_PORT, port.to_string())
            .env(env::TIMEOUT, launch.timeout.to_string())
            .env(env::LIVENESS_TIMEOUT, launch.liveness_timeout.to_string())
            .env(env::ORCHESTRATOR, env::ORCHESTRATOR_LAUNCHER)
            .env(env::SECRET, secret.to_text())
            .env(env::RESTART_COUNT, attempt.number.to_string())
            .env(env::TORCHRUN_RESTART_COUNT, attempt.number.to_string())
            .env(env::MAX_RESTARTS, launch.max_restarts.to_string())
            .env(env::TORCHRUN_MAX_RESTARTS, launch.max_restarts.to_string())
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        // Each process leads a process group of its own, which the launcher signals whole:
        // what it starts in turn (a shell's children, a data-loading helper) stops with it.
        #[cfg(unix)]
        std::os::unix::process::CommandExt::process_group(&mut command, 0);
        if let Some(threads) = threads {
            // The user's own choice is kept (`ThreadShare`).
            for var in THREAD_VARIABLES {
                if std::env::var_os(var).is_none() {
                    command.env(var, threads.to_string());
                }
            }
        }
        let child = match command.spawn() {
            Ok(child) => child,
            Err(err) => {
                stop(&mut children, Duration::ZERO);
                return Err(DistributedError::Io {
                    what: format!("cannot start {:?}", launch.command[0]),
                    reason: err.to_string(),
                });
            }
        };
        children.push(Rank::start(rank, child));
    }
    Ok(children)
}

/// The thread-count variables the launcher gives each process: rayon's (Flex, the `gemm`
/// crate, the training library's CPU kernels) and OpenMP's (LibTorch under tch).
const THREAD_VARIABLES: [&str; 2] = ["RAYON_NUM_THREADS", "OMP_NUM_THREADS"];

/// How a machine's cores are shared among its processes: the variables the launcher sets in
/// each process and those the user set, which the processes inherit unchanged.
#[derive(Debug, PartialEq, Eq)]
struct ThreadShare {
    local: u32,
    cores: usize,
    /// Each process's share: `max(1, cores / local)`.
    threads: usize,
    /// The variables nobody set, which each process gets as `threads`.
    set: Vec<&'static str>,
    /// The variables the user set, with their values.
    kept: Vec<(&'static str, String)>,
}

impl ThreadShare {
    // `None` for one process on the machine: its pools take every core, as they would
    // without the launcher. `user` reads the launcher's environment.
    fn of(local: u32, cores: usize, user: impl Fn(&str) -> Option<String>) -> Option<Self> {
        if local < 2 {
            return None;
        }
        let threads = (cores / local as usize).max(1);
        let (mut set, mut kept) = (Vec::new(), Vec::new());
        for var in THREAD_VARIABLES {
            match user(var) {
                Some(value) => kept.push((var, value)),
                None => set.push(var),
            }
        }
        Some(Self {
            local,
            cores,
            threads,
            set,
            kept,
        })
    }

    // What the launcher says once, when it sets anything (as torchrun warns when it sets
    // OMP_NUM_THREADS=1).
    fn message(&self) -> Option<String> {
        if self.set.is_empty() {
            return None;
        }
        let set = self
            .set
            .iter()
            .map(|var| format!("{var}={}", self.threads))
            .collect::<Vec<_>>()
            .join(" and ");
        let kept = self
            .kept
            .iter()
            .map(|(var, value)| format!("; {var}={value:?} is yours and kept"))
            .collect::<String>();
        Some(format!(
            "{} processes on this machine's {} cores: each process gets {set}, its share of \
             the cores, so that their thread pools do not oversubscribe them{kept}; set {} \
             yourself to choose another count",
            self.local,
            self.cores,
            self.set.join(" / ")
        ))
    }
}

// With several processes on a machine, each gets its share of the cores where the user has
// not chosen: otherwise every process's thread pool starts a thread per core, and the
// processes fight over them. torchrun does the same for OpenMP (torch 2.9,
// torch/distributed/run.py, `config_from_args`: OMP_NUM_THREADS=1 when it is unset and
// nproc_per_node > 1, with a warning); the launcher gives each process its share rather
// than one thread, and sets rayon's variable too.
fn threads_per_process(local: u32, attempt: Attempt) -> Option<usize> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = ThreadShare::of(local, cores, |var| {
        std::env::var_os(var).map(|v| v.to_string_lossy().into_owned())
    })?;
    if let Some(message) = share.message() {
        eprintln!("{attempt}: {message}");
    }
    Some(share.threads)
}

// The first `n` ports from `first` on that are free now: the ports after the main one, as
// torchrun's processes take them (a range a firewall can open, and below the ephemeral ports
// outgoing connections take: an ephemeral port free now may be a connection's a moment later).
fn free_ports(first: u16, n: usize) -> std::io::Result<Vec<u16>> {
    let mut ports = Vec::with_capacity(n);
    for port in first..=u16::MAX {
        if ports.len() == n {
            break;
        }
        if std::net::TcpListener::bind(("0.0.0.0", port)).is_ok() {
            ports.push(port);
        }
    }
    if ports.len() < n {
        return Err(std::io::Error::new(
            std::io::ErrorKind::AddrInUse,
            format!("fewer than {n} free ports from {first} on"),
        ));
    }
    Ok(ports)
}

async fn forward_stop_signals() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let (Ok(mut int), Ok(mut term)) = (
            signal(SignalKind::interrupt()),
            signal(SignalKind::terminate()),
        ) else {
            return;
        };
        let signal = tokio::select! {
            _ = int.recv() => nix::sys::signal::Signal::SIGINT,
            _ = term.recv() => nix::sys::signal::Signal::SIGTERM,
        };
        STOP_SIGNAL.store(signal as i32, Ordering::SeqCst);
    }
    #[cfg(not(unix))]
    if tokio::signal::ctrl_c().await.is_ok() {
        STOP_SIGNAL.store(2, Ordering::SeqCst);
    }
}

/// One started process and the threads copying its output.
struct Rank {
    rank: u32,
    child: Child,
    status: Option<ExitStatus>,
    output: Vec<JoinHandle<()>>,
}

impl Rank {
    fn start(rank: u32, mut child: Child) -> Self {
        let prefix: Arc<str> = format!("[rank {rank}] ").into();
        let mut output = Vec::new();
        if let Some(out) = child.stdout.take() {
            output.push(copy_lines(out, prefix.clone(), || {
                Box::new(std::io::stdout())
            }));
        }
        if let Some(err) = child.stderr.take() {
            output.push(copy_lines(err, prefix, || Box::new(std::io::stderr())));
        }
        Self {
            rank,
            child,
            status: None,
            output,
        }
    }

    fn poll(&mut self) -> Option<ExitStatus> {
        if self.status.is_none() {
            self.status = self.child.try_wait().ok().flatten();
        }
        self.status
    }

    // Sends `signal` to the process's group: to what it started too, even once it has exited
    // itself.
    fn signal(&mut self, #[allow(unused)] signal: i32) {
        #[cfg(unix)]
        {
            use nix::sys::signal::{Signal, killpg};
            use nix::unistd::Pid;
            if let Ok(signal) = Signal::try_from(signal) {
                let _ = killpg(Pid::from_raw(self.child.id() as i32), signal);
                return;
            }
        }
        if self.poll().is_none() {
            let _ = self.child.kill();
        }
    }

    // Kills the process's group now (what the process started, even once it has exited), and
    // the process if it still runs.
    fn kill(&mut self) {
        #[cfg(unix)]
        {
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(self.child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if self.poll().is_none() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }

    fn finish_output(&mut self) {
        // The copies end when the process's pipes close; a grandchild that kept them open
        // must not hold the launcher, so they get a moment, not forever.
        let deadline = Instant::now() + Duration::from_secs(2);
        for handle in self.output.drain(..) {
            while !handle.is_finished() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            if handle.is_finished() {
                let _ = handle.join();
            }
        }
    }
}

fn copy_lines(
    from: impl Read + Send + 'static,
    prefix: Arc<str>,
    to: fn() -> Box<dyn Write>,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(from);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => break,
                Ok(_) => {
                    if !line.ends_with(b"\n") {
                        line.push(b'\n');
                    }
                    let mut out = to();
                    let _ = out.write_all(prefix.as_bytes());
                    let _ = out.write_all(&line);
                    let _ = out.flush();
                }
            }
        }
    })
}

enum Outcome {
    AllSucceeded,
    Failed {
        rank: u32,
        status: ExitStatus,
    },
    Stopped(i32),
    /// Stopped for what happened elsewhere (an elastic run's other machines), in words.
    Interrupted(String),
}

// Waits for this machine's processes; `interrupt` says why to stop them for what happened
// elsewhere (always `None` in a run of fixed size).
fn supervise(
    children: &mut [Rank],
    grace: Duration,
    mut interrupt: impl FnMut() -> Option<String>,
) -> Outcome {
    loop {
        let signal = STOP_SIGNAL.load(Ordering::SeqCst);
        if signal != 0 {
            for child in children.iter_mut() {
                child.signal(signal);
            }
            stop(children, grace);
            return Outcome::Stopped(signal);
        }
        if let Some(why) = interrupt() {
            stop(children, grace);
            return Outcome::Interrupted(why);
        }
        let mut running = false;
        for child in children.iter_mut() {
            match child.poll() {
                None => running = true,
                Some(status) if !status.success() => {
                    let rank = child.rank;
                    stop(children, grace);
                    return Outcome::Failed { rank, status };
                }
                Some(_) => {}
            }
        }
        if !running {
            return Outcome::AllSucceeded;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

// Asks every running process to end (SIGTERM), and kills those still running after `grace`.
fn stop(children: &mut [Rank], grace: Duration) {
    #[cfg(unix)]
    const TERM: i32 = nix::sys::signal::Signal::SIGTERM as i32;
    #[cfg(not(unix))]
    const TERM: i32 = 15;
    for child in children.iter_mut() {
        child.signal(TERM);
    }
    let deadline = Instant::now() + grace;
    while children.iter_mut().any(|c| c.poll().is_none()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    for child in children.iter_mut() {
        child.kill();
    }
}

fn describe(status: ExitStatus) -> String {
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(signal) = status.signal() {
            let name = nix::sys::signal::Signal::try_from(signal)
                .map_or_else(|_| signal.to_string(), |s| s.as_str().to_string());
            return format!("was killed by signal {name}");
        }
    }
    match status.code() {
        Some(101) => "exited with status 101 (a Rust panic)".into(),
        Some(code) => format!("exited with status {code}"),
        None => format!("ended with {status}"),
    }
}

fn report_env() {
    println!(
        "burn-accelerate-launch {} ({} {})",
        env!("CARGO_PKG_VERSION"),
        std::env::consts::OS,
        std::env::consts::ARCH
    );
    println!(
        "cores: {}",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    if let Some(cpu) = cpu::this_machine() {
        println!("cpu: {cpu}");
    }
    match ProcessLayout::from_env() {
        Ok(layout) => println!(
            "process: {} of {} (local {} of {}, machine {} of {})",
            layout.process_index(),
            layout.num_processes(),
            layout.local_process_index(),
            layout.local_num_processes(),
            layout.machine_rank(),
            layout.num_machines()
        ),
        Err(err) => println!("process: the environment is not a valid launch: {err}"),
    }
    for name in env::ALL.into_iter().chain(env::RESTARTS) {
        if let Ok(value) = std::env::var(name) {
            let value = if name == env::SECRET {
                "(set, not shown)".into()
            } else {
                value
            };
            println!("  {name}={value}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_names_its_attempt_and_the_last_one_every_failure() {
        let attempt = Attempt { number: 1, of: 3 };
        assert_eq!(attempt.to_string(), "burn-accelerate launch [attempt 2/3]");
        let failures = [
            "process 1 was killed by signal SIGKILL".to_string(),
            "process 0 exited with status 7".to_string(),
        ];
        let said = budget_spent(1, &failures);
        assert!(
            said.contains("failed 2 times and --max-restarts 1 allows no more restarts")
                && said.contains(
                    "attempt 1: process 1 was killed by signal SIGKILL; attempt 2: process 0 \
                     exited with status 7"
                ),
            "{said}"
        );
    }

    #[test]
    fn several_processes_share_the_cores_unless_the_user_chose() {
        let nobody = |_: &str| None;
        assert_eq!(
            ThreadShare::of(1, 8, nobody),
            None,
            "one process keeps them all"
        );
        let share = ThreadShare::of(2, 2, nobody).unwrap();
        assert_eq!(
            (share.threads, share.set.as_slice()),
            (1, &THREAD_VARIABLES[..])
        );
        let said = share.message().unwrap();
        assert!(
            said.contains(
                "2 processes on this machine's 2 cores: each process gets \
                 RAYON_NUM_THREADS=1 and OMP_NUM_THREADS=1"
            ) && said.contains("set RAYON_NUM_THREADS / OMP_NUM_THREADS yourself"),
            "{said}"
        );
        // Each its share, and at least one thread.
        assert_eq!(ThreadShare::of(3, 16, nobody).unwrap().threads, 5);
        assert_eq!(ThreadShare::of(4, 2, nobody).unwrap().threads, 1);
        // The user's own value is kept and named; nothing said when nothing is set.
        let rayon = |var: &str| (var == "RAYON_NUM_THREADS").then(|| "3".to_string());
        let share = ThreadShare::of(2, 8, rayon).unwrap();
        assert_eq!(share.set, ["OMP_NUM_THREADS"]);
        let said = share.message().unwrap();
        assert!(
            said.contains("each process gets OMP_NUM_THREADS=4")
                && said.contains("RAYON_NUM_THREADS=\"3\" is yours and kept"),
            "{said}"
        );
        let both = |_: &str| Some("2".to_string());
        assert_eq!(ThreadShare::of(2, 8, both).unwrap().message(), None);
    }

    #[test]
    fn the_restart_budget_is_a_flag_with_torchruns_default() {
        let parse = |args: &[&str]| {
            Cli::try_parse_from(
                ["burn-accelerate", "launch"]
                    .iter()
                    .chain(args)
                    .chain(&["--", "x"]),
            )
            .map(|cli| match cli.task {
                Task::Launch(launch) => launch.max_restarts,
                _ => unreachable!("a launch"),
            })
        };
        assert_eq!(parse(&[]).unwrap(), 0);
        assert_eq!(parse(&["--max-restarts", "3"]).unwrap(), 3);
        assert!(parse(&["--max-restarts", "-1"]).is_err());
    }

    fn launch_of(args: &[&str]) -> Result<Launch, String> {
        Cli::try_parse_from(
            ["burn-accelerate", "launch"]
                .iter()
                .chain(args)
                .chain(&["--", "x"]),
        )
        .map(|cli| match cli.task {
            Task::Launch(launch) => launch,
            _ => unreachable!("a launch"),
        })
        .map_err(|e| e.to_string())
    }

    #[test]
    fn a_plain_machine_count_is_fixed_and_a_range_elastic() {
        let fixed = |n| Machines {
            min: n,
            max: n,
            elastic: false,
        };
        assert_eq!(launch_of(&[]).unwrap().num_machines, fixed(1));
        assert_eq!(
            launch_of(&["--num-machines", "2"]).unwrap().num_machines,
            fixed(2)
        );
        assert_eq!(
            launch_of(&["--num-machines", "1:3"]).unwrap().num_machines,
            Machines {
                min: 1,
                max: 3,
                elastic: true
            }
        );
        for (bad, said) in [
            ("0", "not a number of machines"),
            ("3:1", "MIN is more than MAX (write 1:3?)"),
            ("1:", "not a number of machines"),
            ("two", "not a number of machines"),
        ] {
            let err = launch_of(&["--num-machines", bad]).unwrap_err();
            assert!(err.contains(said), "{bad}: {err}");
        }
    }

    #[test]
    fn an_elastic_run_divides_its_processes_by_max_and_names_the_range() {
        let plan = |args: &[&str]| launch_of(args).unwrap().plan().map_err(|e| e.to_string());
        let elastic = plan(&[
            "--num-machines",
            "1:2",
            "--num-processes",
            "4",
            "--machine-rank",
            "1",
            "--main-process-ip",
            "10.0.0.1",
        ])
        .unwrap();
        assert_eq!(
            (elastic.local, elastic.first_rank, elastic.machine_rank),
            (2, 2, 1)
        );
        let err = plan(&["--num-machines", "1:2", "--num-processes", "3"]).unwrap_err();
        assert!(
            err.contains("is not a multiple of MAX of --num-machines 1:2"),
            "{err}"
        );
        let err = plan(&["--num-machines", "1:2", "--num-processes", "2"]).unwrap_err();
        assert!(
            err.contains("--main-process-ip is required with MAX of --num-machines 1:2"),
            "{err}"
        );
        // A plain count says what it said before.
        let err = plan(&["--num-machines", "2", "--num-processes", "3"]).unwrap_err();
        assert!(
            err.contains("is not a multiple of --num-machines 2: every machine"),
            "{err}"
        );
    }
}
