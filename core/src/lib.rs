//! kvmesh-core: everything the wasm filter and the native indexer must agree on, in one place.
//!
//! The filter's fallback pin and the indexer's session pin pick the same worker only because both
//! call [`rendezvous::pick`]; the indexer's block index matches Dynamo's only because it hashes with
//! [`hashing`]; the filter and the indexer read the same request the same way only because both
//! read it through [`openai::Body`]. Nothing here performs I/O, reads a clock or draws a random number, so
//! every function is deterministic and compiles for `wasm32-wasip1` as well as natively.

pub mod api;
pub mod body_base;
pub mod filter_config;
pub mod hashing;
pub mod headers;
pub mod json_edit;
pub mod models;
pub mod openai;
pub mod prom;
pub mod rendezvous;
pub mod router_metrics;
pub mod session;
pub mod usage;
