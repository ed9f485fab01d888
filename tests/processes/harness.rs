//! Runs a test's body in several real processes on localhost, started by the
//! `burn-accelerate launch` binary.
//!
//! The test binary starts the launcher on itself, with `--exact <test>`: in the child
//! processes [`worker`] returns the arguments the parent gave, the test function runs its
//! worker body and writes what it found with [`report`]; in the parent the same function reads
//! the reports and asserts. One launch at a time (a lock), and every launch has a deadline, so a
//! hang fails the test instead of the run.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
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

static ONE_LAUNCH: Mutex<()> = Mutex::new(());

/// Holds the other tests' launches off (they pick free ports, and two runs at once could pick
/// the same one); [`launch`] takes it itself.
pub fn exclusive() -> std::sync::MutexGuard<'static, ()> {
    ONE_LAUNCH.lock().unwrap_or_else(|e| e.into_inner())
}

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

/// A port nothing listens on now, drawn at random below the ephemeral range (from 32768 on
/// Linux): an ephemeral port free now may be an outgoing connection's a moment later, and the
/// launcher takes the ports after the main one for its processes.
pub fn free_port() -> u16 {
    use std::hash::{BuildHasher, RandomState};
    loop {
        let port = 20_000 + (RandomState::new().hash_one(0u8) % 12_000) as u16;
        let free = |p: u16| std::net::TcpListener::bind(("0.0.0.0", p)).is_ok();
        if (port..port + 8).all(free) {
            return port;
        }
    }
}

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
    let _one = exclusive();
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
        command
            .arg("--main-process-port")
            .arg(free_port().to_string());
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
    let _one = exclusive();
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
                .env("BURN_ACCELERATE_DATA_PORT", free_port().to_string())
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
pub fn run(mut command: Command, dir: PathBuf) -> Launched {
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
