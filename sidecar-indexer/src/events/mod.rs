//! KV event ingestion: decoding ([`decode`]), sequence tracking ([`sequencer`]), the rules for
//! applying a batch ([`apply`]) — all pure — and the ZMQ listeners and index applier ([`listener`],
//! [`applier`]), the thin threads that move bytes between sockets and the index.

pub mod applier;
pub mod apply;
pub mod decode;
pub mod listener;
pub mod sequencer;
