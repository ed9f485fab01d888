//! The CPU's own tile instructions (Intel AMX: AMX-TILE and AMX-BF16, 4th-generation Xeon and
//! later), by inline assembly (Rust's AMX intrinsics are unstable), and whether this process
//! may run them.
//!
//! Linux leaves the tile data out of a process's saved state until the process asks for it
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`, Linux 5.16 and later; the first
//! tile instruction faults otherwise): [`support`] asks once, and says why where the answer
//! is no, so that the GEMM falls back to the AVX512-BF16 dot products and the log and
//! `burn-accelerate env` can say so.

use std::fmt;
#[cfg(target_arch = "x86_64")]
use std::sync::OnceLock;

use super::Tiles;

/// Whether this process runs AMX tile instructions, and why not where it does not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Support {
    /// The CPU has AMX-TILE and AMX-BF16, and the OS granted the tile state.
    Granted,
    /// The CPU has no AMX-BF16 (or this is not an x86-64 build).
    NoAmx,
    /// The CPU has AMX, but the OS does not enable the tile state (XCR0 bits 17 and 18):
    /// a kernel before Linux 5.16, or a hypervisor that hides it.
    NotEnabled,
    /// The CPU has AMX, but Linux refused `arch_prctl(ARCH_REQ_XCOMP_PERM)` with this errno
    /// (a signal stack too small for the tile state, a seccomp filter, ...).
    Refused(i32),
    /// The CPU has AMX, but this OS is not Linux, where the crate knows how to ask for it.
    NotLinux,
}

impl fmt::Display for Support {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Support::Granted => write!(f, "AMX tiles granted"),
            Support::NoAmx => write!(f, "no AMX-BF16 on this CPU"),
            Support::NotEnabled => write!(
                f,
                "the CPU has AMX but the OS does not enable its tile state (XCR0): Linux 5.16 or later is needed"
            ),
            Support::Refused(errno) => write!(
                f,
                "the CPU has AMX but Linux refused the tile state (arch_prctl(ARCH_REQ_XCOMP_PERM): errno {errno})"
            ),
            Support::NotLinux => {
                write!(
                    f,
                    "the CPU has AMX, but the crate asks for it on Linux only"
                )
            }
        }
    }
}

/// Whether this process may run the tile instructions: checked, and the tile state asked for,
/// once per process.
pub fn support() -> Support {
    #[cfg(target_arch = "x86_64")]
    {
        static SUPPORT: OnceLock<Support> = OnceLock::new();
        *SUPPORT.get_or_init(detect)
    }
    #[cfg(not(target_arch = "x86_64"))]
    Support::NoAmx
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Support {
    use std::arch::x86_64::__cpuid_count;
    // CPUID leaf 7, sub-leaf 0, EDX: bit 22 AMX-BF16, bit 24 AMX-TILE.
    // A CPU without leaf 7 returns zeros or the highest leaf's values, neither with both bits.
    let leaf7 = __cpuid_count(7, 0);
    if leaf7.edx & (1 << 22) == 0 || leaf7.edx & (1 << 24) == 0 {
        return Support::NoAmx;
    }
    // XCR0 bits 17 (XTILECFG) and 18 (XTILEDATA): the OS saves the tile state.
    // `xgetbv` runs only where the CPU has XSAVE and the OS set OSXSAVE (leaf 1, ECX bit 27).
    let osxsave = std::is_x86_feature_detected!("xsave")
        && std::arch::x86_64::__cpuid(1).ecx & (1 << 27) != 0;
    // SAFETY: checked just above.
    if !osxsave || unsafe { xcr0() } & (0b11 << 17) != 0b11 << 17 {
        return Support::NotEnabled;
    }
    permission()
}

// XCR0, the state components the OS saves.
//
// SAFETY: the CPU has XSAVE and the OS set OSXSAVE.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "xsave")]
unsafe fn xcr0() -> u64 {
    // SAFETY: the caller's promise.
    unsafe { std::arch::x86_64::_xgetbv(0) }
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn permission() -> Support {
    // arch/x86/include/uapi/asm/prctl.h
    const ARCH_GET_XCOMP_PERM: libc::c_ulong = 0x1022;
    const ARCH_REQ_XCOMP_PERM: libc::c_ulong = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_ulong = 18;
    // SAFETY: `arch_prctl` with these codes reads and writes nothing of ours but `granted`.
    let asked = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    if asked != 0 {
        return Support::Refused(std::io::Error::last_os_error().raw_os_error().unwrap_or(0));
    }
    let mut granted: u64 = 0;
    // SAFETY: as above; the kernel writes one u64 at `granted`.
    let read = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_GET_XCOMP_PERM,
            &mut granted as *mut u64,
        )
    };
    match read == 0 && granted & (1 << XFEATURE_XTILEDATA) != 0 {
        true => Support::Granted,
        false => Support::Refused(std::io::Error::last_os_error().raw_os_error().unwrap_or(0)),
    }
}

#[cfg(all(target_arch = "x86_64", not(target_os = "linux")))]
fn permission() -> Support {
    Support::NotLinux
}

/// The CPU's tile registers. Only built where [`support`] is [`Support::Granted`].
#[derive(Debug)]
pub struct Amx(());

impl Amx {
    /// The tile registers, where this process may run them.
    pub fn new() -> Option<Self> {
        (support() == Support::Granted).then_some(Amx(()))
    }
}

#[cfg(target_arch = "x86_64")]
impl Tiles for Amx {
    unsafe fn configure(&mut self) {
        let config = super::configuration();
        // SAFETY: an `Amx` exists only where the CPU has the instructions and the OS granted
        // the tile state; `config` is the 64-byte operand.
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) config.as_ptr(), options(nostack, readonly))
        };
    }

    unsafe fn zero<const T: u8>(&mut self) {
        // SAFETY: as for `configure`, which the caller ran.
        unsafe { std::arch::asm!("tilezero tmm{t}", t = const T, options(nostack, nomem)) };
    }

    unsafe fn load<const T: u8>(&mut self, at: *const u8, stride: usize) {
        // SAFETY: the caller's promise that the rows are readable; configured.
        unsafe {
            std::arch::asm!(
                "tileloadd tmm{t}, [{at} + {stride} * 1]",
                t = const T,
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack, readonly),
            )
        };
    }

    unsafe fn store<const T: u8>(&mut self, at: *mut u8, stride: usize) {
        // SAFETY: the caller's promise that the rows are writable; configured.
        unsafe {
            std::arch::asm!(
                "tilestored [{at} + {stride} * 1], tmm{t}",
                t = const T,
                at = in(reg) at,
                stride = in(reg) stride,
                options(nostack),
            )
        };
    }

    unsafe fn dot<const C: u8, const A: u8, const B: u8>(&mut self) {
        // SAFETY: configured.
        unsafe {
            std::arch::asm!(
                "tdpbf16ps tmm{c}, tmm{a}, tmm{b}",
                c = const C,
                a = const A,
                b = const B,
                options(nostack, nomem),
            )
        };
    }

    unsafe fn release(&mut self) {
        // SAFETY: releasing is always allowed where the instructions exist.
        unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) };
    }
}
