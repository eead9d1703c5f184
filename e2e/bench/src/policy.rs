//! The routing policies the benchmark compares, and what each needs from the stack (pure).
//!
//! Every policy runs on an identical fleet and workload; only Envoy's load balancing, the
//! kvmesh indexer mode, and whether the engines publish KV events differ:
//!
//! | policy | Envoy LB | kvmesh | KV events |
//! |---|---|---|---|
//! | `round_robin` | ROUND_ROBIN | — | on (unused) |
//! | `least_request` | LEAST_REQUEST | — | on (unused) |
//! | `ring_hash` | RING_HASH on the session header | — | on (unused) |
//! | `kvmesh_approximate` | override_host via the filter | indexer `mode = "approximate"` | **off** |
//! | `kvmesh_precise` | override_host via the filter | indexer `mode = "precise"` | on |
//! | `kvmesh_precise_session` | as `kvmesh_precise`, plus the workload's session header | indexer `mode = "precise"` | on |
//! | `kvmesh_precise_local_short` | as `kvmesh_precise`; the filter routes bodies ≤ [`LOCAL_ROUTE_SHORT_BODY_BYTES`] alone | indexer `mode = "precise"` | on |
//!
//! The kvmesh policies run **as shipped**: the indexer's and the filter's default configuration
//! (only `mode` is set, and the filter's `debug_headers` so records carry the decisions). In the
//! load sweep only `ring_hash` and `kvmesh_precise_session` get the session header
//! ([`Policy::uses_session_header`]), and only on workloads that have one.
//! `kvmesh_precise_local_short` is the one policy not as shipped and not in the default sweep:
//! it measures what the filter's `local_route_max_body_bytes` (off by default; it saves the
//! `/v1/route` exchange of short requests) costs in placement on a workload.
//!
//! Approximate mode is the supported mode for engines that publish no KV events: the indexer
//! learns what each worker probably caches from its own routing decisions, with a TTL
//! (`approx_ttl_secs`) and a per-worker size bound (`approx_max_blocks_per_worker`).

use crate::report::targets::{
    POLICY_KVMESH_APPROXIMATE, POLICY_KVMESH_PRECISE, POLICY_KVMESH_PRECISE_LOCAL_SHORT,
    POLICY_KVMESH_PRECISE_SESSION, POLICY_LEAST_REQUEST, POLICY_RING_HASH, POLICY_ROUND_ROBIN,
};

/// One routing policy under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Envoy round robin.
    RoundRobin,
    /// Envoy least request.
    LeastRequest,
    /// Envoy ring hash on the session header.
    RingHash,
    /// kvmesh, indexer learning from its own decisions (no KV events).
    KvmeshApproximate,
    /// kvmesh, indexer fed by the engines' KV events.
    KvmeshPrecise,
    /// kvmesh precise, the client sending an explicit session id.
    KvmeshPreciseSession,
    /// kvmesh precise, the filter routing short bodies alone (`local_route_max_body_bytes`).
    KvmeshPreciseLocalShort,
}

/// The filter's `local_route_max_body_bytes` in `kvmesh_precise_local_short` and in the overhead
/// benchmark's `_local_route` cases: ~1.5–2k tokens of chat.
pub const LOCAL_ROUTE_SHORT_BODY_BYTES: usize = 8192;

impl Policy {
    /// Every policy, in report order.
    pub const ALL: [Policy; 7] = [
        Self::RoundRobin,
        Self::LeastRequest,
        Self::RingHash,
        Self::KvmeshApproximate,
        Self::KvmeshPrecise,
        Self::KvmeshPreciseSession,
        Self::KvmeshPreciseLocalShort,
    ];

    /// The name used in files, the report and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Self::RoundRobin => POLICY_ROUND_ROBIN,
            Self::LeastRequest => POLICY_LEAST_REQUEST,
            Self::RingHash => POLICY_RING_HASH,
            Self::KvmeshApproximate => POLICY_KVMESH_APPROXIMATE,
            Self::KvmeshPrecise => POLICY_KVMESH_PRECISE,
            Self::KvmeshPreciseSession => POLICY_KVMESH_PRECISE_SESSION,
            Self::KvmeshPreciseLocalShort => POLICY_KVMESH_PRECISE_LOCAL_SHORT,
        }
    }

    /// Parses a policy name.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|p| p.name() == s.trim()).ok_or_else(|| {
            format!("unknown policy {s:?}; known: {}", Self::ALL.map(Self::name).join(", "))
        })
    }

    /// Parses a comma-separated list, keeping order, refusing duplicates and empty lists.
    pub fn parse_list(s: &str) -> Result<Vec<Self>, String> {
        let mut out: Vec<Self> = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let p = Self::parse(part)?;
            if out.contains(&p) {
                return Err(format!("policy {} listed twice", p.name()));
            }
            out.push(p);
        }
        if out.is_empty() {
            return Err("no policy given".into());
        }
        Ok(out)
    }

    /// True for the kvmesh policies (filter + indexer in the path).
    pub fn is_kvmesh(self) -> bool {
        matches!(
            self,
            Self::KvmeshApproximate
                | Self::KvmeshPrecise
                | Self::KvmeshPreciseSession
                | Self::KvmeshPreciseLocalShort
        )
    }

    /// Whether the sweep sends this policy the workload's session header.
    pub fn uses_session_header(self) -> bool {
        matches!(self, Self::RingHash | Self::KvmeshPreciseSession)
    }

    /// Whether the engines publish KV events under this policy.
    pub fn kv_events(self) -> bool {
        self != Self::KvmeshApproximate
    }

    /// The indexer's `[routing]` lines, for kvmesh policies.
    pub fn routing_toml(self) -> &'static str {
        match self {
            Self::KvmeshApproximate => "mode = \"approximate\"",
            Self::KvmeshPrecise | Self::KvmeshPreciseSession | Self::KvmeshPreciseLocalShort => {
                "mode = \"precise\""
            }
            _ => "",
        }
    }

    /// The filter's configuration under this policy (kvmesh policies): `debug_headers`, so records
    /// carry the decisions, and what the policy sets beyond the defaults.
    pub fn filter_config(self) -> serde_json::Value {
        match self {
            Self::KvmeshPreciseLocalShort => {
                serde_json::json!({ "debug_headers": true, "local_route_max_body_bytes": LOCAL_ROUTE_SHORT_BODY_BYTES })
            }
            _ => serde_json::json!({ "debug_headers": true }),
        }
    }

    /// One line for the report's policy notes.
    pub fn describe(self) -> String {
        match self {
            Self::RoundRobin => "Envoy ROUND_ROBIN over the fleet, no filter".into(),
            Self::LeastRequest => "Envoy LEAST_REQUEST over the fleet, no filter".into(),
            Self::RingHash => "Envoy RING_HASH on the session header (consistent hashing), no filter".into(),
            Self::KvmeshApproximate => {
                "kvmesh filter + indexer in approximate mode (engines publish no KV events; the index learns from its own decisions, with a TTL and a per-worker bound), default configuration".into()
            }
            Self::KvmeshPrecise => "kvmesh as shipped: filter + indexer in precise mode (index fed by the engines' KV events), default configuration".into(),
            Self::KvmeshPreciseSession => "kvmesh precise as shipped, the client sending the workload's explicit session header".into(),
            Self::KvmeshPreciseLocalShort => format!(
                "kvmesh precise, but the filter routes bodies of at most {LOCAL_ROUTE_SHORT_BODY_BYTES} bytes alone (local_route_max_body_bytes: the session's last worker, else its rendezvous pin; no /v1/route call)"
            ),
        }
    }
}

/// Which policies get the session header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionHeaderMode {
    /// Every policy (same requests everywhere; Envoy RR/LR ignore it, kvmesh uses it as the pin key).
    All,
    /// Only `ring_hash`, which cannot work without it (kvmesh then derives keys from the prompt).
    RingHashOnly,
    /// Nobody (ring_hash then has nothing to hash).
    None,
}

impl SessionHeaderMode {
    /// Parses `all`, `ring-hash`, `none`.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "all" => Ok(Self::All),
            "ring-hash" | "ring_hash" => Ok(Self::RingHashOnly),
            "none" => Ok(Self::None),
            _ => Err(format!("unknown session header mode {s:?} (all, ring-hash, none)")),
        }
    }

    /// Whether `policy` gets the header.
    pub fn sends(self, policy: Policy) -> bool {
        match self {
            Self::All => true,
            Self::RingHashOnly => policy == Policy::RingHash,
            Self::None => false,
        }
    }
}

/// Quotes one argument for a POSIX shell (for the report's "rerun with" line).
pub fn shell_quote(arg: &str) -> String {
    let safe = !arg.is_empty()
        && arg.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
    if safe {
        arg.to_string()
    } else {
        format!("'{}'", arg.replace('\'', "'\\''"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for p in Policy::ALL {
            assert_eq!(Policy::parse(p.name()), Ok(p));
        }
        assert!(Policy::parse("random").unwrap_err().contains("kvmesh_precise"));
    }

    #[test]
    fn parse_list_table() {
        assert_eq!(
            Policy::parse_list("round_robin, kvmesh_precise"),
            Ok(vec![Policy::RoundRobin, Policy::KvmeshPrecise])
        );
        assert!(Policy::parse_list("round_robin,round_robin").is_err());
        assert!(Policy::parse_list("").is_err());
        assert!(Policy::parse_list("nope").is_err());
    }

    #[test]
    fn only_approximate_runs_without_events() {
        let without: Vec<Policy> = Policy::ALL.into_iter().filter(|p| !p.kv_events()).collect();
        assert_eq!(without, vec![Policy::KvmeshApproximate]);
        assert_eq!(Policy::ALL.into_iter().filter(|p| p.is_kvmesh()).count(), 4);
        let with_header: Vec<Policy> =
            Policy::ALL.into_iter().filter(|p| p.uses_session_header()).collect();
        assert_eq!(with_header, vec![Policy::RingHash, Policy::KvmeshPreciseSession]);
        assert!(Policy::RoundRobin.routing_toml().is_empty());
    }

    #[test]
    fn only_local_short_routes_bodies_alone() {
        let local: Vec<Policy> = Policy::ALL
            .into_iter()
            .filter(|p| p.filter_config().get("local_route_max_body_bytes").is_some())
            .collect();
        assert_eq!(local, vec![Policy::KvmeshPreciseLocalShort]);
        assert_eq!(
            Policy::KvmeshPreciseLocalShort.filter_config()["local_route_max_body_bytes"],
            LOCAL_ROUTE_SHORT_BODY_BYTES
        );
        assert_eq!(
            Policy::KvmeshPreciseLocalShort.routing_toml(),
            Policy::KvmeshPrecise.routing_toml()
        );
        assert!(Policy::ALL
            .into_iter()
            .filter(|p| p.is_kvmesh())
            .all(|p| p.filter_config()["debug_headers"] == true));
    }

    #[test]
    fn session_header_modes() {
        assert!(SessionHeaderMode::All.sends(Policy::RoundRobin));
        assert!(!SessionHeaderMode::RingHashOnly.sends(Policy::KvmeshPrecise));
        assert!(SessionHeaderMode::RingHashOnly.sends(Policy::RingHash));
        assert!(!SessionHeaderMode::None.sends(Policy::RingHash));
        assert_eq!(SessionHeaderMode::parse("ring-hash"), Ok(SessionHeaderMode::RingHashOnly));
        assert!(SessionHeaderMode::parse("x").is_err());
    }

    #[test]
    fn shell_quote_table() {
        for (arg, want) in [
            ("--first", "--first"),
            ("a b", "'a b'"),
            ("it's", "'it'\\''s'"),
            ("", "''"),
            ("x=1,y", "x=1,y"),
        ] {
            assert_eq!(shell_quote(arg), want);
        }
    }
}
