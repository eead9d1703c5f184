//! kvmesh-indexer: the sidecar that knows which worker holds which KV blocks.
//!
//! It consumes every engine's KV events (ZMQ, vLLM wire format), keeps a block index keyed by
//! Dynamo-compatible chain hashes, tokenizes prompts exactly as the engines do, and answers the wasm
//! filter's `/v1/route` with a scored decision. Layout: pure logic in [`config`], [`index`],
//! [`events`] (decode, sequencer, apply), [`tokenize`], [`decide`], [`predict`], [`speculative`], [`load`], [`recent`], [`approx`] (all three on one [`expiring`] map), [`scrape`], [`discovered`];
//! the thin shells that do I/O in [`events::listener`], [`events::applier`], [`state`], [`route`] (a route call: prompt → plan → run → settle; bookings and per-route metrics each in one module), [`http`],
//! [`service`] (the one owner of fleet changes, with its child [`service::discovery`]); their time and randomness come from [`clock`]. Guardrails (README): `decide` is pure; no lock is held across `.await`; an unknown
//! parent is counted and refused, never guessed; every queue, map, cache and body is bounded.

pub mod approx;
pub mod catalog;
pub mod clock;
pub mod config;
pub mod decide;
pub mod discovered;
pub mod epp;
pub mod events;
pub mod expiring;
pub mod http;
pub mod index;
pub mod legs;
pub mod load;
pub mod metrics;
pub mod predict;
pub mod recent;
pub mod route;
pub mod scrape;
pub mod service;
pub mod speculative;
pub mod state;
pub mod tokenize;
