//! kvmesh-bench: the benchmark tooling of kvmesh.
//!
//! - Workloads: Mooncake trace replay (`trace`, `blocks`, `conversation`, `replay`) and a
//!   multi-turn text chat generator (`chat`, `chat_run`).
//! - The trace's intrinsic reuse ceiling (`ceiling`).
//! - Measurement: streaming client (`client`, `sse`), per-request records (`record`, `sink`).
//! - Counters scraped from engines and the gateway (`prom`, `counters`).
//! - The report: manifest in, Markdown + PNG plots out (`manifest`, `stats`, `report`).
//! - Router overhead against the same Envoy without the filter (`overhead`), and the indexer's
//!   microbenchmark figures as a report section (`micro`).
//! - How the `kvmesh-bench` subcommands' parts compose into one report (`parts`).
//! - NVIDIA's `aiperf` as an independent client of each policy's gateway (`aiperf`).
//! - A thousand workers, one indexer: a synthetic fleet's KV events against a real indexer
//!   (`scale`; pure: `scale::{model, probe, report}`).
//!
//! - The load sweep (`sweep`, issue 12): five workloads with their ceilings (`workload`), the
//!   schedule driver (`schedule_run`), machine CPU sampling (`cpu`), saturation search and validity.
//!
//! Pure modules (no I/O, injected RNG): `workload`, `sweep`, `trace`, `blocks`, `conversation`, `ceiling`, `rng`,
//! `sse`, `stats`, `prom`, `counters`, `chat`, `aiperf`, `record`, `manifest`, `parts`, `micro`,
//! `overhead::{cases, gateway, summary}`, `report::{summary, targets, markdown}`. I/O lives in
//! `cpu::Sampler`, `schedule_run`, `client`, `sink`, `replay`, `chat_run`, `overhead::drive`, `report::plots` and `report::generate`.

pub mod aiperf;
pub mod blocks;
pub mod ceiling;
pub mod chat;
pub mod chat_run;
pub mod client;
pub mod conversation;
pub mod counters;
pub mod cpu;
pub mod manifest;
pub mod micro;
pub mod overhead;
pub mod parts;
pub mod policy;
pub mod schedule_run;
pub use kvmesh_e2e::prom;
pub mod record;
pub mod replay;
pub mod report;
pub mod rng;
pub mod scale;
pub mod sink;
pub mod sse;
pub mod stats;
pub mod sweep;
pub mod trace;
pub mod workload;
