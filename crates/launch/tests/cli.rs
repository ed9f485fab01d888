//! The launcher binary alone (no Burn in its build): it starts a program's processes with
//! their places in the run, writes secrets, and reports the environment.

use std::process::Command;

fn launcher() -> Command {
    Command::new(env!("CARGO_BIN_EXE_burn-accelerate"))
}

// The launches' main port: 0, ports the system picks for the rendezvous and the processes,
// so that the tests' launches run at once without picking the same.
const ANY_PORT: &str = "0";

#[test]
fn launch_gives_each_process_its_rank_and_prefixes_its_lines() {
    let out = launcher()
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            ANY_PORT,
            "--",
            "sh",
            "-c",
            "echo \"rank=$RANK of $WORLD_SIZE local=$LOCAL_RANK\"",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for rank in 0..2 {
        let line = format!("[rank {rank}] rank={rank} of 2 local={rank}");
        assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
    }
}

// Launches 2 processes that print their thread variables, with `env` set in the launcher's
// environment (every thread variable removed first); returns stdout and stderr.
fn launch_printing_threads(env: &[(&str, &str)]) -> (String, String) {
    let mut command = launcher();
    command
        .env_remove("RAYON_NUM_THREADS")
        .env_remove("OMP_NUM_THREADS")
        .envs(env.iter().copied())
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            ANY_PORT,
            "--",
            "sh",
            "-c",
            "echo \"rayon=${RAYON_NUM_THREADS-unset} omp=${OMP_NUM_THREADS-unset}\"",
        ]);
    let out = command.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(out.status.success(), "{stdout}\n{stderr}");
    (stdout, stderr)
}

#[test]
fn each_process_gets_its_share_of_the_cores_unless_the_user_chose() {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let share = (cores / 2).max(1);
    let (stdout, stderr) = launch_printing_threads(&[]);
    for rank in 0..2 {
        let line = format!("[rank {rank}] rayon={share} omp={share}");
        assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
    }
    // Said once, naming what was set and how to choose.
    let said: Vec<&str> = stderr
        .lines()
        .filter(|l| l.contains("each process gets"))
        .collect();
    assert_eq!(said.len(), 1, "{stderr}");
    assert!(
        said[0].contains(&format!(
            "2 processes on this machine's {cores} cores: each process gets \
             RAYON_NUM_THREADS={share} and OMP_NUM_THREADS={share}"
        )) && said[0].contains("set RAYON_NUM_THREADS / OMP_NUM_THREADS yourself"),
        "{stderr}"
    );

    // The user's own count is kept, and the other variable still gets the share.
    let (stdout, stderr) = launch_printing_threads(&[("RAYON_NUM_THREADS", "7")]);
    for rank in 0..2 {
        let line = format!("[rank {rank}] rayon=7 omp={share}");
        assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
    }
    assert!(
        stderr.contains(&format!("each process gets OMP_NUM_THREADS={share}"))
            && stderr.contains("RAYON_NUM_THREADS=\"7\" is yours and kept"),
        "{stderr}"
    );

    // Both chosen: nothing set, nothing said.
    let (stdout, stderr) =
        launch_printing_threads(&[("RAYON_NUM_THREADS", "3"), ("OMP_NUM_THREADS", "5")]);
    for rank in 0..2 {
        let line = format!("[rank {rank}] rayon=3 omp=5");
        assert!(stdout.lines().any(|l| l == line), "{line:?} in\n{stdout}");
    }
    assert!(!stderr.contains("each process gets"), "{stderr}");
}

#[test]
fn a_failing_process_fails_the_launch_naming_its_rank() {
    let out = launcher()
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            ANY_PORT,
            "--grace",
            "1",
            "--",
            "sh",
            "-c",
            "[ \"$RANK\" = 1 ] && exit 7; sleep 30",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("process 1 exited with status 7"),
        "{stderr}"
    );
}

#[test]
fn secret_writes_64_hex_characters_readable_by_its_owner_only() {
    let path = std::env::temp_dir().join(format!("launch-secret-{}", std::process::id()));
    let status = launcher().arg("secret").arg(&path).status().unwrap();
    assert!(status.success());
    let text = std::fs::read_to_string(&path).unwrap();
    assert_eq!(text.trim().len(), 64, "{text:?}");
    assert!(text.trim().chars().all(|c| c.is_ascii_hexdigit()));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
    }
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn env_names_the_variable_of_a_bad_layout_and_says_where_the_backend_probes_are() {
    let out = launcher()
        .arg("env")
        .env("RANK", "2")
        .env("WORLD_SIZE", "2")
        .output()
        .unwrap();
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert!(out.status.success());
    assert!(
        stdout.contains("environment variable RANK=\"2\" is invalid: below WORLD_SIZE=2"),
        "{stdout}"
    );
    assert!(
        stdout.contains("not probed by the launcher alone"),
        "{stdout}"
    );
    // The CPU, named with its family and its bf16 kernels' flags (Linux's /proc/cpuinfo).
    #[cfg(all(target_os = "linux", target_arch = "x86_64"))]
    assert!(
        stdout
            .lines()
            .any(|l| l.starts_with("cpu: ") && l.contains("(family ") && l.contains("amx_bf16 ")),
        "{stdout}"
    );
}

// Issue 49: every number-taking flag of `launch` at its edges (too large for a wait, negative,
// not a number, empty, past u64): a usage error, exit code 2, naming the flag; never a panic
// (exit 101: `--timeout 1e30` overflowed a Duration before).
#[test]
fn every_bad_number_flag_is_a_usage_error_naming_the_flag() {
    let flags = [
        "--timeout",
        "--liveness-timeout",
        "--grace",
        "--num-processes",
        "--main-process-port",
        "--max-restarts",
    ];
    let values = [
        "1e30",
        "-1",
        "abc",
        "",
        "18446744073709551616",
        "NaN",
        "inf",
    ];
    for flag in flags {
        for value in values {
            let out = launcher()
                .args(["launch", &format!("{flag}={value}"), "--", "true"])
                .output()
                .unwrap();
            let said = String::from_utf8_lossy(&out.stderr);
            assert_eq!(out.status.code(), Some(2), "{flag}={value}: {said}");
            assert!(said.contains(flag), "{flag}={value}: {said}");
        }
    }
}

#[test]
fn port_0_gives_the_processes_the_rendezvous_port_the_system_picked_and_their_own_to_pick() {
    let out = launcher()
        .args([
            "launch",
            "--num-processes",
            "2",
            "--main-process-port",
            "0",
            "--",
            "sh",
            "-c",
            "echo \"main=$MASTER_PORT data=$BURN_ACCELERATE_DATA_PORT\"",
        ])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ports: Vec<(u16, &str)> = (0..2)
        .map(|rank| {
            let prefix = format!("[rank {rank}] main=");
            let line = stdout
                .lines()
                .find_map(|l| l.strip_prefix(prefix.as_str()))
                .unwrap_or_else(|| panic!("{prefix:?} in\n{stdout}"));
            let (main, data) = line.split_once(" data=").unwrap();
            (main.parse().unwrap(), data)
        })
        .collect();
    // The rendezvous's own port, the same for both; each process listens where the system
    // says (0) and tells the others at the rendezvous.
    assert_ne!(ports[0].0, 0, "{stdout}");
    assert_eq!(ports[0].0, ports[1].0, "{stdout}");
    assert_eq!([ports[0].1, ports[1].1], ["0", "0"], "{stdout}");

    // Other machines could not be told machine 0's port.
    let out = launcher()
        .args([
            "launch",
            "--num-processes",
            "2",
            "--num-machines",
            "2",
            "--main-process-ip",
            "127.0.0.1",
            "--main-process-port",
            "0",
            "--",
            "true",
        ])
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{said}");
    assert!(
        said.contains("--main-process-port 0") && said.contains("give one"),
        "{said}"
    );
}
