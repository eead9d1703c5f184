//! kvmesh-e2e: start real kvmesh stacks on loopback and talk to them.
//!
//! Every test and benchmark that needs Envoy, the indexer and simulated workers goes through
//! [`stack::Stack`]: it starts the processes on free ports, waits for each to say it is ready,
//! writes one fleet description that both the indexer and the Envoy bootstrap are made from, and
//! kills everything it started when dropped — also when the test panics. Waiting is always polling
//! with a deadline ([`poll`]), never a fixed sleep.

pub mod client;
pub mod envoy_config;
pub mod poll;
pub mod procs;
pub mod prom;
pub mod prometheus;
pub mod stack;
pub mod vllm;
