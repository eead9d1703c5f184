//! KV event ingestion: decoding ([`decode`]), framing ([`frames`]), sequence tracking
//! ([`sequencer`]), the rules for applying a batch ([`apply`]), the msgpack reader ([`msgpack`])
//! and byte bounds ([`budget`]) — all pure but the budget's wait — and the ZMQ listeners and index
//! applier ([`listener`], [`applier`]), the thin threads that move bytes between sockets and the
//! index, with the counters they share ([`stats`]) and the socket monitor that tells when libzmq
//! gave a connection up ([`watch`]).

pub mod applier;
pub mod apply;
pub mod budget;
pub mod decode;
pub mod extra_keys;
pub mod frames;
pub mod listener;
pub mod msgpack;
pub mod sequencer;
pub mod stats;
pub mod watch;
