//! The peak resident memory of this process, as the examples that measure memory read it
//! (Linux's `VmHWM`; elsewhere nothing is measured and 0 is read).

/// Resets the kernel's peak resident memory of this process to its current one.
#[allow(dead_code)] // Not every example resets it.
pub fn reset_peak_memory() {
    let _ = std::fs::write("/proc/self/clear_refs", "5");
}

/// The peak resident memory of this process, in MiB.
pub fn peak_memory_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}
