//! Slurm for real: the `train_mlp` example under a running Slurm's `srun`, `salloc` and
//! `sbatch` (a one-node cluster: `scripts/slurm-up.sh`), built with the built-in engine and with
//! `--features mpi`: both reach one process's loss, a step smaller than its job, a program
//! started directly in an allocation, the README's batch scripts end to end, and a task killed
//! mid-run.
//!
//! Every test needs the cluster and the two builds of the example (`TRAIN_MLP_TCP`: built
//! without features, `TRAIN_MLP_MPI`: with `--features mpi`): each is `#[ignore]`d, and `.ci/run`'s
//! Slurm tier runs them with `--ignored` (`tests/needs/mod.rs`).

// Shared with the processes suite, which uses all of it.
#[allow(dead_code)]
#[path = "../processes/harness.rs"]
mod harness;
#[path = "../needs/mod.rs"]
mod needs;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use harness::Launched;

/// Which build of `train_mlp` a test runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Build {
    /// Without features: the built-in (TCP) engine only.
    Tcp,
    /// With `--features mpi`.
    Mpi,
}

impl Build {
    /// The variable that gives the build's path.
    fn variable(self) -> &'static str {
        match self {
            Build::Tcp => "TRAIN_MLP_TCP",
            Build::Mpi => "TRAIN_MLP_MPI",
        }
    }

    /// The build, after checking that Slurm answers; the test fails naming what is missing.
    fn path(self) -> PathBuf {
        slurm_is_up();
        let variable = self.variable();
        match std::env::var_os(variable).map(PathBuf::from) {
            Some(path) if path.is_file() => path,
            _ => needs::missing(&format!(
                "{variable}: the train_mlp example built {} (.ci/run's Slurm tier builds it)",
                match self {
                    Build::Tcp => "without features",
                    Build::Mpi => "with `--features mpi`",
                }
            )),
        }
    }

    /// The engine the build's processes say they run on, at start.
    fn engine_line(self, processes: usize) -> String {
        let engine = match self {
            Build::Tcp => "tcp",
            Build::Mpi => "mpi",
        };
        format!("burn-accelerate: engine {engine} for {processes} processes on 1 machine")
    }
}

/// Fails the test unless a Slurm controller answers with a node that takes jobs (idle, or
/// running or ending other jobs; a node that does not respond shows a `*`).
fn slurm_is_up() {
    let answer = Command::new("sinfo")
        .args(["-h", "-N", "-o", "%t"])
        .stdin(Stdio::null())
        .output();
    let up = answer.is_ok_and(|out| {
        out.status.success()
            && String::from_utf8_lossy(&out.stdout).lines().any(|state| {
                let state = state
                    .trim()
                    .trim_end_matches(['~', '#', '%', '$', '@', '^', '-']);
                ["idle", "mix", "alloc", "comp", "plnd"].contains(&state)
            })
    });
    if !up {
        needs::missing(
            "a running Slurm whose node takes jobs (`scripts/slurm-up.sh`, then export the \
             SLURM_CONF it prints)",
        );
    }
}

/// Runs `command` in a fresh directory to its end (or the harness's deadline).
fn run(test: &str, mut command: Command) -> Launched {
    let dir = harness::scratch_dir(test);
    command.current_dir(&dir);
    harness::run(command, dir)
}

/// The one line `train_mlp`'s main process ends with (loss, accuracy, ...).
fn final_line(run: &Launched) -> &str {
    let lines: Vec<&str> = run
        .stdout
        .lines()
        .filter(|line| line.starts_with("final loss="))
        .collect();
    match lines[..] {
        [line] => line,
        _ => panic!("not one final line ({}):\n{}", run.status, run.output()),
    }
}

/// What one process, started by hand, ends with: the loss the runs of several processes must
/// reach, to every printed digit (with two processes every sum is one f32 addition, whatever
/// its order).
fn one_process(test: &str, build: Build, args: &[&str]) -> String {
    let mut command = Command::new(build.path());
    command.args(args).args(["--batch-size", "64"]);
    let ran = run(test, command);
    ran.assert_success();
    let line = final_line(&ran).to_string();
    harness::clean(ran.dir());
    line
}

/// Fails unless `ran` succeeded, ended at `expected`, and said at start it ran on the build's
/// engine with `processes` processes.
fn assert_trained_like(ran: &Launched, build: Build, processes: usize, expected: &str) {
    ran.assert_success();
    assert_eq!(final_line(ran), expected, "{}", ran.output());
    assert!(
        ran.stderr.contains(&build.engine_line(processes)),
        "no `{}` at start:\n{}",
        build.engine_line(processes),
        ran.output()
    );
    harness::clean(ran.dir());
}

/// The built-in engine's variables, as a job script sets them.
fn with_rendezvous(command: &mut Command) -> &mut Command {
    command
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", harness::free_port().to_string())
        .env("BURN_ACCELERATE_SECRET", "a test job's secret")
}

const TWO_EPOCHS: [&str; 2] = ["--epochs", "2"];

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh) and TRAIN_MLP_MPI: .ci/run's Slurm tier runs it with --ignored"]
fn srun_with_pmix_runs_the_mpi_build_as_one_process() {
    const TEST: &str = "srun_with_pmix_runs_the_mpi_build_as_one_process";
    let expected = one_process(TEST, Build::Mpi, &TWO_EPOCHS);
    let mut srun = Command::new("srun");
    srun.args(["-n", "2", "--mpi=pmix"])
        .arg(Build::Mpi.path())
        .args(TWO_EPOCHS)
        .args(["--batch-size", "32"]);
    assert_trained_like(&run(TEST, srun), Build::Mpi, 2, &expected);
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh) and TRAIN_MLP_TCP: .ci/run's Slurm tier runs it with --ignored"]
fn srun_runs_the_tcp_build_on_the_job_scripts_variables() {
    const TEST: &str = "srun_runs_the_tcp_build_on_the_job_scripts_variables";
    let expected = one_process(TEST, Build::Tcp, &TWO_EPOCHS);
    // As on a cluster without PMIx, and on one whose slurm.conf sets MpiDefault=pmix, where
    // every step looks like an MPI launch.
    for mpi in ["--mpi=none", "--mpi=pmix"] {
        let mut srun = Command::new("srun");
        with_rendezvous(&mut srun)
            .args(["-n", "2", mpi])
            .arg(Build::Tcp.path())
            .args(TWO_EPOCHS)
            .args(["--batch-size", "32"]);
        assert_trained_like(&run(TEST, srun), Build::Tcp, 2, &expected);
    }
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh) and TRAIN_MLP_MPI: .ci/run's Slurm tier runs it with --ignored"]
fn a_two_task_step_in_a_four_task_job_is_two_processes() {
    const TEST: &str = "a_two_task_step_in_a_four_task_job_is_two_processes";
    let expected = one_process(TEST, Build::Mpi, &TWO_EPOCHS);
    // The step inherits the job's SLURM_NTASKS_PER_NODE=4.
    let mut salloc = Command::new("salloc");
    salloc
        .args([
            "-N",
            "1",
            "--ntasks-per-node=4",
            "srun",
            "-n",
            "2",
            "--mpi=pmix",
        ])
        .arg(Build::Mpi.path())
        .args(TWO_EPOCHS)
        .args(["--batch-size", "32"]);
    assert_trained_like(&run(TEST, salloc), Build::Mpi, 2, &expected);
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh) and TRAIN_MLP_TCP: .ci/run's Slurm tier runs it with --ignored"]
fn a_program_started_directly_in_salloc_is_one_process() {
    const TEST: &str = "a_program_started_directly_in_salloc_is_one_process";
    let expected = one_process(TEST, Build::Tcp, &TWO_EPOCHS);
    let mut salloc = Command::new("salloc");
    salloc
        .args(["-n", "2"])
        .arg(Build::Tcp.path())
        .args(TWO_EPOCHS)
        .args(["--batch-size", "64"]);
    let ran = run(TEST, salloc);
    ran.assert_success();
    assert_eq!(final_line(&ran), expected, "{}", ran.output());
    assert!(
        ran.stderr.contains("`srun PROGRAM` there starts 2"),
        "no note that srun starts the tasks:\n{}",
        ran.output()
    );
    assert!(
        !ran.stderr.contains("burn-accelerate: engine"),
        "{}",
        ran.output()
    );
    harness::clean(ran.dir());
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh) and TRAIN_MLP_MPI: .ci/run's Slurm tier runs it with --ignored"]
fn srun_without_pmix_says_the_mpi_engine_needs_it() {
    const TEST: &str = "srun_without_pmix_says_the_mpi_engine_needs_it";
    let mut srun = Command::new("srun");
    srun.args(["-n", "2", "--mpi=none"])
        .arg(Build::Mpi.path())
        .args(TWO_EPOCHS)
        .env("BURN_ACCELERATE_ENGINE", "mpi");
    let ran = run(TEST, srun);
    assert!(!ran.status.success(), "{}", ran.output());
    assert!(
        ran.stderr.contains("start the step with `srun --mpi=pmix`"),
        "{}",
        ran.output()
    );
    assert!(!ran.stderr.contains("MASTER_ADDR"), "{}", ran.output());
    harness::clean(ran.dir());
}

/// The README's batch scripts (`#!/bin/bash` blocks with `#SBATCH` lines), with the build each
/// is for: MPI's says `srun --mpi=pmix`.
fn readme_batch_scripts() -> Vec<(Build, String)> {
    let readme = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md"))
        .expect("the README");
    let mut scripts = Vec::new();
    let mut block: Option<String> = None;
    for line in readme.lines() {
        match &mut block {
            None if line.trim_start().starts_with("```") => block = Some(String::new()),
            None => {}
            Some(text) if line.trim_start().starts_with("```") => {
                if text.starts_with("#!/bin/bash\n") && text.contains("\n#SBATCH ") {
                    let build = if text.contains("srun --mpi=pmix") {
                        Build::Mpi
                    } else {
                        Build::Tcp
                    };
                    scripts.push((build, std::mem::take(text)));
                }
                block = None;
            }
            Some(text) => {
                text.push_str(line);
                text.push('\n');
            }
        }
    }
    scripts
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh), TRAIN_MLP_TCP and TRAIN_MLP_MPI: .ci/run's Slurm tier runs it with --ignored"]
fn the_readmes_batch_scripts_run_as_written() {
    const TEST: &str = "the_readmes_batch_scripts_run_as_written";
    let scripts = readme_batch_scripts();
    let builds: Vec<Build> = scripts.iter().map(|(build, _)| *build).collect();
    assert_eq!(
        builds,
        [Build::Mpi, Build::Tcp],
        "the README's batch scripts"
    );
    for (build, script) in scripts {
        // The scripts take 2 tasks at batch 32 with the default epochs: one process at 64.
        let expected = one_process(TEST, build, &[]);
        let dir = harness::scratch_dir(TEST);
        // The script's paths, relative to the directory it is submitted from, lead to the
        // build under test (a debug build where the README builds a release one).
        let examples = dir.join("target/release/examples");
        std::fs::create_dir_all(&examples).unwrap();
        std::os::unix::fs::symlink(build.path(), examples.join("train_mlp")).unwrap();
        std::fs::write(dir.join("train.sbatch"), &script).unwrap();
        let mut sbatch = Command::new("sbatch");
        sbatch.args(["--wait", "train.sbatch"]).current_dir(&dir);
        let ran = harness::run(sbatch, dir.clone());
        let out = job_output(&dir);
        assert!(
            ran.status.success(),
            "{build:?}: {}\n{}\n--- the job's output\n{out}",
            ran.status,
            ran.output(),
        );
        let last = out.lines().rfind(|line| line.starts_with("final loss="));
        assert_eq!(last, Some(expected.as_str()), "{build:?}'s job:\n{out}");
        assert!(
            out.contains(&build.engine_line(2)),
            "{build:?}'s job:\n{out}"
        );
        harness::clean(&dir);
    }
}

/// What the batch job that ran in `dir` wrote (its `--output` file, `*.out`).
fn job_output(dir: &Path) -> String {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|entry| Some(entry.ok()?.path()))
        .filter(|path| path.extension().is_some_and(|e| e == "out"))
        .map(|path| std::fs::read_to_string(path).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a running Slurm (scripts/slurm-up.sh), TRAIN_MLP_TCP and TRAIN_MLP_MPI: .ci/run's Slurm tier runs it with --ignored"]
fn a_task_killed_mid_run_ends_the_step_within_a_minute() {
    const TEST: &str = "a_task_killed_mid_run_ends_the_step_within_a_minute";
    for build in [Build::Mpi, Build::Tcp] {
        let dir = harness::scratch_dir(TEST);
        let stderr = dir.join("stderr");
        // Each task leaves its pid (and the job's id), then becomes the program, which trains
        // for far longer than the test waits.
        let mpi = match build {
            Build::Mpi => "--mpi=pmix",
            Build::Tcp => "--mpi=none",
        };
        let mut srun = Command::new("srun");
        with_rendezvous(&mut srun)
            .args(["-n", "2", mpi, "bash", "-c"])
            .arg(r#"echo $SLURM_JOB_ID > job; echo $$ > "pid-$SLURM_PROCID"; exec "$0" --epochs 100000"#)
            .arg(build.path())
            .current_dir(&dir)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap());
        let mut step = srun.spawn().expect("srun starts");
        // Training has begun once the main process said which engine it runs on.
        let started = Instant::now();
        let task = loop {
            let said = std::fs::read_to_string(&stderr).unwrap_or_default();
            let pid = std::fs::read_to_string(dir.join("pid-1")).ok();
            if let (true, Some(pid)) = (said.contains("burn-accelerate: engine"), pid) {
                break pid.trim().parse::<i32>().expect("a pid");
            }
            if let Some(status) = step.try_wait().unwrap() {
                panic!("{build:?}: the step ended before training began ({status}):\n{said}");
            }
            if started.elapsed() > Duration::from_secs(120) {
                cancel(&dir, &mut step);
                panic!("{build:?}: training did not begin within 120 s:\n{said}");
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        std::thread::sleep(Duration::from_millis(500));
        let killed = Instant::now();
        use nix::sys::signal::{Signal, kill};
        kill(nix::unistd::Pid::from_raw(task), Signal::SIGKILL).expect("task 1 is killed");
        let status = loop {
            if let Some(status) = step.try_wait().unwrap() {
                break status;
            }
            if killed.elapsed() > Duration::from_secs(60) {
                cancel(&dir, &mut step);
                panic!(
                    "{build:?}: the step still ran 60 s after task 1 was killed:\n{}",
                    std::fs::read_to_string(&stderr).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        };
        let said = std::fs::read_to_string(&stderr).unwrap_or_default();
        assert!(!status.success(), "{build:?}: {status}\n{said}");
        eprintln!(
            "{build:?}: the step ended {:.1} s after task 1 was killed ({status})",
            killed.elapsed().as_secs_f64()
        );
        harness::clean(&dir);
    }
}

/// Ends a step that failed its test: its job, by the id its tasks left in `dir` (a killed
/// `srun` cannot tell Slurm to end the tasks), and `srun`.
fn cancel(dir: &Path, step: &mut std::process::Child) {
    if let Ok(job) = std::fs::read_to_string(dir.join("job")) {
        let _ = Command::new("scancel").arg(job.trim()).status();
    }
    let _ = step.kill();
    let _ = step.wait();
}
