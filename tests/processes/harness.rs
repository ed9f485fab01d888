//! Runs a test's body in several real processes on localhost, started by the
//! `burn-accelerate launch` binary.
//!
//! The test binary starts the launcher on itself, with `--exact <test>`: in the child
//! processes [`worker`] returns the arguments the parent gave, the test function runs its
//! worker body and writes what it found with [`report`]; in the parent the same function reads
//! the reports and asserts. Launches run at once, as the test threads start them: the launcher
//! takes ports the system picks (`--main-process-port 0`), and the ports a test gives itself
//! come from [`free_port`], which hands each out once. Every launch has a deadline, so a hang
//! fails the test instead of the run.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde::de::DeserializeOwned;

/// Where a worker writes its report.
pub const WORKER_DIR: &str = "BURN_ACCELERATE_TEST_WORKER_DIR";
const WORKER_ARGS: &str = "BURN_ACCELERATE_TEST_WORKER_ARGS";

/// What a worker process runs of the test binary, after the test's name: that test alone,
/// whether or not it is `#[ignore]`d (an ignored test's parent runs only with `--ignored`).
pub const WORKER_FLAGS: [&str; 5] = [
    "--exact",
    "--include-ignored",
    "--nocapture",
    "--test-threads=1",
    "-q",
];

/// A launch must end within this, or the test fails (and the processes are killed).
pub const DEADLINE: Duration = Duration::from_secs(240);

/// In a worker process, the arguments its parent test gave; `None` in the test itself.
pub fn worker<T: DeserializeOwned>() -> Option<T> {
    let args = std::env::var(WORKER_ARGS).ok()?;
    Some(serde_json::from_str(&args).expect("the parent test's arguments"))
}

/// Writes this worker's findings for the parent test.
pub fn report<T: Serialize>(value: &T) {
    let dir = worker_dir();
    let rank = ["RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"]
        .iter()
        .find_map(|name| std::env::var(name).ok())
        .unwrap_or_else(|| "single".into());
    let path = dir.join(format!("rank-{rank}.json"));
    std::fs::write(&path, serde_json::to_vec(value).unwrap()).unwrap();
}

/// What a launch did.
pub struct Launched {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
    pub elapsed: Duration,
    dir: PathBuf,
}

impl Launched {
    /// Each rank's report, in rank order; fails the test (with the output) if one is missing.
    pub fn reports<T: DeserializeOwned>(&self, processes: usize) -> Vec<T> {
        (0..processes).map(|rank| self.report(rank)).collect()
    }

    /// Rank `rank`'s report; fails the test (with the output) if it is missing.
    pub fn report<T: DeserializeOwned>(&self, rank: usize) -> T {
        let path = self.dir.join(format!("rank-{rank}.json"));
        let bytes = std::fs::read(&path).unwrap_or_else(|_| {
            panic!(
                "rank {rank} wrote no report ({}):\n--- stdout\n{}\n--- stderr\n{}",
                self.status, self.stdout, self.stderr
            )
        });
        serde_json::from_slice(&bytes).unwrap()
    }

    /// The directory its processes reported to.
    #[allow(dead_code)] // The fault tests' (this file is shared).
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// What it printed, both streams.
    pub fn output(&self) -> String {
        format!("--- stdout\n{}\n--- stderr\n{}", self.stdout, self.stderr)
    }

    /// Fails the test with the output unless every process succeeded.
    pub fn assert_success(&self) -> &Self {
        assert!(
            self.status.success(),
            "launch failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            self.status,
            self.stdout,
            self.stderr
        );
        self
    }
}

/// A port nothing listens on now, for a rendezvous a test places itself (a launcher started
/// without port 0, a process started without a launcher), with the [`PORT_BLOCK`] - 1 ports
/// after it, which a launcher given it takes for its processes. Each block is handed out once
/// in this test binary (an atomic cursor: tests at once never get the same, without a lock),
/// from a place that differs between processes, and skipped while anything holds one of its
/// ports. Below the ephemeral range (from 32768 on Linux), which the launches on port 0 and
/// outgoing connections take: a port free now there may be a connection's a moment later.
pub fn free_port() -> u16 {
    const FIRST: u32 = 20_000;
    const BLOCKS: u32 = 12_000 / PORT_BLOCK as u32;
    static HANDED_OUT: AtomicU32 = AtomicU32::new(0);
    let start = std::process::id().wrapping_mul(7_919) % BLOCKS;
    let free = |p: u16| std::net::TcpListener::bind(("0.0.0.0", p)).is_ok();
    loop {
        let block = (start + HANDED_OUT.fetch_add(1, Ordering::Relaxed)) % BLOCKS;
        let port = (FIRST + block * PORT_BLOCK as u32) as u16;
        if (port..port + PORT_BLOCK).all(free) {
            return port;
        }
    }
}

/// How many ports [`free_port`] hands out at once: the rendezvous's and its launcher's
/// processes' (at most 31 on one host).
pub const PORT_BLOCK: u16 = 32;

/// The launcher binary.
pub fn launcher() -> Command {
    Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
}

/// Runs test `test`'s worker body in `processes` processes under the launcher (with
/// `launch_args` before `--`), giving each `args`.
pub fn launch<T: Serialize>(
    test: &str,
    processes: usize,
    args: &T,
    launch_args: &[&str],
) -> Launched {
    let (command, dir) = launch_command(test, processes, args, launch_args);
    run(command, dir)
}

/// Whether the multi-process tests run under `mpirun` on the MPI engine
/// (`BURN_ACCELERATE_TEST_ENGINE=mpi`, in a build with the `mpi` feature) rather than under
/// `burn-accelerate launch` on the built-in one. The tests of the launcher and of the built-in
/// engine fail under it, saying so (`tests/needs/mod.rs`): the MPI tier `--skip`s them.
pub fn under_mpi() -> bool {
    std::env::var("BURN_ACCELERATE_TEST_ENGINE").is_ok_and(|e| e == "mpi")
}

/// The launcher's command for [`launch`] (`mpirun`'s [`under_mpi`]), and the directory the
/// reports go to.
pub fn launch_command<T: Serialize>(
    test: &str,
    processes: usize,
    args: &T,
    launch_args: &[&str],
) -> (Command, PathBuf) {
    let dir = scratch_dir(test);
    let args = serde_json::to_string(args).unwrap();
    if under_mpi() {
        // The same worker bodies under mpirun: the launcher's own flags do not apply.
        let mut command = Command::new("mpirun");
        command
            // Launches run at once, and Open MPI 4.1's mpiruns race creating (and removing)
            // their shared session directory `/tmp/ompi.<host>.<uid>` ("File exists" in
            // `orte_session_dir`): each gets a base of its own, short enough for the Unix
            // sockets Open MPI makes in it. `run` removes it.
            .env(OMPI_TMPDIR, mpi_session_base())
            .args(["--allow-run-as-root", "--oversubscribe", "--np"])
            .arg(processes.to_string())
            .args([
                "-x",
                WORKER_DIR,
                "-x",
                WORKER_ARGS,
                "-x",
                "RAYON_NUM_THREADS=1",
            ])
            .arg(std::env::current_exe().unwrap())
            .arg(test)
            .args(WORKER_FLAGS)
            .env(WORKER_DIR, &dir)
            .env(WORKER_ARGS, args);
        return (command, dir);
    }
    let mut command = launcher();
    command
        .arg("launch")
        .arg("--num-processes")
        .arg(processes.to_string());
    if !launch_args.contains(&"--main-process-port") {
        // Ports the system picks: the tests' launches at once never take the same.
        command.args(["--main-process-port", "0"]);
    }
    command
        .args(launch_args)
        .arg("--")
        .arg(std::env::current_exe().unwrap())
        .arg(test)
        .args(WORKER_FLAGS)
        .env(WORKER_DIR, &dir)
        .env(WORKER_ARGS, args);
    (command, dir)
}

/// Runs test `test`'s worker body in `processes` processes started directly, without the
/// launcher (which would stop the others itself when one fails): process 0 hosts the
/// rendezvous, every process gets a run secret and `vars` too. Returns each process's run, in rank order; the
/// reports are in any of them ([`Launched::reports`]).
pub fn launch_direct<T: Serialize>(
    test: &str,
    processes: usize,
    args: &T,
    vars: &[(&str, &str)],
) -> Vec<Launched> {
    let port = free_port().to_string();
    let dir = scratch_dir(test);
    let args = serde_json::to_string(args).unwrap();
    let runs: Vec<_> = (0..processes)
        .map(|rank| {
            let mut command = Command::new(std::env::current_exe().unwrap());
            command
                .arg(test)
                .args(WORKER_FLAGS)
                .env(WORKER_DIR, &dir)
                .env(WORKER_ARGS, &args)
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", processes.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", &port)
                // A port the system picks, told to the others at the rendezvous.
                .env("BURN_ACCELERATE_DATA_PORT", "0")
                .env("BURN_ACCELERATE_SECRET", "a test's secret")
                .envs(vars.iter().copied());
            let dir = dir.clone();
            std::thread::spawn(move || run(command, dir))
        })
        .collect();
    runs.into_iter().map(|r| r.join().unwrap()).collect()
}

/// The directory this worker reports to.
pub fn worker_dir() -> PathBuf {
    PathBuf::from(std::env::var(WORKER_DIR).expect("run by the harness"))
}

/// A fresh directory for one launch's reports (and anything else it writes).
pub fn scratch_dir(test: &str) -> PathBuf {
    static LAUNCHES: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "burn-accelerate-processes-{}-{test}-{}",
        std::process::id(),
        LAUNCHES.fetch_add(1, Ordering::SeqCst)
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Process `rank` of a 2-process run of this test binary's `test` started without a launcher,
/// as a scheduler would start it: torchrun's variables with the rendezvous on `main`, the data
/// port `data + rank`, the run's `secret`; reporting to `dir`.
#[allow(dead_code)] // The fault tests' (this file is shared).
pub fn rank_of_two(
    test: &str,
    dir: &Path,
    rank: usize,
    [main, data]: [u16; 2],
    secret: &str,
) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command
        .arg(test)
        .args(WORKER_FLAGS)
        .env(WORKER_DIR, dir)
        .env("BURN_ACCELERATE_TEST_WORKER_ARGS", "null")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", main.to_string())
        .env(
            "BURN_ACCELERATE_DATA_PORT",
            (usize::from(data) + rank).to_string(),
        )
        .env("BURN_ACCELERATE_SECRET", secret);
    command
}

/// Runs `command` to its end (or the deadline), capturing its output.
pub fn run(command: Command, dir: PathBuf) -> Launched {
    let session_base = command
        .get_envs()
        .find(|(key, _)| *key == OMPI_TMPDIR)
        .and_then(|(_, value)| value.map(PathBuf::from));
    let launched = run_to_end(command, dir);
    if let Some(base) = session_base {
        let _ = std::fs::remove_dir_all(base);
    }
    launched
}

/// Open MPI's variable for the directory its session directories go in (`orte_tmpdir_base`).
const OMPI_TMPDIR: &str = "OMPI_MCA_orte_tmpdir_base";

/// A new directory for one `mpirun`'s session directories: `/tmp/ompi-<pid>-<n>`.
fn mpi_session_base() -> PathBuf {
    static BASES: AtomicUsize = AtomicUsize::new(0);
    let base = std::env::temp_dir().join(format!(
        "ompi-{}-{}",
        std::process::id(),
        BASES.fetch_add(1, Ordering::SeqCst)
    ));
    std::fs::create_dir_all(&base).unwrap();
    base
}

fn run_to_end(mut command: Command, dir: PathBuf) -> Launched {
    let start = Instant::now();
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the launcher starts");
    let capture = |mut pipe: Box<dyn Read + Send>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            let _ = pipe.read_to_string(&mut text);
            text
        })
    };
    let stdout = capture(Box::new(child.stdout.take().unwrap()));
    let stderr = capture(Box::new(child.stderr.take().unwrap()));
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!(
                "the launch did not end within {DEADLINE:?} (killed):\n{}",
                stderr.join().unwrap()
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    Launched {
        status,
        elapsed: start.elapsed(),
        stdout: stdout.join().unwrap(),
        stderr: stderr.join().unwrap(),
        dir,
    }
}

/// The largest difference between `a` and `b`, relative to the largest magnitude in `b`.
pub fn max_relative_difference(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .fold(0f32, |m, x| m.max(x.abs()))
        .max(f32::MIN_POSITIVE);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Removes the launch's directory (reports included).
pub fn clean(dir: &Path) {
    let _ = std::fs::remove_dir_all(dir);
}
