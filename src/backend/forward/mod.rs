//! The decorator's forwarding impls, one file per Burn ops trait, generated from Burn's own
//! trait definitions by `scripts/gen_forwarding.py` so that no method (defaulted ones included)
//! is missed or drifts when Burn is upgraded.

mod activation;
mod bool;
mod float;
mod int;
mod module;
mod quantized;
mod transaction;
