//! kvmesh-sim: `vllm-sim`, a vLLM-compatible engine simulator.
//!
//! Faithful at the interfaces a router sees — the OpenAI API, a paged prefix cache with LRU
//! eviction, KV events over ZeroMQ in vLLM's wire format with a replay socket, vLLM's metric
//! names, NIXL `kv_transfer_params` semantics and fault injection — and cheap everywhere else.
//!
//! Shape: the cache ([`pool`], with its CPU offload tier [`offload`] and a hybrid model's
//! sliding-window group [`window`]) and the scheduler
//! ([`sched`]) are pure (`step(now) -> work`,
//! clock passed in); one task ([`engine`]) drives them; events leave through an
//! [`events::EventSink`] (in memory in tests, ZeroMQ in the binary, [`publisher`]); HTTP
//! ([`api`], [`server`]) only moves data to and from the engine; [`app`] wires it together.

pub mod api;
pub mod app;
pub mod config;
pub mod engine;
pub mod events;
pub mod faults;
pub mod free_queue;
pub mod hash;
pub mod lora;
pub mod media;
pub mod metrics;
pub mod nixl;
pub mod offload;
pub mod output;
pub mod pool;
pub mod publisher;
pub mod sched;
pub mod server;
pub mod timing;
pub mod window;
pub mod wire;
