//! The route call's body base: a prefix of a long chat body the indexer holds (its body memo) and
//! names in its answer, so the filter's next `/v1/route` call for that conversation sends only the
//! bytes after it. Without it every turn of a 48k-token conversation carried its whole ~200 KB body
//! out of the VM, through Envoy's HTTP client and the loopback, into the indexer's HTTP stack, a
//! cost that grew with the conversation, not the turn (issue 16.3; the overhead bench's 48k
//! shared-prefix case: added p50 1.98 / 1.95 ms without, 1.85 / 1.76 ms with).
//!
//! The protocol, both sides in this one place:
//! * a `200` answer may carry [`RouteDecision::body_base`](crate::api::RouteDecision): the indexer
//!   kept the request body's first [`BodyBase::len`] bytes, whose XXH3-128 is [`BodyBase::hash`];
//! * a later call whose body starts with exactly those bytes ([`BodyBase::prefixes`]) may send only
//!   the rest, naming the base in [`crate::headers::KVMESH_BODY_BASE`];
//! * the indexer answers such a call as it would the whole body, or `409` with reason
//!   [`BASE_UNKNOWN`] when it does not hold the base for the call's session (evicted, restarted, or
//!   kept for another session: a base belongs to the session it was kept for): the caller then
//!   sends the whole body (memo churn: one more route call, counted on both sides). Never a wrong
//!   body: the indexer serves a base only if the name's key, length and hash are those of bytes it
//!   holds for that session, and the filter sends a delta only after hashing its body's own first
//!   `len` bytes to the same value;
//! * both sides resume their read of the body at the base's end rather than reading what they
//!   read before: the indexer from the prefix it held, the filter's scan from the base's end
//!   ([`crate::openai::Body`]). The README of `kvmesh-core` has the protocol in prose.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Bodies shorter than this have no base: the indexer reads them whole, keeps none, and the filter
/// sends them whole (their read costs microseconds).
pub const MIN_BODY_BYTES: usize = 8 * 1024;

/// The `reason` of the indexer's `409` to a call whose base it does not hold.
pub const BASE_UNKNOWN: &str = "body_base_unknown";

/// The status of that answer.
pub const BASE_UNKNOWN_STATUS: u16 = 409;

/// Bytes of a body held by the indexer: which memo entry, how many bytes, their XXH3-128.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct BodyBase {
    /// The indexer's memo key for the entry (opaque to the filter).
    pub memo_key: u64,
    pub len: usize,
    pub hash: u128,
}

impl BodyBase {
    /// The base naming `prefix` (all of it) under `memo_key`.
    pub fn of(memo_key: u64, prefix: &[u8]) -> Self {
        Self { memo_key, len: prefix.len(), hash: hash(prefix) }
    }

    /// Whether `body` starts with this base's bytes and goes on past them (a delta is not empty).
    /// Hashes `body`'s first [`Self::len`] bytes.
    pub fn prefixes(&self, body: &[u8]) -> bool {
        body.len() > self.len && body.get(..self.len).is_some_and(|p| hash(p) == self.hash)
    }
}

/// The hash bases are named by: XXH3-128, seed 0 (~20 µs for 200 KB in V8, ~5 µs natively).
pub fn hash(bytes: &[u8]) -> u128 {
    twox_hash::xxhash3_128::Hasher::oneshot(bytes)
}

/// `<memo key, 16 hex>-<len>-<hash, 32 hex>`: the header value and the answer's field.
impl fmt::Display for BodyBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}-{}-{:032x}", self.memo_key, self.len, self.hash)
    }
}

/// Why a base's text did not read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadBodyBase(pub String);

impl fmt::Display for BadBodyBase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a body base (`<16 hex>-<len>-<32 hex>`): {:?}", self.0)
    }
}

impl std::error::Error for BadBodyBase {}

impl FromStr for BodyBase {
    type Err = BadBodyBase;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || BadBodyBase(s.chars().take(80).collect());
        let mut parts = s.trim().split('-');
        let (Some(key), Some(len), Some(hash), None) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(bad());
        };
        let hex = |p: &str, digits: usize| {
            (p.len() == digits && p.bytes().all(|b| b.is_ascii_hexdigit())).then_some(())
        };
        hex(key, 16).ok_or_else(bad)?;
        hex(hash, 32).ok_or_else(bad)?;
        let len = (!len.is_empty() && len.len() <= 12 && len.bytes().all(|b| b.is_ascii_digit()))
            .then(|| len.parse().ok())
            .flatten()
            .ok_or_else(bad)?;
        Ok(Self {
            memo_key: u64::from_str_radix(key, 16).map_err(|_| bad())?,
            len,
            hash: u128::from_str_radix(hash, 16).map_err(|_| bad())?,
        })
    }
}

impl Serialize for BodyBase {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for BodyBase {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_base_reads_back_from_its_text() {
        let base = BodyBase::of(
            0xdead_beef_0000_0001,
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"hi\"}",
        );
        let text = base.to_string();
        assert_eq!(text.len(), 16 + 1 + 2 + 1 + 32);
        assert_eq!(text.parse::<BodyBase>(), Ok(base));
        let json = serde_json::to_string(&base).unwrap_or_default();
        assert_eq!(json, format!("\"{text}\""));
        assert_eq!(serde_json::from_str::<BodyBase>(&json).ok(), Some(base));
    }

    #[test]
    fn malformed_base_texts_are_refused() {
        let good = BodyBase::of(1, b"abc").to_string();
        for bad in [
            "",
            "1-2-3",
            &good[1..],
            &format!("{good}-1"),
            &good.replacen('-', "+", 1),
            &format!("{}-{}-{}", "0".repeat(16), "9".repeat(13), "0".repeat(32)),
            &format!("{}--{}", "0".repeat(16), "0".repeat(32)),
            &format!("{}-+1-{}", "0".repeat(16), "0".repeat(32)),
            &format!("{}-1-{}", "g".repeat(16), "0".repeat(32)),
        ] {
            assert!(bad.parse::<BodyBase>().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn a_base_prefixes_only_bodies_that_start_with_its_bytes_and_go_on() {
        let earlier = b"{\"messages\":[{\"role\":\"user\",\"content\":\"one\"}],\"stream\":true}";
        let end = earlier.iter().position(|&b| b == b']').unwrap_or_default();
        let base = BodyBase::of(7, &earlier[..end]);
        let next = b"{\"messages\":[{\"role\":\"user\",\"content\":\"one\"},{\"role\":\"user\",\"content\":\"two\"}]}";
        assert!(base.prefixes(next));
        assert!(!base.prefixes(&next[..end]), "nothing past the base: no delta");
        let mut edited = next.to_vec();
        edited[end - 3] = b'X';
        assert!(!base.prefixes(&edited));
        assert!(!base.prefixes(b"{}"));
    }
}
