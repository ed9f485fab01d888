//! # burn-accelerate-comm
//!
//! The bytes-and-processes layer under [burn-accelerate](https://crates.io/crates/burn-accelerate)'s
//! process group, with no Burn in it: what a launcher and the processes of a run need to find
//! each other and move buffers, whatever tensor library sits above.
//!
//! - [`engine`]: what carries the bytes: the built-in TCP ring ([`engine::TcpEngine`]: framing,
//!   connections, the authenticated handshake, liveness, the ring's collectives) or MPI (feature
//!   `mpi`), behind one [`engine::Engine`] trait.
//! - [`ProcessLayout`]: which process of a run this is (Accelerate's `PartialState`), read
//!   from the variables a launcher sets (this crate's, torchrun's, `srun`'s, `mpirun`'s).
//! - [`rendezvous`]: where the processes of a run meet ([`Rendezvous`], [`serve_rendezvous`]).
//! - [`membership`]: elastic machine counts, which machines take part in each attempt.
//! - [`RunSecret`]: what every connection of a run proves it knows.
//! - [`env`](mod@env): the variables a launcher gives each process; [`Element`]: what a reducing
//!   collective adds; [`DistributedError`]: every failure, saying what to change.
//!
//! burn-accelerate's `distributed` module re-exports all of it, and builds the process group,
//! the tensor collectives and the gradient sync on it; the launcher (`burn-accelerate-launch`)
//! uses it without Burn.
//!
//! ```
//! use burn_accelerate_comm::RunSecret;
//!
//! let secret = RunSecret::from_text("my run");
//! assert_eq!(secret.attempt(), 0);
//! assert_eq!(secret.for_attempt(2).attempt(), 2);
//! ```

pub mod element;
pub mod engine;
pub mod env;
pub mod error;
#[cfg(test)]
mod fuzz;
pub mod layout;
#[cfg(test)]
mod loopback;
pub mod membership;
pub mod rendezvous;
pub mod secret;

pub use element::{Element, Reducible};
pub use error::DistributedError;
pub use layout::ProcessLayout;
pub use rendezvous::{Rendezvous, RendezvousHost, restart_count, serve_rendezvous};
pub use secret::RunSecret;
