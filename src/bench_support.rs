//! Entry points for the crate's own benchmarks (`examples/gemm_ab.rs`): the CPU kernels'
//! bf16 GEMMs called directly, each kernel by name, which the public API only reaches
//! through autocast on the kernel the CPU runs. Not part of the API: no stability promise.

use std::cell::RefCell;

use half::bf16;

use burn_accelerate_kernels::bf16_gemm::{
    self, Bf16Kernel, Bf16Matrix, Packed, Product, release_large,
};

/// The bf16 GEMM kernels a benchmark can name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Gemm {
    /// The CPU's AMX tiles.
    AmxTiles,
    /// The CPU's AVX512-BF16 dot products.
    DotProducts,
    /// The tile kernel on the software model of the tiles (slow: for small shapes only).
    TileModel,
}

impl Bf16Gemm {
    fn kernel(self) -> Bf16Kernel {
        match self {
            Bf16Gemm::AmxTiles => Bf16Kernel::Tiles,
            Bf16Gemm::DotProducts => Bf16Kernel::DotProducts,
            Bf16Gemm::TileModel => Bf16Kernel::TileModel,
        }
    }

    /// Whether this process runs it.
    pub fn runs_here(self) -> bool {
        self.kernel().runs_here()
    }
}

thread_local! {
    static PACKED: RefCell<Packed> = RefCell::default();
}

/// `c = a @ b` of row-major bf16 matrices `[m, k]` and `[k, n]` on `kernel`, on rayon's
/// threads, with packing scratch kept per thread as autocast's matmul keeps it; false where
/// the kernel does not run here or the shapes do not fit the slices.
pub fn bf16_gemm(
    kernel: Bf16Gemm,
    a: &[bf16],
    b: &[bf16],
    [m, k, n]: [usize; 3],
    c: &mut [f32],
) -> bool {
    let (Some(a), Some(b)) = (
        Bf16Matrix::new(a, 0, [m, k], [k, 1]),
        Bf16Matrix::new(b, 0, [k, n], [n, 1]),
    ) else {
        return false;
    };
    PACKED.with_borrow_mut(|packed| {
        let done = bf16_gemm::gemm_on(kernel.kernel(), a, b, Product::F32(c), true, packed);
        packed.iter_mut().for_each(release_large);
        done.is_some()
    })
}

/// `c = a @ b` of row-major f32 matrices by Flex's f32 GEMM (the `gemm` crate), what the
/// widened route runs where the CPU has no bf16 kernel.
pub fn f32_gemm(a: &[f32], b: &[f32], [m, k, n]: [usize; 3], c: &mut [f32]) {
    burn_accelerate_kernels::f32_gemm::f32_gemm((a, [k, 1]), (b, [n, 1]), [m, k, n], c, true)
        .expect("row-major operands of these sizes");
}
