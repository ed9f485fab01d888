//! Accelerate-compatible data sharding.
//!
//! [`shard`] is the pure index arithmetic (which items each process sees, in which batches),
//! conformant with accelerate 1.16's `BatchSamplerShard`, `IterableDatasetShard` and
//! `DataLoaderDispatcher`, and tested on its own against golden vectors from the real library.

pub mod shard;
