//! Tensor bytes over the kernels' recycled memory: a Flex tensor made of a kernel's output
//! gives its memory back for the next output of its size when dropped
//! (`burn_accelerate_kernels::recycle`), instead of to `malloc`, whose heap may hand it to the
//! kernel and map it afresh on the next step.
//!
//! Everything else is the native bytes' behaviour: Flex reads and writes them in place, and
//! `Bytes::try_into_vec` takes the memory out as a vector (detached: it is then freed as any
//! vector).

use std::mem::MaybeUninit;
use std::ptr::NonNull;

use burn::tensor::{AllocationProperty, Bytes};
use burn_accelerate_kernels::recycle::Allocation;
use cubecl_common::bytes::AllocationController;

/// `values` as a tensor's bytes whose memory is recycled when they are dropped.
pub(crate) fn bytes<T: bytemuck::Pod>(values: Vec<T>) -> Bytes {
    let allocation = Allocation::of(values);
    let len = allocation.len();
    // SAFETY: the allocation's first `len` bytes are the vector's values, written.
    unsafe { Bytes::from_controller(Box::new(Recycled(allocation)), len) }
}

struct Recycled(Allocation);

impl AllocationController for Recycled {
    fn alloc_align(&self) -> usize {
        self.0.align()
    }

    fn property(&self) -> AllocationProperty {
        AllocationProperty::Native
    }

    unsafe fn memory_mut(&mut self) -> &mut [MaybeUninit<u8>] {
        self.0.memory_mut()
    }

    fn memory(&self) -> &[MaybeUninit<u8>] {
        self.0.memory()
    }

    // The global allocator's block, of the layout `Bytes::try_into_vec` checks (the alignment
    // of the vector's values, its whole capacity), as the native controller's.
    fn try_detach(&mut self) -> Option<NonNull<u8>> {
        self.0.detach()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recycled_bytes_read_and_write_as_the_vectors_values() {
        let values: Vec<f32> = (0..100_000).map(|i| i as f32).collect();
        let mut bytes = bytes(values.clone());
        assert_eq!(bytes.len(), 400_000);
        assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes), values.as_slice());
        bytemuck::cast_slice_mut::<u8, f32>(&mut bytes)[7] = -1.0;
        let back: Vec<f32> = bytes.try_into_vec().expect("taken out without a copy");
        assert_eq!((back[6], back[7], back.len()), (6.0, -1.0, 100_000));
    }

    #[test]
    fn bytes_of_another_element_type_are_copied_out() {
        let bytes = bytes(vec![1u16; 100_000]);
        // u32 has another alignment than the u16 block: not detached, so still recycled.
        let bytes = bytes.try_into_vec::<u32>().expect_err("alignment differs");
        assert_eq!(bytes.len(), 200_000);
    }
}
