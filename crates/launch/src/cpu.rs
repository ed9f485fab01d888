//! The `cpu:` line of `burn-accelerate env`: the CPU's model name, its family and model
//! numbers, and the flags that decide which bf16 kernel the training library runs, from
//! Linux's `/proc/cpuinfo`. A cloud machine's model name often hides the generation ("AMD
//! EPYC" is a Zen 4 as family 25 and a Zen 5 as family 26), and every benchmark figure and bug
//! report about speed needs it.

/// The flags of the bf16 kernels, in the order they are listed: AVX-512, its bf16 dot
/// products (`vdpbf16ps`), and the AMX tiles with their bf16 products (`tdpbf16ps`).
const FLAGS: [&str; 4] = ["avx512f", "avx512_bf16", "amx_tile", "amx_bf16"];

/// The first processor of `cpuinfo` (the text of `/proc/cpuinfo`) in one line: its model name,
/// `(family F, model M)` where the text has them (x86), and whether it has each of the bf16
/// kernels' flags. `None` where the text names no model (another architecture's format).
///
/// ```
/// let cpuinfo = "processor\t: 0\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\
///                flags\t\t: fpu avx512f avx512_bf16\n";
/// assert_eq!(
///     burn_accelerate_launch::cpu::describe(cpuinfo).as_deref(),
///     Some("AMD EPYC (family 26, model 2); avx512f yes, avx512_bf16 yes, amx_tile no, amx_bf16 no")
/// );
/// ```
pub fn describe(cpuinfo: &str) -> Option<String> {
    let first = cpuinfo.split("\n\n").next()?;
    let field = |name: &str| {
        first.lines().find_map(|line| {
            let (key, value) = line.split_once(':')?;
            (key.trim() == name).then(|| value.trim())
        })
    };
    let mut line = field("model name")?.to_string();
    if let (Some(family), Some(model)) = (field("cpu family"), field("model")) {
        line.push_str(&format!(" (family {family}, model {model})"));
    }
    if let Some(flags) = field("flags") {
        let has = |flag: &str| flags.split_whitespace().any(|f| f == flag);
        let listed: Vec<String> = FLAGS
            .iter()
            .map(|flag| format!("{flag} {}", if has(flag) { "yes" } else { "no" }))
            .collect();
        line.push_str(&format!("; {}", listed.join(", ")));
    }
    Some(line)
}

/// [`describe`] of this machine's `/proc/cpuinfo`; `None` where there is none (not Linux).
pub fn this_machine() -> Option<String> {
    describe(&std::fs::read_to_string("/proc/cpuinfo").ok()?)
}

#[cfg(test)]
mod tests {
    use super::describe;

    #[test]
    fn an_amx_xeon_names_its_tiles_and_only_the_first_processor_counts() {
        let cpuinfo = "processor\t: 0\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 143\n\
                       model name\t: Intel(R) Xeon(R) Platinum 8480+\n\
                       flags\t\t: fpu avx512f avx512_bf16 amx_bf16 amx_tile amx_int8\n\n\
                       processor\t: 1\nmodel name\t: another\n";
        assert_eq!(
            describe(cpuinfo).as_deref(),
            Some(
                "Intel(R) Xeon(R) Platinum 8480+ (family 6, model 143); avx512f yes, \
                 avx512_bf16 yes, amx_tile yes, amx_bf16 yes"
            )
        );
    }

    #[test]
    fn a_cpu_without_avx512_says_no_to_each_flag_and_a_format_without_a_model_name_gives_none() {
        let zen3 =
            "cpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu avx2\n";
        assert_eq!(
            describe(zen3).as_deref(),
            Some(
                "AMD EPYC 7B13 (family 25, model 1); avx512f no, avx512_bf16 no, amx_tile no, \
                 amx_bf16 no"
            )
        );
        // `model` alone is not `model name`, nor is a flag's prefix the flag.
        let partial = "model\t\t: 1\nmodel name\t: X\nflags\t\t: avx512fx amx_bf16_extra\n";
        assert_eq!(
            describe(partial).as_deref(),
            Some("X; avx512f no, avx512_bf16 no, amx_tile no, amx_bf16 no")
        );
        // An Arm machine's: no model name.
        let arm = "processor\t: 0\nBogoMIPS\t: 50.00\nCPU implementer\t: 0x41\n";
        assert_eq!(describe(arm), None);
        assert_eq!(describe(""), None);
    }
}
