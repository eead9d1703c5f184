//! Fault injection: what is currently broken, and how an admin patch changes it.
//!
//! One `Faults` value is the whole state (`GET /admin/faults` returns it); start-up flags build
//! the initial value and `POST /admin/faults` applies a [`FaultPatch`] (only the fields present
//! change; `null` clears an optional fault; `"clear": true` resets everything first). Vanishing
//! is an action, not a state: a patch may carry `vanish_ms`, which the server executes.
//! Shared through [`FaultState`], a mutex held only for the few instructions of a read or a
//! patch (never across an await).

use std::str::FromStr;

use parking_lot::Mutex;
use serde::{Deserialize, Deserializer, Serialize};

/// A half-open range of KV-event sequence numbers `[start, end)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SeqRange {
    /// First sequence number dropped.
    pub start: u64,
    /// First sequence number after the range.
    pub end: u64,
}

impl SeqRange {
    /// True if `seq` is in the range.
    pub fn contains(&self, seq: u64) -> bool {
        self.start <= seq && seq < self.end
    }
}

impl FromStr for SeqRange {
    type Err = String;
    /// `START..END` (half-open).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (a, b) = s.split_once("..").ok_or_else(|| format!("`{s}` is not START..END"))?;
        let start = a.trim().parse().map_err(|e| format!("start of `{s}`: {e}"))?;
        let end = b.trim().parse().map_err(|e| format!("end of `{s}`: {e}"))?;
        let r = SeqRange { start, end };
        if r.start > r.end {
            return Err(format!("`{s}`: start after end"));
        }
        Ok(r)
    }
}

/// The injected faults in force.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Faults {
    /// Fail prefill-leg requests (`kv_transfer_params.do_remote_decode: true`) with this status.
    pub fail_prefill_status: Option<u16>,
    /// Fail migration-source requests (`kv_migration_source: true`) with this status.
    pub fail_migration_source_status: Option<u16>,
    /// Fail this many of the next OpenAI requests…
    pub fail_next_count: u64,
    /// …with this status.
    pub fail_next_status: u16,
    /// Added before every OpenAI request is queued, in real milliseconds (not divided by speedup).
    pub extra_latency_ms: u64,
    /// Discard KV events instead of publishing them (not numbered, not kept for replay).
    pub pause_events: bool,
    /// Sequence numbers numbered and kept for replay but not sent on the PUB socket.
    pub drop_seqs: Option<SeqRange>,
    /// Answer `GET /metrics` with this status (a scrape that fails while the engine serves).
    pub fail_metrics_status: Option<u16>,
    /// Fail requests that pulled KV from a producer (`do_remote_prefill`) with this status, after
    /// the pull (the producer's hold is spent: a retry elsewhere cannot pull it again).
    pub fail_after_pull_status: Option<u16>,
}

impl Default for Faults {
    fn default() -> Self {
        Self {
            fail_prefill_status: None,
            fail_migration_source_status: None,
            fail_next_count: 0,
            fail_next_status: 500,
            extra_latency_ms: 0,
            pause_events: false,
            drop_seqs: None,
            fail_metrics_status: None,
            fail_after_pull_status: None,
        }
    }
}

/// A change to the faults (`POST /admin/faults` body).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FaultPatch {
    /// Reset every fault to its default before applying the rest.
    #[serde(default)]
    pub clear: bool,
    /// See [`Faults::fail_prefill_status`]; `null` clears.
    #[serde(default, deserialize_with = "nullable")]
    pub fail_prefill_status: Option<Option<u16>>,
    /// See [`Faults::fail_migration_source_status`]; `null` clears.
    #[serde(default, deserialize_with = "nullable")]
    pub fail_migration_source_status: Option<Option<u16>>,
    /// See [`Faults::fail_next_count`].
    pub fail_next_count: Option<u64>,
    /// See [`Faults::fail_next_status`].
    pub fail_next_status: Option<u16>,
    /// See [`Faults::extra_latency_ms`].
    pub extra_latency_ms: Option<u64>,
    /// See [`Faults::pause_events`].
    pub pause_events: Option<bool>,
    /// See [`Faults::drop_seqs`]; `null` clears.
    #[serde(default, deserialize_with = "nullable")]
    pub drop_seqs: Option<Option<SeqRange>>,
    /// See [`Faults::fail_metrics_status`]; `null` clears.
    #[serde(default, deserialize_with = "nullable")]
    pub fail_metrics_status: Option<Option<u16>>,
    /// See [`Faults::fail_after_pull_status`]; `null` clears.
    #[serde(default, deserialize_with = "nullable")]
    pub fail_after_pull_status: Option<Option<u16>>,
    /// Close the HTTP listener and every connection for this many ms, then listen again on the
    /// same port (an action; not part of the state).
    pub vanish_ms: Option<u64>,
}

/// Distinguishes an absent field (`None`) from an explicit `null` (`Some(None)`).
fn nullable<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// An invalid patch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FaultError {
    /// A status outside 400..=599.
    #[error("{field} must be an HTTP error status (400..=599), got {value}")]
    Status {
        /// Offending field.
        field: &'static str,
        /// Its value.
        value: u16,
    },
    /// `drop_seqs.start > drop_seqs.end`.
    #[error("drop_seqs: start {start} is after end {end}")]
    Range {
        /// Start.
        start: u64,
        /// End.
        end: u64,
    },
}

fn status(field: &'static str, value: u16) -> Result<u16, FaultError> {
    if (400..=599).contains(&value) {
        Ok(value)
    } else {
        Err(FaultError::Status { field, value })
    }
}

impl Faults {
    /// Applies `patch` atomically: on error nothing changes.
    pub fn apply(&mut self, patch: &FaultPatch) -> Result<(), FaultError> {
        let mut next = if patch.clear { Faults::default() } else { self.clone() };
        if let Some(v) = patch.fail_prefill_status {
            next.fail_prefill_status = v.map(|s| status("fail_prefill_status", s)).transpose()?;
        }
        if let Some(v) = patch.fail_migration_source_status {
            next.fail_migration_source_status =
                v.map(|s| status("fail_migration_source_status", s)).transpose()?;
        }
        if let Some(v) = patch.fail_next_count {
            next.fail_next_count = v;
        }
        if let Some(v) = patch.fail_next_status {
            next.fail_next_status = status("fail_next_status", v)?;
        }
        if let Some(v) = patch.extra_latency_ms {
            next.extra_latency_ms = v;
        }
        if let Some(v) = patch.pause_events {
            next.pause_events = v;
        }
        if let Some(v) = patch.drop_seqs {
            if let Some(r) = v {
                if r.start > r.end {
                    return Err(FaultError::Range { start: r.start, end: r.end });
                }
            }
            next.drop_seqs = v;
        }
        if let Some(v) = patch.fail_metrics_status {
            next.fail_metrics_status = v.map(|s| status("fail_metrics_status", s)).transpose()?;
        }
        if let Some(v) = patch.fail_after_pull_status {
            next.fail_after_pull_status =
                v.map(|s| status("fail_after_pull_status", s)).transpose()?;
        }
        *self = next;
        Ok(())
    }

    /// Consumes one of the "fail next N" failures, returning its status.
    pub fn take_fail_next(&mut self) -> Option<u16> {
        if self.fail_next_count == 0 {
            return None;
        }
        self.fail_next_count -= 1;
        Some(self.fail_next_status)
    }
}

/// The faults shared by the HTTP handlers and the event publisher.
#[derive(Debug, Default)]
pub struct FaultState {
    inner: Mutex<Faults>,
}

impl FaultState {
    /// Starts with `faults`.
    pub fn new(faults: Faults) -> Self {
        Self { inner: Mutex::new(faults) }
    }

    /// A copy of the current faults.
    pub fn get(&self) -> Faults {
        self.inner.lock().clone()
    }

    /// Applies a patch; returns the new state.
    pub fn apply(&self, patch: &FaultPatch) -> Result<Faults, FaultError> {
        let mut f = self.inner.lock();
        f.apply(patch)?;
        Ok(f.clone())
    }

    /// See [`Faults::take_fail_next`].
    pub fn take_fail_next(&self) -> Option<u16> {
        self.inner.lock().take_fail_next()
    }

    /// What the publisher needs per batch: paused?, and the drop range.
    pub fn events_view(&self) -> (bool, Option<SeqRange>) {
        let f = self.inner.lock();
        (f.pause_events, f.drop_seqs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn patch(json: &str) -> Result<FaultPatch, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn patches_change_only_what_they_name() {
        let mut f = Faults::default();
        f.apply(&patch(r#"{"fail_prefill_status":503,"extra_latency_ms":20}"#).unwrap()).unwrap();
        f.apply(
            &patch(
                r#"{"drop_seqs":{"start":3,"end":5},"fail_next_count":2,"fail_next_status":429}"#,
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(f.fail_prefill_status, Some(503));
        assert_eq!(f.extra_latency_ms, 20);
        assert_eq!(f.drop_seqs, Some(SeqRange { start: 3, end: 5 }));
        assert_eq!(
            (f.take_fail_next(), f.take_fail_next(), f.take_fail_next()),
            (Some(429), Some(429), None)
        );
        f.apply(&patch(r#"{"fail_prefill_status":null,"drop_seqs":null}"#).unwrap()).unwrap();
        assert_eq!((f.fail_prefill_status, f.drop_seqs, f.extra_latency_ms), (None, None, 20));
        f.apply(&patch(r#"{"fail_metrics_status":503,"fail_after_pull_status":500}"#).unwrap())
            .unwrap();
        assert_eq!((f.fail_metrics_status, f.fail_after_pull_status), (Some(503), Some(500)));
        f.apply(&patch(r#"{"clear":true,"pause_events":true}"#).unwrap()).unwrap();
        assert_eq!(f, Faults { pause_events: true, ..Faults::default() });
    }

    #[test]
    fn invalid_patches_change_nothing() {
        let mut f = Faults::default();
        for (json, want) in [
            (
                r#"{"extra_latency_ms":5,"fail_prefill_status":200}"#,
                FaultError::Status { field: "fail_prefill_status", value: 200 },
            ),
            (
                r#"{"fail_next_status":999}"#,
                FaultError::Status { field: "fail_next_status", value: 999 },
            ),
            (r#"{"drop_seqs":{"start":5,"end":3}}"#, FaultError::Range { start: 5, end: 3 }),
        ] {
            assert_eq!(f.apply(&patch(json).unwrap()), Err(want));
        }
        assert_eq!(f, Faults::default());
        assert!(patch(r#"{"no_such_fault":1}"#).is_err());
    }

    #[test]
    fn seq_ranges() {
        let r: SeqRange = "3..5".parse().unwrap();
        assert!(!r.contains(2) && r.contains(3) && r.contains(4) && !r.contains(5));
        assert!("5..3".parse::<SeqRange>().is_err());
        assert!("x".parse::<SeqRange>().is_err());
    }
}
