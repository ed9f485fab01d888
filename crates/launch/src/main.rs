//! `burn-accelerate`, the launcher alone (no Burn): `launch`, `secret`, `env`.

fn main() -> std::process::ExitCode {
    burn_accelerate_launch::main(burn_accelerate_launch::launcher_only)
}
