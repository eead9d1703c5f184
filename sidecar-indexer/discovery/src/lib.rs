//! kvmesh-discovery: the workers of a model Service, from Kubernetes EndpointSlices.
//!
//! Besides the static fleet file, the indexer can follow a Service: every ready pod behind it is a
//! worker, its role read from a pod label, its HTTP endpoint from the slice (address + named port),
//! its KV-event and replay sockets from the pod IP and configured ports. Discovery flaps, so a pod
//! that vanishes is unroutable at once but keeps its index for a grace period ([`membership`]).
//!
//! Shape: everything that decides is pure and clock-injected — [`objects`] (list/watch semantics),
//! [`view`] (slices + pods → workers), [`membership`] (grace periods), [`tracker`] (the three
//! together). [`watcher`] is the only module with I/O: two kube-rs watches and a bounded channel.
//! Tests drive the pure part with recorded API responses and the watcher with a fake API server
//! replaying the same recordings.

pub mod config;
pub mod membership;
pub mod objects;
pub mod tracker;
pub mod view;
pub mod watcher;

pub use config::{ConfigError, DiscoveryConfig, PortRef};
pub use membership::{Change, MemberStatus, Membership};
pub use objects::{ObjectEvent, ObjectSet};
pub use tracker::{MembershipUpdate, Tracker};
pub use view::{DiscoveredWorker, Observed, SkipReason, Skipped, View};
pub use watcher::{default_client, spawn, DiscoveryError};
