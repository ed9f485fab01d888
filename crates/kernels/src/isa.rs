//! The instruction sets the crate's CPU kernels are compiled for, and the macro that compiles
//! a module's kernels once per set.
//!
//! The arithmetic is written once, as scalar code without branches, and compiled three times
//! ([`Isa`]): for AVX-512 and for AVX2 with FMA (chosen at run time where the CPU has them,
//! the loops vectorised by the compiler) and for the baseline target (the portable fallback,
//! every other CPU).

/// The instruction set a kernel's loops run on, detected at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F with FMA: sixteen f32 lanes.
    Avx512,
    /// AVX2 with FMA: eight f32 lanes.
    Avx2,
    /// The baseline target's code: the fallback on every other CPU.
    Portable,
}

impl Isa {
    /// Every instruction set, widest first.
    pub const ALL: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Portable];

    /// The widest this CPU has.
    pub fn best() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            if Isa::Avx512.supported() {
                return Isa::Avx512;
            }
            if Isa::Avx2.supported() {
                return Isa::Avx2;
            }
        }
        Isa::Portable
    }

    /// Whether this CPU runs `self`'s code.
    pub fn supported(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            let fma = std::is_x86_feature_detected!("fma");
            match self {
                Isa::Avx512 => fma && std::is_x86_feature_detected!("avx512f"),
                Isa::Avx2 => fma && std::is_x86_feature_detected!("avx2"),
                Isa::Portable => true,
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        matches!(self, Isa::Portable)
    }

    /// `self` where the CPU runs it, else [`Isa::Portable`]: what the dispatch matches on, so
    /// that an `Isa` named by hand never runs instructions the CPU lacks.
    pub fn checked(self) -> Isa {
        if self.supported() {
            self
        } else {
            Isa::Portable
        }
    }
}

/// Compiles the listed functions of the enclosing module (`#[inline(always)]`, on slices) for
/// each [`Isa`]: `on::f(isa, args)` runs `f` as compiled for `isa` (checked against the CPU).
macro_rules! isa_variants {
    ($($(#[$attr:meta])* fn $name:ident($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)?;)+) => {
        #[cfg(target_arch = "x86_64")]
        mod avx512 {
            #[allow(unused_imports)]
            use super::*;
            $(
                /// # Safety
                /// The CPU must have AVX-512 F and FMA.
                $(#[$attr])*
                #[target_feature(enable = "avx512f,fma")]
                pub(super) unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                    super::$name($($arg),*)
                }
            )+
        }

        #[cfg(target_arch = "x86_64")]
        mod avx2 {
            #[allow(unused_imports)]
            use super::*;
            $(
                /// # Safety
                /// The CPU must have AVX2 and FMA.
                $(#[$attr])*
                #[target_feature(enable = "avx2,fma")]
                pub(super) unsafe fn $name($($arg: $ty),*) $(-> $ret)? {
                    super::$name($($arg),*)
                }
            )+
        }

        /// The functions above, on the instruction set named.
        mod on {
            #[allow(unused_imports)]
            use super::*;
            use $crate::isa::Isa;
            $(
                $(#[$attr])*
                #[inline]
                pub(super) fn $name(isa: Isa, $($arg: $ty),*) $(-> $ret)? {
                    match isa.checked() {
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `checked` gives `Avx512` only where the CPU has AVX-512 F
                        // and FMA.
                        Isa::Avx512 => unsafe { super::avx512::$name($($arg),*) },
                        #[cfg(target_arch = "x86_64")]
                        // SAFETY: `checked` gives `Avx2` only where the CPU has AVX2 and FMA.
                        Isa::Avx2 => unsafe { super::avx2::$name($($arg),*) },
                        _ => super::$name($($arg),*),
                    }
                }
            )+
        }
    };
}
pub(crate) use isa_variants;

#[cfg(test)]
pub mod tests {
    use super::Isa;

    /// Every path this CPU runs: the portable fallback always.
    pub fn paths() -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|isa| isa.supported()).collect()
    }
}
