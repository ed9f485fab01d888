//! MPI as the engine (feature `mpi`): the engine clusters already run. `mpirun` or `srun` start
//! the processes and MPI carries the bytes (Open MPI's or MPICH's collectives, on the cluster's
//! fabric), with no rendezvous and no ports of this crate.
//!
//! Calls go straight to MPI's C interface (`mpi::ffi`, rsmpi's bindings): rsmpi's safe layer
//! aborts on any error, and a failed call here must be a typed error with MPI's own message
//! (the communicators return errors: `MPI_ERRORS_RETURN`).
//!
//! - **Threads.** MPI is initialised with `MPI_THREAD_MULTIPLE`, and the level granted is
//!   checked: a `dispatch_batches` loader's threads wait in a receive while the training thread
//!   runs collectives, which a single funnelling thread could only serve by polling. A library
//!   without it is an error that says so.
//! - **Memory.** All-reduce and broadcast go in slices of [`SLICE`] bytes through a buffer of
//!   that size (rsmpi has no `MPI_IN_PLACE`), so any size works in bounded memory and MPI's
//!   32-bit counts are never exceeded. All-gather and reduce-scatter take one call, so a
//!   buffer over 2 GiB is refused with an error.
//! - **Half floats.** f16 and bf16 sums use MPI operations of their own (`MPI_Op_create`),
//!   adding in the element's type as the built-in engine does.
//! - **Streams** are point-to-point messages on a communicator of their own, tagged with their
//!   lane: a header (tag and length), then the payload in slices.
//! - **The end.** At exit the process finalises MPI; after a panic or a failed collective it
//!   aborts the job instead (`MPI_Abort`), since a finalise would wait for the others.

use std::ffi::{c_int, c_void};
use std::ops::Range;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

use mpi::ffi;

use super::tcp::frame::reserve_claimed;
use super::{Engine, Lane, Tag};
use crate::element::Element;
use crate::error::DistributedError;

/// The most bytes one MPI call carries for the sliced collectives.
pub(crate) const SLICE: usize = 16 << 20;

/// Set once a collective failed or the process panicked: the process then aborts the job at
/// exit instead of finalising.
static FAILED: AtomicBool = AtomicBool::new(false);

/// This process's MPI.
pub struct MpiEngine {
    rank: usize,
    /// The collectives' communicator.
    comm: Comm,
    /// The streams'.
    streams: Comm,
    half_sums: [Op; 2],
    /// The slice buffer (one collective at a time uses it: the group serialises them).
    scratch: Mutex<Vec<u8>>,
}

#[derive(Clone, Copy)]
struct Comm(ffi::MPI_Comm);
#[derive(Clone, Copy)]
struct Op(ffi::MPI_Op);

// MPI_THREAD_MULTIPLE (checked at initialisation) lets any thread use these handles.
unsafe impl Send for Comm {}
unsafe impl Sync for Comm {}
unsafe impl Send for Op {}
unsafe impl Sync for Op {}

/// MPI's answer to `call`, as an error naming it.
fn check(call: &'static str, code: c_int) -> Result<(), DistributedError> {
    if code == ffi::MPI_SUCCESS as c_int {
        return Ok(());
    }
    let mut text = vec![0u8; ffi::MPI_MAX_ERROR_STRING as usize + 1];
    let mut len: c_int = 0;
    // SAFETY: the buffer holds MPI_MAX_ERROR_STRING characters, as MPI_Error_string asks.
    unsafe { ffi::MPI_Error_string(code, text.as_mut_ptr().cast(), &mut len) };
    text.truncate(len.max(0) as usize);
    FAILED.store(true, Ordering::SeqCst);
    Err(DistributedError::Mpi {
        call,
        code,
        message: String::from_utf8_lossy(&text).into_owned(),
    })
}

impl MpiEngine {
    /// Initialises MPI and returns this process's engine, rank `rank` of `world_size` as the
    /// environment said, which MPI's own numbering must match.
    pub fn join(rank: usize, world_size: usize) -> Result<Self, DistributedError> {
        let mut provided: c_int = 0;
        // SAFETY: null argc/argv are allowed; called once (the group is joined once).
        let code = unsafe {
            ffi::MPI_Init_thread(
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                ffi::RSMPI_THREAD_MULTIPLE,
                &mut provided,
            )
        };
        check("MPI_Init_thread", code)?;
        install_exit_handlers();
        if provided < unsafe { ffi::RSMPI_THREAD_MULTIPLE } {
            FAILED.store(true, Ordering::SeqCst);
            return Err(DistributedError::Mpi {
                call: "MPI_Init_thread",
                code: provided,
                message: "this MPI library does not grant MPI_THREAD_MULTIPLE, which the \
                          process group needs (a loader's threads receive while training runs \
                          collectives): use an MPI built with thread support (Debian's Open MPI \
                          is)"
                .into(),
            });
        }
        let world = unsafe { ffi::RSMPI_COMM_WORLD };
        let dup = |what: &'static str| -> Result<Comm, DistributedError> {
            let mut comm = std::mem::MaybeUninit::uninit();
            // SAFETY: MPI is initialised; comm is written by MPI_Comm_dup.
            check(what, unsafe { ffi::MPI_Comm_dup(world, comm.as_mut_ptr()) })?;
            let comm = unsafe { comm.assume_init() };
            check("MPI_Comm_set_errhandler", unsafe {
                ffi::MPI_Comm_set_errhandler(comm, ffi::RSMPI_ERRORS_RETURN)
            })?;
            Ok(Comm(comm))
        };
        let comm = dup("MPI_Comm_dup")?;
        let streams = dup("MPI_Comm_dup")?;
        let (mut mpi_rank, mut mpi_size): (c_int, c_int) = (0, 0);
        check("MPI_Comm_rank", unsafe {
            ffi::MPI_Comm_rank(comm.0, &mut mpi_rank)
        })?;
        check("MPI_Comm_size", unsafe {
            ffi::MPI_Comm_size(comm.0, &mut mpi_size)
        })?;
        if (mpi_rank as usize, mpi_size as usize) != (rank, world_size) {
            return Err(DistributedError::Mpi {
                call: "MPI_Comm_rank",
                code: 0,
                message: format!(
                    "MPI says this is rank {mpi_rank} of {mpi_size}, the environment rank \
                     {rank} of {world_size}"
                ),
            });
        }
        let op = |f: ffi::MPI_User_function| -> Result<Op, DistributedError> {
            let mut op = std::mem::MaybeUninit::uninit();
            check("MPI_Op_create", unsafe {
                ffi::MPI_Op_create(f, 1, op.as_mut_ptr())
            })?;
            Ok(Op(unsafe { op.assume_init() }))
        };
        Ok(Self {
            rank,
            comm,
            streams,
            half_sums: [op(Some(sum_f16))?, op(Some(sum_bf16))?],
            scratch: Mutex::new(Vec::new()),
        })
    }

    // The MPI datatype and sum of `element`.
    fn sum_of(&self, element: Element) -> (ffi::MPI_Datatype, ffi::MPI_Op) {
        // SAFETY: reading MPI's constants once MPI is initialised.
        unsafe {
            let sum = ffi::RSMPI_SUM;
            match element {
                Element::Bytes | Element::U8 => (ffi::RSMPI_UINT8_T, sum),
                Element::F64 => (ffi::RSMPI_DOUBLE, sum),
                Element::F32 => (ffi::RSMPI_FLOAT, sum),
                Element::F16 => (ffi::RSMPI_UINT16_T, self.half_sums[0].0),
                Element::BF16 => (ffi::RSMPI_UINT16_T, self.half_sums[1].0),
                Element::I64 => (ffi::RSMPI_INT64_T, sum),
                Element::I32 => (ffi::RSMPI_INT32_T, sum),
                Element::I16 => (ffi::RSMPI_INT16_T, sum),
                Element::I8 => (ffi::RSMPI_INT8_T, sum),
                Element::U64 => (ffi::RSMPI_UINT64_T, sum),
                Element::U32 => (ffi::RSMPI_UINT32_T, sum),
                Element::U16 => (ffi::RSMPI_UINT16_T, sum),
            }
        }
    }

    fn scratch(&self, len: usize) -> std::sync::MutexGuard<'_, Vec<u8>> {
        let mut scratch = self.scratch.lock().unwrap_or_else(|e| e.into_inner());
        if scratch.len() < len {
            scratch.resize(len, 0);
        }
        scratch
    }
}

/// The count MPI takes, or an error for a buffer past its 32-bit counts.
fn count(bytes: usize, size: usize, call: &'static str) -> Result<c_int, DistributedError> {
    c_int::try_from(bytes / size).map_err(|_| DistributedError::Mpi {
        call,
        code: 0,
        message: format!(
            "{bytes} bytes in one call: past MPI's 32-bit counts (under MPI, all-gather and \
             reduce-scatter take at most 2^31 values per process)"
        ),
    })
}

impl Engine for MpiEngine {
    fn all_reduce(
        &self,
        _seq: u64,
        element: Element,
        data: &mut [u8],
    ) -> Result<(), DistributedError> {
        let (dtype, op) = self.sum_of(element);
        let slice = SLICE - SLICE % element.size();
        // One slice at a time through the scratch buffer (rsmpi has no MPI_IN_PLACE); an empty
        // buffer (a barrier) still makes one call, as every process does, on real pointers (an
        // empty slice's dangling one is Open MPI's MPI_IN_PLACE).
        let largest = slice.min(data.len());
        let mut scratch = self.scratch(largest + 2);
        let (send, spare) = scratch.split_at_mut(largest);
        let mut slices: Vec<&mut [u8]> = data.chunks_mut(slice).collect();
        if slices.is_empty() {
            slices.push(&mut spare[1..1]);
        }
        for part in slices {
            let send = &mut send[..part.len()];
            send.copy_from_slice(part);
            let n = count(part.len(), element.size(), "MPI_Allreduce")?;
            // SAFETY: both buffers hold n values of dtype and do not overlap.
            check("MPI_Allreduce", unsafe {
                ffi::MPI_Allreduce(
                    send.as_ptr().cast(),
                    part.as_mut_ptr().cast(),
                    n,
                    dtype,
                    op,
                    self.comm.0,
                )
            })?;
        }
        Ok(())
    }

    fn reduce_scatter(
        &self,
        _seq: u64,
        element: Element,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError> {
        let (dtype, op) = self.sum_of(element);
        let size = element.size();
        let counts = blocks
            .iter()
            .map(|b| count(b.len(), size, "MPI_Reduce_scatter"))
            .collect::<Result<Vec<_>, _>>()?;
        let own = blocks[self.rank].clone();
        let mut scratch = self.scratch(own.len());
        let received = &mut scratch[..own.len()];
        // SAFETY: data holds the sum of the counts' values, received this process's count.
        check("MPI_Reduce_scatter", unsafe {
            ffi::MPI_Reduce_scatter(
                data.as_ptr().cast(),
                received.as_mut_ptr().cast(),
                counts.as_ptr(),
                dtype,
                op,
                self.comm.0,
            )
        })?;
        data[own].copy_from_slice(received);
        Ok(())
    }

    fn all_gather(
        &self,
        _seq: u64,
        data: &mut [u8],
        blocks: &[Range<usize>],
    ) -> Result<(), DistributedError> {
        let counts = blocks
            .iter()
            .map(|b| count(b.len(), 1, "MPI_Allgatherv"))
            .collect::<Result<Vec<_>, _>>()?;
        let displacements = blocks
            .iter()
            .map(|b| count(b.start, 1, "MPI_Allgatherv"))
            .collect::<Result<Vec<_>, _>>()?;
        let own = blocks[self.rank].clone();
        let mut scratch = self.scratch(own.len());
        let send = &mut scratch[..own.len()];
        send.copy_from_slice(&data[own]);
        // SAFETY: the counts and displacements lie within data; send is its own buffer.
        check("MPI_Allgatherv", unsafe {
            ffi::MPI_Allgatherv(
                send.as_ptr().cast(),
                send.len() as c_int,
                ffi::RSMPI_UINT8_T,
                data.as_mut_ptr().cast(),
                counts.as_ptr(),
                displacements.as_ptr(),
                ffi::RSMPI_UINT8_T,
                self.comm.0,
            )
        })
    }

    fn broadcast(
        &self,
        _seq: u64,
        root: usize,
        data: &mut Vec<u8>,
    ) -> Result<(), DistributedError> {
        let mut len = (data.len() as u64).to_le_bytes();
        // SAFETY: 8 bytes from and into len.
        check("MPI_Bcast", unsafe {
            ffi::MPI_Bcast(
                len.as_mut_ptr().cast(),
                8,
                ffi::RSMPI_UINT8_T,
                root as c_int,
                self.comm.0,
            )
        })?;
        let len = usize::try_from(u64::from_le_bytes(len)).unwrap_or(usize::MAX);
        if self.rank != root {
            data.clear();
            data.try_reserve_exact(len)
                .map_err(|_| DistributedError::Mpi {
                    call: "MPI_Bcast",
                    code: 0,
                    message: format!("this process cannot hold a broadcast of {len} bytes"),
                })?;
            data.resize(len, 0);
        }
        for part in data.chunks_mut(SLICE) {
            // SAFETY: part is a slice of data, at most SLICE bytes.
            check("MPI_Bcast", unsafe {
                ffi::MPI_Bcast(
                    part.as_mut_ptr().cast(),
                    part.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    root as c_int,
                    self.comm.0,
                )
            })?;
        }
        Ok(())
    }

    fn send(
        &self,
        lane: Lane,
        to: usize,
        tag: Tag,
        payload: &[u8],
    ) -> Result<(), DistributedError> {
        let mut header = [0u8; 20];
        header[..8].copy_from_slice(&tag.0.to_le_bytes());
        header[8..12].copy_from_slice(&tag.1.to_le_bytes());
        header[12..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        let mpi_tag = lane_tag(lane);
        let send = |bytes: &[u8]| {
            // SAFETY: bytes is a live slice of at most SLICE bytes.
            check("MPI_Send", unsafe {
                ffi::MPI_Send(
                    bytes.as_ptr().cast(),
                    bytes.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    to as c_int,
                    mpi_tag,
                    self.streams.0,
                )
            })
        };
        send(&header)?;
        payload.chunks(SLICE).try_for_each(send)
    }

    fn recv(&self, lane: Lane, from: usize) -> Result<(Tag, Vec<u8>), DistributedError> {
        let mpi_tag = lane_tag(lane);
        let recv = |bytes: &mut [u8]| {
            // SAFETY: bytes is a live slice of at most SLICE bytes.
            check("MPI_Recv", unsafe {
                ffi::MPI_Recv(
                    bytes.as_mut_ptr().cast::<c_void>(),
                    bytes.len() as c_int,
                    ffi::RSMPI_UINT8_T,
                    from as c_int,
                    mpi_tag,
                    self.streams.0,
                    ffi::RSMPI_STATUS_IGNORE,
                )
            })
        };
        let mut header = [0u8; 20];
        recv(&mut header)?;
        let seq = u64::from_le_bytes(header[..8].try_into().expect("8 bytes"));
        let step = u32::from_le_bytes(header[8..12].try_into().expect("4 bytes"));
        let len = u64::from_le_bytes(header[12..].try_into().expect("8 bytes"));
        // Room as the slices arrive, not what the header claims: a wrong length costs at most
        // what the peer really sends (and the first reservation's cap).
        let mut payload = Vec::new();
        reserve_claimed(&mut payload, len)
            .map_err(|detail| DistributedError::Malformed { rank: from, detail })?;
        // `reserve_claimed` checked that it fits a usize.
        let total = usize::try_from(len).unwrap_or(usize::MAX);
        while payload.len() < total {
            let start = payload.len();
            payload.resize(start + SLICE.min(total - start), 0);
            recv(&mut payload[start..])?;
        }
        Ok(((seq, step), payload))
    }

    fn abort(&self, reason: String) {
        eprintln!(
            "burn-accelerate: process {} ends the MPI job: {reason}",
            self.rank
        );
        // SAFETY: MPI is initialised; MPI_Abort does not return.
        unsafe { ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1) };
    }
}

/// The MPI tag of a stream's lane (MPI guarantees tags up to 32767).
fn lane_tag(lane: Lane) -> c_int {
    (lane % 32_767) as c_int
}

// MPI's signature for an operation's function: inoutvec[i] = invec[i] + inoutvec[i].
unsafe extern "C" fn sum_f16(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _: *mut ffi::MPI_Datatype,
) {
    // SAFETY: MPI passes two buffers of *len values of the operation's datatype (2 bytes).
    unsafe { sum_halves(invec, inoutvec, *len, Element::F16) }
}

unsafe extern "C" fn sum_bf16(
    invec: *mut c_void,
    inoutvec: *mut c_void,
    len: *mut c_int,
    _: *mut ffi::MPI_Datatype,
) {
    // SAFETY: as sum_f16.
    unsafe { sum_halves(invec, inoutvec, *len, Element::BF16) }
}

unsafe fn sum_halves(invec: *mut c_void, inoutvec: *mut c_void, len: c_int, element: Element) {
    let bytes = len.max(0) as usize * 2;
    // SAFETY: the caller passes two distinct buffers of `bytes` bytes.
    let (other, acc) = unsafe {
        (
            std::slice::from_raw_parts(invec.cast::<u8>(), bytes),
            std::slice::from_raw_parts_mut(inoutvec.cast::<u8>(), bytes),
        )
    };
    element.add_assign(acc, other);
}

// At exit: finalise MPI after a run that went well, abort the job after a failure (a finalise
// would wait for processes that may never come).
fn install_exit_handlers() {
    extern "C" fn at_exit() {
        let mut finalized: c_int = 0;
        // SAFETY: MPI was initialised before this handler was registered.
        unsafe { ffi::MPI_Finalized(&mut finalized) };
        if finalized != 0 {
            return;
        }
        unsafe {
            if FAILED.load(Ordering::SeqCst) {
                ffi::MPI_Abort(ffi::RSMPI_COMM_WORLD, 1);
            } else {
                ffi::MPI_Finalize();
            }
        }
    }
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        FAILED.store(true, Ordering::SeqCst);
        previous(info);
    }));
    // SAFETY: registering a plain function with the C runtime.
    unsafe { nix::libc::atexit(at_exit) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_past_mpi_s_32_bits_are_refused() {
        assert_eq!(count(8, 4, "MPI_Allgatherv").unwrap(), 2);
        let err = count(1 << 33, 1, "MPI_Allgatherv").unwrap_err();
        assert!(
            err.to_string().contains("past MPI's 32-bit counts"),
            "{err}"
        );
    }
}
