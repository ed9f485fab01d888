//! The bf16 GEMM alone against oneDNN's, interleaved in one run (issue 45): GFLOP/s of ours on
//! each kernel this CPU runs (AMX tiles, AVX512-BF16 dot products), of the f32 GEMM the widened
//! route runs elsewhere, and of oneDNN's bf16 × bf16 → f32 `dnnl_matmul` (what PyTorch's CPU
//! autocast runs), on the transformer LM's shapes (`train_lm`'s defaults: 2048 tokens,
//! d_model 384, d_ff 1536) and the MLP's (`autocast_ab`: batch 256, 512 → 2048 → 512), forward
//! and backward.
//!
//! oneDNN is the anchor, loaded at run time (`dlopen`), never a dependency of the crate:
//!
//!     apt-get install libdnnl-dev        # Debian 12: oneDNN 2.6 (libdnnl.so.2)
//!     cargo build --release --example gemm_ab
//!     OMP_NUM_THREADS=2 RAYON_NUM_THREADS=2 target/release/examples/gemm_ab --rounds 7
//!
//! oneDNN's OpenMP threads wait passively here (`OMP_WAIT_POLICY=PASSIVE` unless the
//! environment sets a policy): libgomp's default keeps them spinning on the cores after each
//! call, where they take the cores from the next variant's threads, so that whichever variant
//! ran after oneDNN's lost half its speed (on a 2-core Zen 5, ours at 0.32–0.52 of oneDNN
//! with them spinning, 0.83–1.06 with them passive, and the f32 GEMM at half its speed too).
//! Passive, each side's idle threads leave the cores to the other, as rayon's do.
//!
//! Without it the oneDNN column says so. `ONEDNN_VERBOSE=1` shows which oneDNN kernel ran
//! (`brg:avx512_core_amx_bf16` on an AMX Xeon); the run prints it too.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::time::Instant;

use burn_accelerate::bench_support::{self, Bf16Gemm};
use clap::Parser;
use half::bf16;

#[derive(Parser)]
#[command(about = "The bf16 GEMM on each of this CPU's kernels against oneDNN's matmul")]
struct Args {
    /// Rounds over all shapes and variants (the variants' order rotates each round).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// GEMMs timed back to back per variant and round (the round's time is their median).
    #[arg(long, default_value_t = 5)]
    repeat: usize,
    /// Only the shapes whose label contains this.
    #[arg(long)]
    only: Option<String>,
}

/// `(label, [m, k, n])`.
const SHAPES: [(&str, [usize; 3]); 9] = [
    ("LM attention projection", [2048, 384, 384]),
    ("LM feed-forward up", [2048, 384, 1536]),
    ("LM feed-forward down", [2048, 1536, 384]),
    ("LM up, input gradient", [2048, 1536, 384]),
    ("LM up, weight gradient", [384, 2048, 1536]),
    ("MLP up", [256, 512, 2048]),
    ("MLP down", [256, 2048, 512]),
    ("MLP up, weight gradient", [512, 256, 2048]),
    ("the issue's oneDNN anchor", [1536, 384, 1536]),
];

fn main() {
    let args = Args::parse();
    if std::env::var_os("OMP_WAIT_POLICY").is_none() {
        // SAFETY: no other thread runs yet (rayon's pool and oneDNN's OpenMP start later),
        // so none reads the environment meanwhile.
        unsafe { std::env::set_var("OMP_WAIT_POLICY", "PASSIVE") };
    }
    let onednn = OneDnn::load();
    println!(
        "CPU: {}; AMX: {}; oneDNN: {} (OMP_WAIT_POLICY={})",
        burn_accelerate_launch::cpu::this_machine().unwrap_or_else(|| "unknown".into()),
        burn_accelerate::capability::amx_status(),
        match &onednn {
            Ok(_) => "libdnnl.so.2 loaded".to_string(),
            Err(e) => format!("not loaded ({e}; `apt-get install libdnnl-dev`)"),
        },
        std::env::var("OMP_WAIT_POLICY").unwrap_or_default(),
    );
    let mut variants: Vec<Variant> = [Bf16Gemm::AmxTiles, Bf16Gemm::DotProducts]
        .into_iter()
        .filter(|k| k.runs_here())
        .map(Variant::Ours)
        .collect();
    variants.push(Variant::F32);
    if onednn.is_ok() {
        variants.push(Variant::OneDnn);
    }
    let shapes: Vec<_> = SHAPES
        .iter()
        .filter(|(label, _)| {
            args.only
                .as_ref()
                .is_none_or(|o| label.contains(o.as_str()))
        })
        .collect();
    // Per shape and variant, each round's median time.
    let mut times = vec![vec![Vec::new(); variants.len()]; shapes.len()];
    let mut impl_names = vec![String::new(); shapes.len()];
    for round in 0..args.rounds {
        for (s, (_, [m, k, n])) in shapes.iter().enumerate() {
            let (m, k, n) = (*m, *k, *n);
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let (a32, b32): (Vec<f32>, Vec<f32>) = (
                a.iter().map(|v| v.to_f32()).collect(),
                b.iter().map(|v| v.to_f32()).collect(),
            );
            let mut c = vec![0f32; m * n];
            let primitive = match onednn.as_ref().map(|d| d.matmul([m, k, n])) {
                Ok(Ok(p)) => {
                    impl_names[s] = p.1.clone();
                    Some(p)
                }
                Ok(Err(e)) => {
                    impl_names[s] = e;
                    None
                }
                Err(_) => None,
            };
            for v in 0..variants.len() {
                let variant = variants[(v + round) % variants.len()];
                if variant == Variant::OneDnn && primitive.is_none() {
                    continue;
                }
                let mut run = || match variant {
                    Variant::Ours(kernel) => {
                        assert!(bench_support::bf16_gemm(kernel, &a, &b, [m, k, n], &mut c))
                    }
                    Variant::F32 => bench_support::f32_gemm(&a32, &b32, [m, k, n], &mut c),
                    Variant::OneDnn => {
                        let (p, _) = primitive.as_ref().unwrap();
                        p.run(&a, &b, &mut c)
                    }
                };
                run(); // warm: packing buffers, pages, oneDNN's first call
                let mut t: Vec<f64> = (0..args.repeat)
                    .map(|_| {
                        let start = Instant::now();
                        run();
                        start.elapsed().as_secs_f64()
                    })
                    .collect();
                t.sort_by(f64::total_cmp);
                let index = variants.iter().position(|x| *x == variant).unwrap();
                times[s][index].push(t[t.len() / 2]);
            }
        }
    }
    print!("| shape (m × k × n) |");
    for v in &variants {
        print!(" {} |", v.label());
    }
    let ours = variants.iter().position(|v| matches!(v, Variant::Ours(_)));
    let dnnl = variants.iter().position(|v| *v == Variant::OneDnn);
    if ours.is_some() && dnnl.is_some() {
        print!(" ours / oneDNN |");
    }
    println!(" oneDNN's kernel |");
    let ratio = usize::from(ours.is_some() && dnnl.is_some());
    println!("|---|{}---|", "--:|".repeat(variants.len() + ratio));
    for (s, (label, [m, k, n])) in shapes.iter().enumerate() {
        let gflop = 2.0 * (m * k * n) as f64 / 1e9;
        print!("| {label}, {m} × {k} × {n} |");
        let rate = |i: usize| {
            let mut t = times[s][i].clone();
            t.sort_by(f64::total_cmp);
            t.get(t.len() / 2).map(|t| gflop / t)
        };
        for i in 0..variants.len() {
            match rate(i) {
                Some(r) => print!(" {r:.0} |"),
                None => print!(" – |"),
            }
        }
        if let (Some(o), Some(d)) = (ours, dnnl) {
            match (rate(o), rate(d)) {
                (Some(o), Some(d)) => print!(" {:.2} |", o / d),
                _ => print!(" – |"),
            }
        }
        println!(" {} |", impl_names[s]);
    }
    println!(
        "GFLOP/s, medians of {} rounds of {} GEMMs each",
        args.rounds, args.repeat
    );
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Variant {
    Ours(Bf16Gemm),
    /// Flex's f32 GEMM over widened operands (the route where the CPU has no bf16 kernel).
    F32,
    OneDnn,
}

impl Variant {
    fn label(&self) -> &'static str {
        match self {
            Variant::Ours(Bf16Gemm::AmxTiles) => "ours, AMX tiles",
            Variant::Ours(Bf16Gemm::DotProducts) => "ours, vdpbf16ps",
            Variant::Ours(Bf16Gemm::TileModel) => "ours, tile model",
            Variant::F32 => "f32 GEMM (widened route)",
            Variant::OneDnn => "oneDNN bf16",
        }
    }
}

fn values(n: usize, seed: u32) -> Vec<bf16> {
    (0..n as u32)
        .map(|i| {
            bf16::from_f32(((i.wrapping_mul(2_654_435_761) ^ seed) % 2000) as f32 / 1000.0 - 1.0)
        })
        .collect()
}

/// oneDNN 2.x's C API, the few calls a matmul needs, loaded from `libdnnl.so.2`. Constants
/// and struct sizes from oneDNN 2.6's `dnnl_types.h` (Debian 12's `libdnnl-dev`): the
/// descriptors are opaque buffers larger than `dnnl_memory_desc_t` (696 bytes) and
/// `dnnl_matmul_desc_t` (2800 bytes), which the library fills.
struct OneDnn {
    engine: *mut c_void,
    stream: *mut c_void,
    f: Functions,
}

type Status = c_int;
const SUCCESS: Status = 0;
const BF16: c_int = 2;
const F32: c_int = 3;
const TAG_AB: c_int = 3;
const ENGINE_CPU: c_int = 1;
const STREAM_IN_ORDER: u32 = 1;
const QUERY_IMPL_INFO_STR: c_int = 8;
const ARG_SRC: c_int = 1;
const ARG_DST: c_int = 17;
const ARG_WEIGHTS: c_int = 33;

#[repr(C, align(64))]
struct Opaque([u8; 4096]);

#[repr(C)]
struct ExecArg {
    arg: c_int,
    memory: *mut c_void,
}

struct Functions {
    engine_create: unsafe extern "C" fn(*mut *mut c_void, c_int, usize) -> Status,
    stream_create: unsafe extern "C" fn(*mut *mut c_void, *mut c_void, u32) -> Status,
    md_init_by_tag: unsafe extern "C" fn(*mut Opaque, c_int, *const i64, c_int, c_int) -> Status,
    matmul_desc_init: unsafe extern "C" fn(
        *mut Opaque,
        *const Opaque,
        *const Opaque,
        *const Opaque,
        *const Opaque,
    ) -> Status,
    pd_create: unsafe extern "C" fn(
        *mut *mut c_void,
        *const Opaque,
        *const c_void,
        *mut c_void,
        *const c_void,
    ) -> Status,
    pd_query: unsafe extern "C" fn(*const c_void, c_int, c_int, *mut c_void) -> Status,
    primitive_create: unsafe extern "C" fn(*mut *mut c_void, *const c_void) -> Status,
    memory_create:
        unsafe extern "C" fn(*mut *mut c_void, *const Opaque, *mut c_void, *mut c_void) -> Status,
    memory_set_data_handle: unsafe extern "C" fn(*mut c_void, *mut c_void) -> Status,
    execute: unsafe extern "C" fn(*const c_void, *mut c_void, c_int, *const ExecArg) -> Status,
    stream_wait: unsafe extern "C" fn(*mut c_void) -> Status,
}

/// A created matmul and its three memory objects, whose data pointers are set per call.
struct Matmul<'d> {
    dnnl: &'d OneDnn,
    primitive: *mut c_void,
    memories: [*mut c_void; 3],
}

impl OneDnn {
    fn load() -> Result<Self, String> {
        // SAFETY: dlopen/dlsym with NUL-terminated names; each symbol is cast to its
        // signature in oneDNN 2.x's dnnl.h.
        unsafe {
            let lib = libc::dlopen(c"libdnnl.so.2".as_ptr(), libc::RTLD_NOW);
            if lib.is_null() {
                return Err("libdnnl.so.2 not found".into());
            }
            let sym = |name: &CStr| -> Result<*mut c_void, String> {
                let p = libc::dlsym(lib, name.as_ptr());
                match p.is_null() {
                    true => Err(format!("{} missing", name.to_string_lossy())),
                    false => Ok(p),
                }
            };
            macro_rules! f {
                ($name:literal) => {
                    function(sym($name)?)
                };
            }
            let f = Functions {
                engine_create: f!(c"dnnl_engine_create"),
                stream_create: f!(c"dnnl_stream_create"),
                md_init_by_tag: f!(c"dnnl_memory_desc_init_by_tag"),
                matmul_desc_init: f!(c"dnnl_matmul_desc_init"),
                pd_create: f!(c"dnnl_primitive_desc_create"),
                pd_query: f!(c"dnnl_primitive_desc_query"),
                primitive_create: f!(c"dnnl_primitive_create"),
                memory_create: f!(c"dnnl_memory_create"),
                memory_set_data_handle: f!(c"dnnl_memory_set_data_handle"),
                execute: f!(c"dnnl_primitive_execute"),
                stream_wait: f!(c"dnnl_stream_wait"),
            };
            let (mut engine, mut stream) = (std::ptr::null_mut(), std::ptr::null_mut());
            check((f.engine_create)(&mut engine, ENGINE_CPU, 0), "engine")?;
            check(
                (f.stream_create)(&mut stream, engine, STREAM_IN_ORDER),
                "stream",
            )?;
            Ok(Self { engine, stream, f })
        }
    }

    /// A bf16 × bf16 → f32 matmul of row-major `[m, k]` by `[k, n]`, and the name of the
    /// implementation oneDNN chose.
    fn matmul(&self, [m, k, n]: [usize; 3]) -> Result<(Matmul<'_>, String), String> {
        let f = &self.f;
        let md = |rows: usize, cols: usize, dtype| {
            let mut md = Box::new(Opaque([0; 4096]));
            let dims = [rows as i64, cols as i64];
            // SAFETY: `md` is larger than a `dnnl_memory_desc_t`; `dims` holds 2 dims.
            let status = unsafe { (f.md_init_by_tag)(&mut *md, 2, dims.as_ptr(), dtype, TAG_AB) };
            check(status, "memory descriptor").unwrap();
            md
        };
        let (src, weights, dst) = (md(m, k, BF16), md(k, n, BF16), md(m, n, F32));
        let mut desc = Box::new(Opaque([0; 4096]));
        let (mut pd, mut primitive) = (std::ptr::null_mut(), std::ptr::null_mut());
        let mut memories = [std::ptr::null_mut(); 3];
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: the descriptors were initialised above; out-parameters are valid.
        unsafe {
            let none = std::ptr::null();
            check(
                (f.matmul_desc_init)(&mut *desc, &*src, &*weights, none, &*dst),
                "matmul",
            )
            .unwrap();
            check(
                (f.pd_create)(
                    &mut pd,
                    &*desc,
                    std::ptr::null(),
                    self.engine,
                    std::ptr::null(),
                ),
                "primitive descriptor (3: unimplemented on this CPU)",
            )?;
            check(
                (f.pd_query)(
                    pd,
                    QUERY_IMPL_INFO_STR,
                    0,
                    (&mut name as *mut *const c_char).cast(),
                ),
                "query",
            )
            .unwrap();
            check((f.primitive_create)(&mut primitive, pd), "primitive").unwrap();
            for (memory, md) in memories.iter_mut().zip([&src, &weights, &dst]) {
                check(
                    (f.memory_create)(memory, &**md, self.engine, std::ptr::null_mut()),
                    "memory",
                )
                .unwrap();
            }
        }
        // SAFETY: oneDNN returns a NUL-terminated string owned by the primitive descriptor.
        let name = unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned();
        Ok((
            Matmul {
                dnnl: self,
                primitive,
                memories,
            },
            name,
        ))
    }
}

impl Matmul<'_> {
    fn run(&self, a: &[bf16], b: &[bf16], c: &mut [f32]) {
        let f = &self.dnnl.f;
        let data = [
            a.as_ptr() as *mut c_void,
            b.as_ptr() as *mut c_void,
            c.as_mut_ptr().cast(),
        ];
        // SAFETY: the memories describe buffers of exactly these sizes; oneDNN reads `a` and
        // `b` and writes `c`.
        unsafe {
            for (memory, data) in self.memories.iter().zip(data) {
                check((f.memory_set_data_handle)(*memory, data), "data").unwrap();
            }
            let args = [ARG_SRC, ARG_WEIGHTS, ARG_DST]
                .iter()
                .zip(self.memories)
                .map(|(arg, memory)| ExecArg { arg: *arg, memory })
                .collect::<Vec<_>>();
            check(
                (f.execute)(self.primitive, self.dnnl.stream, 3, args.as_ptr()),
                "execute",
            )
            .unwrap();
            check((f.stream_wait)(self.dnnl.stream), "wait").unwrap();
        }
    }
}

/// A symbol's address as the function type it is declared with.
///
/// # Safety
///
/// `F` is a function pointer type matching the symbol's C signature.
unsafe fn function<F: Copy>(symbol: *mut c_void) -> F {
    assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
    // SAFETY: the caller's promise; both are one pointer.
    unsafe { std::mem::transmute_copy(&symbol) }
}

fn check(status: Status, what: &str) -> Result<(), String> {
    match status {
        SUCCESS => Ok(()),
        s => Err(format!("oneDNN {what}: status {s}")),
    }
}
