//! Router overhead: latency kvmesh adds against the same Envoy without it — through the wasm
//! filter and through the ext_proc endpoint picker — and the requests/s and CPU per request one
//! gateway spends on each way, measured in the same run.
//!
//! - `cases` (pure): the cases (size × cold/continuation) and the chat requests they send;
//! - `gateway` (pure): the kvmesh bootstrap plus a filter-less twin listener and an ext_proc
//!   listener, canned routes and an access log with Envoy's own per-request timestamps;
//! - `summary` (pure): samples → the report's rows (differences of same-run percentiles);
//! - `paths` (pure): the rows of both ways side by side, with the picker's targets;
//! - `hung` (pure): the hung-indexer case (SIGSTOP, breaker open, SIGCONT) judged against its
//!   targets and rendered;
//! - `drive` (I/O): tagged requests, the closed loop, reading the access log.
//!
//! The orchestrator (`kvmesh-bench overhead`) starts the stack and sequences them.

pub mod cases;
pub mod drive;
pub mod gateway;
pub mod hung;
pub mod summary;
