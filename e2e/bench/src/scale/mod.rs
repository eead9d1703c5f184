//! `kvmesh-bench scale` (issue 47, point 3): a thousand workers, one indexer.
//!
//! A synthetic fleet — not a thousand simulators — publishes vLLM KV events to one real
//! `kvmesh-indexer`: a seeded model of each engine's prefix cache ([`model`], pure) drives a
//! PUB/ROUTER socket pair per worker in the bench process ([`publish`], the simulator's encoder and
//! replay ring), and a loopback listener per worker answers the indexer's scrapes ([`engines`]).
//! [`run`] measures the indexer through its API, `/metrics` and `/proc` ([`procfs`]): start-up and
//! idle subscriptions, memory at several fill stages, apply throughput of prepared blasts, whole
//! routes of 8k continuations over the loaded index ([`probe`]), and the replay storm of fresh
//! replicas; [`report`] (pure) fits, renders and keeps the figures. Method and projection:
//! `e2e/bench/README.md` § Scale.

pub mod engines;
pub mod model;
pub mod probe;
pub mod procfs;
pub mod publish;
pub mod report;
pub mod run;
