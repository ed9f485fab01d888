//! `burn-accelerate`: the launcher (`launch`, `secret`, `env`; crate `burn-accelerate-launch`,
//! which needs no Burn), built with this crate so that `env` also reports what only a build
//! with Burn can say: the precisions each compiled-in backend really runs (found by running
//! them), as `accelerate env` does.
//!
//! ```text
//! burn-accelerate launch --num-processes 2 -- target/release/examples/train_mlp --batch-size 32
//! burn-accelerate env
//! ```
//!
//! (It is also the binary this crate's integration tests start: Cargo gives a test only the
//! binaries of its own package.)

use std::process::ExitCode;

mod backends;

fn main() -> ExitCode {
    burn_accelerate_launch::main(report_env)
}

// `env`'s lines after the launcher's own.
fn report_env() {
    println!(
        "burn-accelerate {} on Burn 0.21.0",
        env!("CARGO_PKG_VERSION")
    );
    backends::report_all();
}
