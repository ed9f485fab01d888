//! What ends a run, and what must not: a frozen process (`SIGSTOP`), long work between
//! collectives, a panic inside `main_process_first`, and how many sockets 16 processes hold;
//! and what a run survives: a killed process, restarted from the last checkpoint
//! ([`restarts`]), and a lost machine, the run going on without it ([`elastic`]).
//! Real processes of this machine (see `../processes/harness.rs`).
#![cfg(feature = "flex")]

// Shared with the processes suite, which uses all of it.
#[allow(dead_code)]
#[path = "../processes/harness.rs"]
mod harness;
#[path = "../../examples/common/mlp.rs"]
mod mlp;
#[path = "../needs/mod.rs"]
mod needs;
// `burn-accelerate launch --num-machines MIN:MAX`: a run that goes on with the machines left.
mod elastic;
// `burn-accelerate launch --max-restarts`: restarts that resume from the last checkpoint.
mod restarts;
// 1,000 silent connections per port during a run of 2 processes.
mod flood;
// A dispatched batch the receiver cannot decode: a typed error, not a panic.
mod undecodable;
// Process 0 killed while it dispatches batches: a typed error on the receiver, not a panic.
mod reader_killed;
// Process 0 lost while it dispatches batches, behind a cut link or frozen: the same, by the
// liveness timeout.
mod reader_lost;

use std::time::{Duration, Instant};

use burn_accelerate::distributed::{ProcessState, ReduceOp};
use harness::{launch, launch_direct, report, worker};
use serde::{Deserialize, Serialize};

/// A worker's error (empty: none) and how long its call took.
#[derive(Debug, Serialize, Deserialize)]
struct Seen {
    error: String,
    seconds: f64,
}

// ---------------------------------------------------------------------------------------
// A frozen process.

fn frozen_worker() {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    group.barrier().unwrap();
    if group.rank() == 1 {
        // Frozen as `kill -STOP` freezes it: its network thread stops too.
        nix::sys::signal::raise(nix::sys::signal::Signal::SIGSTOP).unwrap();
    }
    let start = Instant::now();
    let outcome = group.all_reduce(&mut [1.0f32; 1000], ReduceOp::Sum);
    report(&Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    });
    // As a training script would: the error ends the process, and the launcher the run.
    std::process::exit(1);
}

#[test]
fn a_frozen_process_ends_the_run_within_the_liveness_timeout() {
    const TEST: &str = "a_frozen_process_ends_the_run_within_the_liveness_timeout";
    if worker::<()>().is_some() {
        return frozen_worker();
    }
    // The collective timeout is far away: only the liveness check can end this run soon.
    let args = [
        "--timeout",
        "600",
        "--liveness-timeout",
        "2",
        "--grace",
        "2",
    ];
    let run = launch(TEST, 3, &(), &args);
    assert!(!run.status.success(), "{}", run.output());
    assert!(run.elapsed < Duration::from_secs(20), "{:?}", run.elapsed);
    for rank in [0, 2] {
        let seen: Seen = run.report(rank);
        // Each of its neighbours finds it silent itself, or hears it from the other.
        assert!(
            seen.error.contains("process 1 at 127.0.0.1:")
                && seen.error.contains("has sent nothing for 2s"),
            "rank {rank}: {}",
            seen.error
        );
        assert!(seen.seconds < 10.0, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// Long work between collectives.

fn busy_worker() -> Seen {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    group.barrier().unwrap();
    let start = Instant::now();
    if group.rank() == 0 {
        // A validation on the main process alone, three times the liveness timeout, on both
        // cores' worth of busy threads.
        let spin = || {
            let until = Instant::now() + Duration::from_secs(6);
            let mut x = 0u64;
            while Instant::now() < until {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            }
            x
        };
        let other = std::thread::spawn(spin);
        std::hint::black_box(spin());
        std::hint::black_box(other.join().unwrap());
    }
    let outcome = group.all_reduce(&mut [1.0f32; 10], ReduceOp::Sum);
    Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[test]
fn long_work_between_collectives_does_not_trip_the_liveness_check() {
    const TEST: &str = "long_work_between_collectives_does_not_trip_the_liveness_check";
    if worker::<()>().is_some() {
        return report(&busy_worker());
    }
    let run = launch(TEST, 2, &(), &["--liveness-timeout", "2"]);
    let seen: Vec<Seen> = run.assert_success().reports(2);
    for (rank, seen) in seen.iter().enumerate() {
        assert!(seen.error.is_empty(), "rank {rank}: {}", seen.error);
        // Rank 1 waited in the all-reduce all along (its barrier may end a moment later).
        assert!(seen.seconds >= 5.5, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// A panic inside main_process_first.

fn first_worker() -> Seen {
    let state = ProcessState::from_env().unwrap();
    state.wait_for_everyone().unwrap();
    let start = Instant::now();
    let outcome = state.main_process_first().map(|guard| {
        if state.is_main_process() {
            panic!("preparing the dataset failed");
        }
        drop(guard);
    });
    Seen {
        error: outcome.err().map(|e| e.to_string()).unwrap_or_default(),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[test]
fn a_panic_inside_main_process_first_fails_the_waiting_processes() {
    const TEST: &str = "a_panic_inside_main_process_first_fails_the_waiting_processes";
    if worker::<()>().is_some() {
        return report(&first_worker());
    }
    let runs = launch_direct(TEST, 3, &(), &[("BURN_ACCELERATE_TIMEOUT", "600")]);
    assert_eq!(runs[0].status.code(), Some(101), "{}", runs[0].output());
    for rank in [1, 2] {
        let seen: Seen = runs[0].report(rank);
        assert!(
            seen.error.contains("process 0 ended the run's collectives")
                && seen.error.contains("panicked inside main_process_first"),
            "rank {rank}: {}",
            seen.error
        );
        assert!(seen.seconds < 10.0, "rank {rank}: {}", seen.seconds);
    }
}

// ---------------------------------------------------------------------------------------
// Sockets per process.

/// The TCP sockets this process holds (Linux): its descriptors that are sockets listed in
/// `/proc/self/net/tcp{,6}` (the runtime's own signal socket pair is a Unix one).
fn sockets() -> usize {
    let tables = ["tcp", "tcp6"]
        .map(|t| std::fs::read_to_string(format!("/proc/self/net/{t}")).unwrap_or_default());
    let tcp_inodes: std::collections::HashSet<String> = tables
        .iter()
        .flat_map(|table| table.lines().skip(1))
        .filter_map(|line| line.split_whitespace().nth(9).map(str::to_string))
        .collect();
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .filter_map(|target| {
            let target = target.to_string_lossy().into_owned();
            Some(
                target
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .to_string(),
            )
        })
        .filter(|inode| tcp_inodes.contains(inode))
        .count()
}

/// The addresses listening on `port` in this network namespace (Linux), as `a.b.c.d`.
fn listening_on(port: u16) -> Vec<String> {
    let table = std::fs::read_to_string("/proc/self/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (address, state) = (fields.get(1)?, fields.get(3)?);
            let (ip, p) = address.split_once(':')?;
            if *state != "0A" || u16::from_str_radix(p, 16).ok()? != port {
                return None;
            }
            // Little-endian hex, as the kernel prints it.
            let ip = u32::from_str_radix(ip, 16).ok()?.to_le_bytes();
            Some(format!("{}.{}.{}.{}", ip[0], ip[1], ip[2], ip[3]))
        })
        .collect()
}

fn sockets_worker() -> (usize, usize) {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    let mut values = vec![1.0f32; 1 << 16];
    group.all_reduce(&mut values, ReduceOp::Sum).unwrap();
    group.barrier().unwrap();
    let gathered: Vec<u32> = group.all_gather(&[group.rank() as u32]).unwrap();
    assert_eq!(gathered, (0..16).collect::<Vec<u32>>());
    let _ = group.broadcast_object(&0u8, 5).unwrap();
    let count = sockets();
    // A run of one machine listens on loopback only: the launcher's rendezvous and this
    // process's own port.
    for variable in ["MASTER_PORT", "BURN_ACCELERATE_DATA_PORT"] {
        let port: u16 = std::env::var(variable).unwrap().parse().unwrap();
        assert_eq!(listening_on(port), ["127.0.0.1"], "{variable}={port}");
    }
    // No process ends (and closes its connections) before every one has counted.
    group.barrier().unwrap();
    (group.rank(), count)
}

#[test]
fn sixteen_processes_hold_five_sockets_each_on_loopback() {
    const TEST: &str = "sixteen_processes_hold_five_sockets_each_on_loopback";
    if worker::<()>().is_some() {
        return report(&sockets_worker());
    }
    // Ports given (the rendezvous's and the ones after it, each process's), so that each
    // process knows the port it listens on.
    let port = harness::free_port().to_string();
    let counts: Vec<(usize, usize)> = launch(TEST, 16, &(), &["--main-process-port", &port])
        .assert_success()
        .reports(16);
    for (rank, count) in counts {
        // Its listener, its ring connections (data to the next process and from the previous
        // one) and its control connections with both: whatever the number of processes.
        assert_eq!(count, 5, "rank {rank}");
    }
}

// ---------------------------------------------------------------------------------------
// Strangers.

const SECRET: &str = "the test run's secret";

fn steady_worker() -> Vec<f32> {
    let state = ProcessState::from_env().unwrap();
    if state.process_index() == 1 {
        // The strangers come while process 0 waits at the rendezvous for this one.
        std::thread::sleep(Duration::from_secs(3));
    }
    let group = state.group().unwrap();
    let mut sums = Vec::new();
    for step in 0..20 {
        let mut values = vec![(group.rank() + step) as f32; 1000];
        group.all_reduce(&mut values, ReduceOp::Sum).unwrap();
        sums.push(values[999]);
        std::thread::sleep(Duration::from_millis(20));
    }
    sums
}

/// What a stranger got before the connection closed: every byte, then whether it closed (and
/// did not merely time out).
fn stranger(port: u16, send: impl FnOnce(&[u8]) -> Vec<u8>) -> (Vec<u8>, bool) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut challenge = [0u8; 36];
    stream.read_exact(&mut challenge).unwrap();
    let _ = stream.write_all(&send(&challenge));
    let mut rest = Vec::new();
    let closed = match stream.read_to_end(&mut rest) {
        Ok(_) => true,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    };
    (rest, closed)
}

/// A hello as a process of the run would send it, with its tag made from `key`.
fn hello(challenge: &[u8], key: &[u8], rank: u32, lane: u32) -> Vec<u8> {
    use hmac::{Hmac, Mac};
    let mut fields = b"BAC2".to_vec();
    fields.extend_from_slice(&1u32.to_ne_bytes());
    fields.extend_from_slice(&rank.to_ne_bytes());
    fields.extend_from_slice(&lane.to_ne_bytes());
    fields.extend_from_slice(&0u64.to_ne_bytes());
    let nonce = [9u8; 32];
    let mut mac = Hmac::<sha2::Sha256>::new_from_slice(key).unwrap();
    for part in [&b"client"[..], &challenge[4..], &nonce, &fields] {
        mac.update(part);
    }
    let mut out = fields;
    out.extend_from_slice(&nonce);
    out.extend_from_slice(&mac.finalize().into_bytes());
    out
}

#[test]
fn strangers_are_refused_and_the_run_carries_on() {
    const TEST: &str = "strangers_are_refused_and_the_run_carries_on";
    if worker::<()>().is_some() {
        return report(&steady_worker());
    }
    let (main, data) = (harness::free_port(), harness::free_port());
    let dir = harness::scratch_dir(TEST);
    let processes: Vec<_> = (0..2)
        .map(|rank| {
            let command = harness::rank_of_two(TEST, &dir, rank, [main, data], SECRET);
            let dir = dir.clone();
            std::thread::spawn(move || harness::run(command, dir))
        })
        .collect();
    // Process 0 hosts the rendezvous and listens for its peers; process 1 is 3 s away.
    let start = std::time::Instant::now();
    while std::net::TcpStream::connect(("127.0.0.1", data)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "process 0 never listened"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Half-open connections: they say nothing at all, and hold nothing up.
    let idle: Vec<_> = [main, data]
        .iter()
        .map(|port| std::net::TcpStream::connect(("127.0.0.1", *port)).unwrap())
        .collect();
    let recorded = {
        // A real hello, to the rendezvous's challenge on another connection.
        let mut stream = std::net::TcpStream::connect(("127.0.0.1", main)).unwrap();
        let mut challenge = [0u8; 36];
        std::io::Read::read_exact(&mut stream, &mut challenge).unwrap();
        hello(&challenge, SECRET.as_bytes(), 1, u32::MAX - 1)
    };
    for port in [main, data] {
        type Send<'a> = Box<dyn FnOnce(&[u8]) -> Vec<u8> + 'a>;
        let cases: [(&str, Send); 4] = [
            ("junk", Box::new(|_| vec![0x47; 200])),
            ("no secret", Box::new(|c| hello(c, b"", 1, 0))),
            ("a wrong secret", Box::new(|c| hello(c, b"a guess", 1, 0))),
            ("a replayed hello", Box::new(|_| recorded.clone())),
        ];
        for (what, send) in cases {
            let (got, closed) = stranger(port, send);
            // The connection closed at once, without the proof a process of the run gets.
            assert!(closed && got.is_empty(), "{what} on port {port}: {got:?}");
        }
    }
    // Both processes still started the run of 2 they were launched as, and finished it.
    let runs: Vec<_> = processes.into_iter().map(|p| p.join().unwrap()).collect();
    for run in &runs {
        assert!(run.status.success(), "{}", run.output());
    }
    let sums: Vec<Vec<f32>> = runs[0].reports(2);
    let expected: Vec<f32> = (0..20).map(|step| (2 * step + 1) as f32).collect();
    assert_eq!(sums, [expected.clone(), expected]);
    drop(idle);
    harness::clean(&dir);
}

// ---------------------------------------------------------------------------------------
// torchrun.

/// What the demo training ended with.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Trained {
    loss: f64,
    accuracy: f64,
}

fn demo_worker() -> Trained {
    type Train = burn_accelerate::Accelerated<burn::backend::Autodiff<burn::backend::Flex>>;
    let config = mlp::DemoConfig::new()
        .with_epochs(1)
        .with_train_items(512)
        .with_valid_items(128)
        .with_batch_size(32);
    let outcome = mlp::run::<Train>(&config, &Default::default()).unwrap();
    Trained {
        loss: outcome.loss as f64,
        accuracy: outcome.accuracy as f64,
    }
}

/// torchrun from the LibTorch tier's virtual environment (or `TORCHRUN`), if there is one.
fn torchrun() -> Option<std::path::PathBuf> {
    if let Some(path) = std::env::var_os("TORCHRUN") {
        return Some(path.into());
    }
    let venv = std::env::var_os("TORCH_VENV")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            let home = std::env::var_os("HOME")?;
            Some(std::path::Path::new(&home).join(".cache/burn-accelerate/torch-venv"))
        })?;
    let torchrun = venv.join("bin/torchrun");
    torchrun.exists().then_some(torchrun)
}

#[test]
#[ignore = "needs torchrun (the LibTorch tier's venv, or TORCHRUN): .ci/run runs it with --ignored"]
fn torchrun_starts_the_program_as_the_launcher_does() {
    const TEST: &str = "torchrun_starts_the_program_as_the_launcher_does";
    if worker::<()>().is_some() {
        return report(&demo_worker());
    }
    let Some(torchrun) = torchrun() else {
        needs::missing(
            "torchrun (the LibTorch tier's venv, scripts/tch-env.sh, provides it; or set TORCHRUN)",
        );
    };
    let launched: Vec<Trained> = launch(TEST, 2, &(), &[]).assert_success().reports(2);
    let dir = harness::scratch_dir(TEST);
    let mut command = std::process::Command::new(torchrun);
    command
        .args(["--standalone", "--nproc-per-node", "2", "--no-python"])
        .arg(std::env::current_exe().unwrap())
        .arg(TEST)
        .args(harness::WORKER_FLAGS)
        .env(harness::WORKER_DIR, &dir)
        .env("BURN_ACCELERATE_TEST_WORKER_ARGS", "null")
        // As the launcher gives each of two processes on two cores.
        .env("RAYON_NUM_THREADS", "1");
    let run = harness::run(command, dir.clone());
    assert!(run.status.success(), "{}", run.output());
    let torchran: Vec<Trained> = run.reports(2);
    assert_eq!(torchran, launched);
    harness::clean(&dir);
}

// ---------------------------------------------------------------------------------------
// A cut link between two machines.

/// Two network namespaces joined by a veth pair: two "machines" on one host, on a private link
/// of their own. Removed when dropped.
struct TwoMachines {
    names: [String; 2],
    addresses: [&'static str; 2],
    link: String,
}

impl TwoMachines {
    /// Why not, where namespaces cannot be made: not root, no `ip`.
    fn make() -> Result<Self, String> {
        // Several tests of this binary make theirs at once: each pair has names of its own.
        static MADE: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let made = MADE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let id = format!("{}-{made}", std::process::id());
        let machines = Self {
            names: [format!("bac-{id}-0"), format!("bac-{id}-1")],
            addresses: ["10.213.7.1", "10.213.7.2"],
            // Interface names are at most 15 bytes, with the `a`/`b` added.
            link: format!("bac{}x{made}", std::process::id() % 100_000),
        };
        let (a, b) = (&machines.names[0], &machines.names[1]);
        let (va, vb) = (format!("{}a", machines.link), format!("{}b", machines.link));
        let steps: Vec<Vec<&str>> = vec![
            vec!["netns", "add", a],
            vec!["netns", "add", b],
            vec!["link", "add", &va, "type", "veth", "peer", "name", &vb],
            vec!["link", "set", &va, "netns", a],
            vec!["link", "set", &vb, "netns", b],
            vec!["-n", a, "addr", "add", "10.213.7.1/24", "dev", &va],
            vec!["-n", b, "addr", "add", "10.213.7.2/24", "dev", &vb],
            vec!["-n", a, "link", "set", &va, "up"],
            vec!["-n", b, "link", "set", &vb, "up"],
            vec!["-n", a, "link", "set", "lo", "up"],
            vec!["-n", b, "link", "set", "lo", "up"],
        ];
        for step in steps {
            let out = std::process::Command::new("ip")
                .args(&step)
                .output()
                .map_err(|e| format!("`ip` cannot run ({e}): install iproute2"))?;
            if !out.status.success() {
                return Err(format!(
                    "`ip {}` failed: {}",
                    step.join(" "),
                    String::from_utf8_lossy(&out.stderr).trim()
                ));
            }
        }
        Ok(machines)
    }

    /// Cuts the link between them, as a pulled cable does: the link goes down, and each
    /// machine keeps its address, so that its own processes still reach each other.
    fn cut(&self) {
        let link = format!("{}a", self.link);
        let status = std::process::Command::new("ip")
            .args(["-n", &self.names[0], "link", "set", &link, "down"])
            .status()
            .unwrap();
        assert!(status.success());
    }
}

impl Drop for TwoMachines {
    fn drop(&mut self) {
        for name in &self.names {
            let _ = std::process::Command::new("ip")
                .args(["netns", "del", name])
                .status();
        }
    }
}

fn partitioned_worker() {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    let dir = harness::worker_dir();
    let start = Instant::now();
    for step in 0.. {
        let mut values = vec![1.0f32; 10_000];
        if let Err(err) = group.all_reduce(&mut values, ReduceOp::Sum) {
            report(&Seen {
                error: err.to_string(),
                seconds: start.elapsed().as_secs_f64(),
            });
            std::process::exit(1);
        }
        if step == 10 {
            let rank = state.process_index();
            std::fs::write(dir.join(format!("running-{rank}")), b"").unwrap();
        }
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the link was never cut"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
#[ignore = "needs root and iproute2's `ip` to make network namespaces: .ci/run runs it with --ignored"]
fn a_cut_link_ends_the_run_on_both_machines() {
    const TEST: &str = "a_cut_link_ends_the_run_on_both_machines";
    if worker::<()>().is_some() {
        return partitioned_worker();
    }
    let machines = TwoMachines::make().unwrap_or_else(|why| {
        needs::missing(&format!(
            "two network namespaces (root and iproute2's `ip`), which cannot be made: {why}"
        ))
    });
    let dir = harness::scratch_dir(TEST);
    let secret = dir.join("run.secret");
    std::fs::write(&secret, "the partition test's secret").unwrap();
    let port = harness::free_port().to_string();
    let launchers: Vec<_> = (0..2)
        .map(|machine| {
            let mut command = std::process::Command::new("ip");
            command
                .args(["netns", "exec", &machines.names[machine]])
                .arg(env!("CARGO_BIN_EXE_burn-accelerate"))
                .args(["launch", "--num-machines", "2", "--num-processes", "4"])
                .args(["--machine-rank", &machine.to_string()])
                .args(["--main-process-ip", machines.addresses[0]])
                .args(["--main-process-port", &port])
                .arg("--secret-file")
                .arg(&secret)
                .args([
                    "--liveness-timeout",
                    "3",
                    "--grace",
                    "2",
                    "--timeout",
                    "600",
                ])
                .arg("--")
                .arg(std::env::current_exe().unwrap())
                .arg(TEST)
                .args(harness::WORKER_FLAGS)
                .env(harness::WORKER_DIR, &dir)
                .env("BURN_ACCELERATE_TEST_WORKER_ARGS", "null");
            let dir = dir.clone();
            std::thread::spawn(move || harness::run(command, dir))
        })
        .collect();
    // Every process trains across the link...
    let start = Instant::now();
    while !(0..4).all(|rank| dir.join(format!("running-{rank}")).exists()) {
        assert!(
            start.elapsed() < Duration::from_secs(60) && !launchers.iter().any(|l| l.is_finished()),
            "the run never got going"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // ...until the link is cut.
    machines.cut();
    let cut = Instant::now();
    let runs: Vec<_> = launchers.into_iter().map(|l| l.join().unwrap()).collect();
    let ended = cut.elapsed();

    for (machine, run) in runs.iter().enumerate() {
        assert!(!run.status.success(), "machine {machine}: {}", run.output());
    }
    // The liveness timeout (3 s) and the launchers' grace (2 s), with room for a busy machine.
    assert!(ended < Duration::from_secs(15), "{ended:?}");
    // On each machine, the first process to fail found one across the link silent (or heard
    // it from a neighbour); the launcher may stop the other before it reports.
    for (machine, ranks) in [[0, 1], [2, 3]].iter().enumerate() {
        let across = format!("at {}:", machines.addresses[1 - machine]);
        let said: Vec<String> = ranks
            .iter()
            .filter_map(|rank| std::fs::read(dir.join(format!("rank-{rank}.json"))).ok())
            .map(|bytes| serde_json::from_slice::<Seen>(&bytes).unwrap().error)
            .collect();
        assert!(
            !said.is_empty()
                && said
                    .iter()
                    .all(|e| e.contains(&across) && e.contains("has sent nothing for 3s")),
            "machine {machine}: {said:#?}"
        );
    }
    harness::clean(&dir);
}

// ---------------------------------------------------------------------------------------
// What a process starts stops with it.

fn grandparent_worker() {
    let state = ProcessState::from_env().unwrap();
    let group = state.group().unwrap();
    // A helper of its own, as a data-loading script or a shell would start.
    // Never waited for: the launcher's signal to this process's group is what must end it.
    #[allow(clippy::zombie_processes)]
    let helper = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let rank = group.rank();
    let path = harness::worker_dir().join(format!("helper-{rank}"));
    std::fs::write(path, helper.id().to_string()).unwrap();
    group.barrier().unwrap();
    if rank == 1 {
        std::process::exit(1);
    }
    std::thread::sleep(Duration::from_secs(600));
}

#[test]
fn stopping_a_run_stops_what_its_processes_started() {
    const TEST: &str = "stopping_a_run_stops_what_its_processes_started";
    if worker::<()>().is_some() {
        return grandparent_worker();
    }
    let run = launch(TEST, 2, &(), &["--grace", "1"]);
    assert!(!run.status.success());
    let dir = run.dir();
    for rank in 0..2 {
        let pid: u32 = std::fs::read_to_string(dir.join(format!("helper-{rank}")))
            .unwrap()
            .parse()
            .unwrap();
        // Signalled with its process's group: gone, or a zombie its dead parent left.
        let start = Instant::now();
        loop {
            let state = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok();
            let gone =
                state.is_none_or(|s| s.rsplit_once(") ").is_some_and(|(_, r)| r.starts_with('Z')));
            if gone {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "rank {rank}'s helper {pid} lives on"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}
