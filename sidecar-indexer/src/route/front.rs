//! What a front door tells the route pipeline beyond the request itself (pure).
//!
//! The wasm filter derives the session key and sends it in `x-kvmesh-session`; a gateway speaking
//! the endpoint-picker protocol sends the client's request as it came, so the pipeline derives the
//! key from the body it reads anyway. Such a gateway may also restrict the candidates: GIE's
//! subset hint (`envoy.lb.subset_hint` / `x-gateway-destination-endpoint-subset`) and the
//! conformance suite's `test-epp-endpoint-selection` name the endpoints a pick may use.

/// How one route call was asked for; `Front::default()` is the filter's `/v1/route`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Front {
    /// Derive the session key from the body's conversation anchor when the call names none.
    pub derive_session: bool,
    /// Only workers (and prefill legs, migration sources) at endpoints every one of these sets
    /// allows; none = every worker of the model.
    pub eligible: Vec<Eligible>,
}

impl Front {
    /// Whether a worker at `endpoint` may be picked.
    pub fn allows(&self, endpoint: &str) -> bool {
        self.eligible.iter().all(|e| e.allows(endpoint))
    }
}

/// A set of endpoints a pick is restricted to: `ip:port` entries, or a bare `ip` that allows every
/// port of that address (GIE's subset hint allows both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eligible {
    entries: Vec<String>,
}

/// Most entries one subset may name: a pool has at most a few thousand endpoints; anything longer
/// is not a subset hint but an attack on the per-call scan.
pub const MAX_ELIGIBLE_ENTRIES: usize = 4096;

impl Eligible {
    /// From a list of entries (each trimmed; empty ones skipped; at most
    /// [`MAX_ELIGIBLE_ENTRIES`], the rest ignored). An empty list allows nothing.
    pub fn new<'a>(entries: impl IntoIterator<Item = &'a str>) -> Self {
        let entries = entries
            .into_iter()
            .map(str::trim)
            .filter(|e| !e.is_empty())
            .take(MAX_ELIGIBLE_ENTRIES)
            .map(str::to_owned)
            .collect();
        Self { entries }
    }

    /// From a comma-separated string (the form `lwepp` also accepts).
    pub fn from_comma_list(list: &str) -> Self {
        Self::new(list.split(','))
    }

    /// Whether `endpoint` (`host:port`) is in the set: named exactly, or its host named bare.
    pub fn allows(&self, endpoint: &str) -> bool {
        let host = unbracketed(host_of(endpoint));
        self.entries.iter().any(|e| e == endpoint || (is_bare_host(e) && unbracketed(e) == host))
    }

    /// Whether the set allows nothing.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The entries, as given.
    pub fn entries(&self) -> &[String] {
        &self.entries
    }
}

/// Whether an entry names a host without a port: no `:` at all, or an IPv6 address (bracketed or
/// not).
fn is_bare_host(entry: &str) -> bool {
    !entry.contains(':') || unbracketed(entry).parse::<std::net::Ipv6Addr>().is_ok()
}

/// `[v6]` → `v6`; anything else as it is.
fn unbracketed(host: &str) -> &str {
    host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host)
}

/// The host part of `host:port` (`[v6]:port` keeps its brackets); the whole string without a port.
fn host_of(endpoint: &str) -> &str {
    match endpoint.rsplit_once(':') {
        Some((host, port)) if !port.is_empty() && port.bytes().all(|b| b.is_ascii_digit()) => host,
        _ => endpoint,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_entries_and_bare_hosts() {
        let e = Eligible::from_comma_list(" 10.0.0.1:8000 , 10.0.0.2,,");
        assert_eq!(e.entries(), ["10.0.0.1:8000", "10.0.0.2"]);
        assert!(e.allows("10.0.0.1:8000"));
        assert!(!e.allows("10.0.0.1:8001"), "another port of an exact entry");
        assert!(
            e.allows("10.0.0.2:8000") && e.allows("10.0.0.2:9"),
            "a bare host allows every port"
        );
        assert!(!e.allows("10.0.0.3:8000"));
        assert!(!e.allows("10.0.0.22:8000"), "hosts compare whole, not by prefix");
    }

    #[test]
    fn empty_allows_nothing() {
        let e = Eligible::new(["", " "]);
        assert!(e.is_empty());
        assert!(!e.allows("10.0.0.1:8000"));
    }

    #[test]
    fn ipv6_hosts() {
        for bare in ["[fd00::1]", "fd00::1"] {
            let e = Eligible::new([bare]);
            assert!(e.allows("[fd00::1]:8000"), "{bare}");
            assert!(!e.allows("[fd00::2]:8000"), "{bare}");
        }
        let exact = Eligible::new(["[fd00::1]:8000"]);
        assert!(exact.allows("[fd00::1]:8000") && !exact.allows("[fd00::1]:8001"));
    }

    #[test]
    fn every_set_must_allow() {
        let front = Front {
            derive_session: true,
            eligible: vec![
                Eligible::new(["10.0.0.1:8000", "10.0.0.2", "10.0.0.3:8000"]),
                Eligible::new(["10.0.0.2:8001", "10.0.0.1"]),
            ],
        };
        assert!(front.allows("10.0.0.1:8000"));
        assert!(front.allows("10.0.0.2:8001"));
        assert!(!front.allows("10.0.0.2:8000"), "the second set names port 8001 only");
        assert!(!front.allows("10.0.0.3:8000"));
        assert!(Front::default().allows("10.9.9.9:1"), "no set: every endpoint");
    }

    #[test]
    fn bounded() {
        let many: Vec<String> =
            (0..MAX_ELIGIBLE_ENTRIES + 10).map(|i| format!("10.0.{i}.1")).collect();
        let e = Eligible::new(many.iter().map(String::as_str));
        assert_eq!(e.entries().len(), MAX_ELIGIBLE_ENTRIES);
    }
}
