//! kvmesh-discovery: the workers of a model Service (from Kubernetes EndpointSlices) or of a Gateway
//! API Inference Extension InferencePool (its selector's pods × its target ports).
//!
//! Besides the static fleet file, the indexer can follow a Service: every ready pod behind it is a
//! worker, its role read from a pod label, its HTTP endpoint from the slice (address + named port),
//! its KV-event and replay sockets from the pod IP and configured ports. Or it follows an
//! InferencePool: every pod its selector picks is a worker per target port (data-parallel ranks).
//! Discovery flaps, so a pod that vanishes is unroutable at once but keeps its index for a grace
//! period ([`membership`]).
//!
//! Shape: everything that decides is pure and clock-injected — [`objects`] (list/watch semantics),
//! [`view`] (slices + pods → workers), [`pool`] (an InferencePool + pods → workers), [`membership`]
//! (grace periods), [`tracker`] (them together). [`watcher`] is the only module with I/O: two
//! kube-rs watches and a bounded channel.
//! Tests drive the pure part with recorded API responses and the watcher with a fake API server
//! replaying the same recordings.

pub mod config;
pub mod membership;
pub mod objects;
pub mod pool;
pub mod tracker;
pub mod view;
pub mod watcher;

pub use config::{ConfigError, DiscoveryConfig, PortRef};
pub use kube::Client;
pub use membership::{Change, MemberStatus, Membership};
pub use objects::{ObjectEvent, ObjectSet};
pub use pool::PoolSpec;
pub use tracker::{MembershipUpdate, PoolState, Tracker};
pub use view::{DiscoveredWorker, Observed, SkipReason, Skipped, View};
pub use watcher::{default_client, spawn, spawn_reporting, DiscoveryError, Problem};
