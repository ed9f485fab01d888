//! The memory of the kernels' large outputs, kept when a tensor that held it is dropped and
//! handed to the next output of the same size, instead of going back to the C allocator.
//!
//! A training step allocates the same buffers every step (a weight's gradient widened to
//! f32, an activation rounded to bf16) and frees them at its end. glibc's `malloc` serves
//! large ones from the top of its heap, and `free` hands the top back to the kernel once more
//! than its trim threshold lies free there; whether a step's pattern crosses that line
//! depends on where other allocations happen to lie. Where it does, every step maps its
//! buffers afresh and the kernel zeroes each page on first touch: on the 2-core Zen 5 of
//! BENCHMARKS.md a user's MLP bf16 step then took 6.9 ms instead of 4.6, the same binary
//! switching between the two from one run to the next. (`MALLOC_TRIM_THRESHOLD_` fixes it
//! for a whole process, a choice this crate leaves to the program.)
//!
//! So an output's memory comes from [`vec_with_capacity`], and the tensor that holds it
//! gives it back when dropped ([`Allocation`], which the crate's Flex adapters wrap as a
//! tensor's bytes). Only blocks of [`MIN_BYTES`] or more are kept, at most [`MAX_HELD`] bytes
//! in all, the oldest freed first; a block is handed out again only for exactly its size and
//! alignment, as a step's buffers recur with their sizes. The values are never read from a
//! kept block: every output is written in full before it is read (the kernels' promise where
//! they allocate).

use std::alloc::Layout;
use std::collections::VecDeque;
use std::mem::{ManuallyDrop, MaybeUninit};
use std::ptr::NonNull;
use std::sync::Mutex;

/// The smallest block kept: smaller ones come from `malloc`'s own free lists, which it keeps.
pub const MIN_BYTES: usize = 64 << 10;
/// The most memory kept for reuse at any time.
pub const MAX_HELD: usize = 256 << 20;
/// The most blocks kept.
const MAX_BLOCKS: usize = 64;

// A block of the global allocator's, of `layout`, that no one uses.
struct Block {
    ptr: NonNull<u8>,
    layout: Layout,
}

// SAFETY: a kept block is memory no one else points to; whichever thread takes it owns it.
unsafe impl Send for Block {}

impl Block {
    fn free(self) {
        // SAFETY: the global allocator allocated `ptr` with `layout`, and no one uses it.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

// The blocks kept, the oldest first, and their bytes in all.
struct Kept {
    blocks: VecDeque<Block>,
    bytes: usize,
}

static KEPT: Mutex<Kept> = Mutex::new(Kept {
    blocks: VecDeque::new(),
    bytes: 0,
});

fn kept() -> std::sync::MutexGuard<'static, Kept> {
    // A panic while the lock was held left the list whole (every change is one push or pop).
    KEPT.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// An empty vector with room for exactly `len` values: a kept block of that size where there
/// is one, a new allocation otherwise. Its values are to be written before they are read.
///
/// ```
/// use burn_accelerate_kernels::recycle::{Allocation, vec_with_capacity};
///
/// let mut values = vec_with_capacity::<f32>(1 << 16);
/// values.resize(1 << 16, 1.0);
/// let ptr = values.as_ptr();
/// drop(Allocation::of(values)); // a tensor's bytes, dropped
/// assert_eq!(vec_with_capacity::<f32>(1 << 16).as_ptr(), ptr);
/// ```
pub fn vec_with_capacity<T: bytemuck::Pod>(len: usize) -> Vec<T> {
    let Ok(layout) = Layout::array::<T>(len) else {
        return Vec::with_capacity(len);
    };
    if layout.size() >= MIN_BYTES {
        let mut kept = kept();
        if let Some(i) = kept.blocks.iter().rposition(|b| b.layout == layout)
            && let Some(block) = kept.blocks.remove(i)
        {
            kept.bytes -= layout.size();
            drop(kept);
            // SAFETY: the global allocator allocated the block with `Layout::array::<T>(len)`,
            // which is what a `Vec<T>` of capacity `len` deallocates with; no one else holds it.
            return unsafe { Vec::from_raw_parts(block.ptr.as_ptr().cast(), 0, len) };
        }
    }
    Vec::with_capacity(len)
}

// Keeps the block, or frees it where it is small or the kept ones are too many.
fn keep(block: Block) {
    if block.layout.size() < MIN_BYTES || block.layout.size() > MAX_HELD {
        return block.free();
    }
    let mut evicted = Vec::new();
    {
        let mut kept = kept();
        while kept.bytes + block.layout.size() > MAX_HELD || kept.blocks.len() >= MAX_BLOCKS {
            let Some(oldest) = kept.blocks.pop_front() else {
                break;
            };
            kept.bytes -= oldest.layout.size();
            evicted.push(oldest);
        }
        kept.bytes += block.layout.size();
        kept.blocks.push_back(block);
    }
    // Outside the lock: `free` may hand memory back to the kernel.
    evicted.into_iter().for_each(Block::free);
}

/// The memory of a vector, as a tensor's bytes hold it: given back for reuse when dropped
/// (see the [module](self)), unless [`detach`](Self::detach)ed.
pub struct Allocation {
    // `None` once detached.
    block: Option<Block>,
    // Bytes of values written (the vector's length), at the start of the block.
    len: usize,
}

// SAFETY: the allocation owns its block, as a `Vec` owns its buffer.
unsafe impl Send for Allocation {}
unsafe impl Sync for Allocation {}

impl Allocation {
    /// The memory of `values`, its first `values.len()` values written.
    pub fn of<T: bytemuck::Pod>(values: Vec<T>) -> Self {
        let len = std::mem::size_of_val(values.as_slice());
        let values = ManuallyDrop::new(values);
        let layout = Layout::array::<T>(values.capacity()).expect("a vector's layout");
        let block = match layout.size() {
            // No allocation behind it (capacity 0): nothing to give back.
            0 => None,
            // SAFETY (of `new_unchecked`): a vector with capacity has a non-null buffer.
            _ => Some(Block {
                ptr: unsafe { NonNull::new_unchecked(values.as_ptr() as *mut u8) },
                layout,
            }),
        };
        if block.is_none() {
            drop(ManuallyDrop::into_inner(values));
        }
        Self { block, len }
    }

    /// Bytes written.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no byte is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The alignment of its block (that of the vector's values).
    pub fn align(&self) -> usize {
        self.block.as_ref().map_or(1, |b| b.layout.align())
    }

    /// The whole block, written or not.
    pub fn memory(&self) -> &[MaybeUninit<u8>] {
        match &self.block {
            // SAFETY: the block is `layout.size()` bytes, owned by this allocation.
            Some(b) => unsafe {
                std::slice::from_raw_parts(b.ptr.as_ptr().cast(), b.layout.size())
            },
            None => &[],
        }
    }

    /// The whole block, to write.
    pub fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        match &mut self.block {
            // SAFETY: as for `memory`, and `&mut self` makes this the only view.
            Some(b) => unsafe {
                std::slice::from_raw_parts_mut(b.ptr.as_ptr().cast(), b.layout.size())
            },
            None => &mut [],
        }
    }

    /// The block's start, which the caller now owns (to free with the block's layout: the
    /// vector's it came from), and which this allocation will no longer give back.
    pub fn detach(&mut self) -> Option<NonNull<u8>> {
        self.block.take().map(|b| b.ptr)
    }
}

impl Drop for Allocation {
    fn drop(&mut self) {
        if let Some(block) = self.block.take() {
            keep(block);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Sizes no other test (or doc test) uses, so that tests running at once do not take each
    // other's blocks; and these tests one at a time, as one of them fills the list.
    const LEN: usize = (MIN_BYTES / 4) + 1234;
    static SERIAL: Mutex<()> = Mutex::new(());

    fn serial() -> std::sync::MutexGuard<'static, ()> {
        SERIAL
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    #[test]
    fn a_dropped_allocation_is_handed_out_again_for_its_size_and_alignment_only() {
        let _serial = serial();
        let mut values = vec_with_capacity::<f32>(LEN);
        values.resize(LEN, 2.0);
        let ptr = values.as_ptr() as usize;
        let allocation = Allocation::of(values);
        assert_eq!((allocation.len(), allocation.align()), (LEN * 4, 4));
        drop(allocation);
        // Another size, or the same bytes as another type: not this block.
        let (longer, other_type) = (
            vec_with_capacity::<f32>(LEN + 1),
            vec_with_capacity::<u16>(LEN * 2),
        );
        assert_ne!(longer.as_ptr() as usize, ptr);
        assert_ne!(other_type.as_ptr() as usize, ptr);
        let again = vec_with_capacity::<f32>(LEN);
        assert_eq!(
            (again.as_ptr() as usize, again.len(), again.capacity()),
            (ptr, 0, LEN)
        );
        // Taken: not handed out twice.
        let twice = vec_with_capacity::<f32>(LEN);
        assert_ne!(twice.as_ptr() as usize, ptr);
    }

    #[test]
    fn small_blocks_go_back_to_the_allocator() {
        let _serial = serial();
        let values = vec![1u8; MIN_BYTES - 1];
        let bytes = kept().bytes;
        drop(Allocation::of(values));
        // Nothing kept (other tests may keep blocks meanwhile, never one of this size).
        assert!(
            !kept()
                .blocks
                .iter()
                .any(|b| b.layout.size() == MIN_BYTES - 1),
            "{bytes}"
        );
    }

    #[test]
    fn at_most_max_held_bytes_are_kept() {
        let _serial = serial();
        let len = MAX_HELD / 3 + 4096 * 3;
        for _ in 0..4 {
            drop(Allocation::of(vec![0u8; len]));
        }
        let kept = kept();
        assert!(kept.bytes <= MAX_HELD, "{} bytes kept", kept.bytes);
        assert_eq!(
            kept.bytes,
            kept.blocks.iter().map(|b| b.layout.size()).sum::<usize>()
        );
    }

    #[test]
    fn a_detached_allocation_is_not_kept() {
        let _serial = serial();
        let len = LEN + 77;
        let mut allocation = Allocation::of(vec![3u32; len]);
        let ptr = allocation.detach().unwrap();
        drop(allocation);
        // The caller owns it: as a vector again, freed by it.
        let values = unsafe { Vec::from_raw_parts(ptr.as_ptr().cast::<u32>(), len, len) };
        assert!(values.iter().all(|v| *v == 3));
        assert!(!kept().blocks.iter().any(|b| b.ptr == ptr));
    }

    #[test]
    fn an_empty_vector_has_no_block() {
        let _serial = serial();
        let allocation = Allocation::of(Vec::<f32>::new());
        assert!(allocation.is_empty() && allocation.memory().is_empty());
    }
}
