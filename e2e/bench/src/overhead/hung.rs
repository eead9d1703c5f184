//! The hung-indexer case of the overhead part (issue 14.3), pure: what was measured while the
//! indexer was SIGSTOPped, judged against the targets, and rendered as a report section.
//!
//! A stopped indexer holds its socket and never answers. Until the filter's breaker opens, each
//! request waits `indexer_timeout_ms`; once it is open, requests skip the call. The targets:
//! - once the breaker is open, the added latency (gateway time, kvmesh − plain of the same run,
//!   like every other case) is < [`HUNG_ADDED_P50_TARGET_MS`] at p50;
//! - connections from Envoy to the indexer stay bounded: the peak of Envoy's
//!   `upstream_cx_active` on the indexer cluster, sampled during the hang and a concurrent burst,
//!   is at most Envoy's bound (the cluster's circuit breaker plus one per worker thread's pool);
//! - after SIGCONT routing resumes (the first request with an indexer decision) within
//!   [`RESUME_TARGET_MS`].
//!
//! Never asserted: the benchmark reports met / missed / not measured.

use crate::manifest::OverheadCase;
use crate::report::sweep::Judged;
use serde::{Deserialize, Serialize};
use std::fmt::Write as _;

/// Case name of the latency samples taken while the indexer hangs: cold chats of
/// [`HUNG_PROMPT_TOKENS`].
pub const HUNG_CASE: &str = "chat_1k_cold_indexer_hung";
/// Prompt size of those samples.
pub const HUNG_PROMPT_TOKENS: usize = 1024;
/// Target: added p50 once the breaker is open, below this many ms.
pub const HUNG_ADDED_P50_TARGET_MS: f64 = 10.0;
/// Target: routing resumes within this many ms after SIGCONT.
pub const RESUME_TARGET_MS: f64 = 2000.0;
/// Consecutive kvmesh requests answered with `x-kvmesh-fallback: breaker_open` that count as "the
/// breaker is open" before the latency samples start.
pub const OPEN_STREAK: u64 = 3;

/// The concurrent burst sent while the indexer hangs (the canned route, like requests/s rounds).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct Burst {
    /// Closed-loop clients.
    pub concurrency: u64,
    /// Requests answered 2xx.
    pub ok: u64,
    /// Requests that failed or timed out.
    pub failed: u64,
    /// Requests the filter routed without the indexer.
    pub fallbacks: u64,
    /// Wall time, seconds.
    pub seconds: f64,
}

/// Everything measured while the indexer was stopped and after it was resumed.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HungIndexer {
    /// The filter's `indexer_timeout_ms` in this run.
    pub indexer_timeout_ms: u64,
    /// Sequential kvmesh requests sent from SIGSTOP until the breaker was seen open
    /// ([`OPEN_STREAK`] of them in a row), and how long that took, ms; `None`: never seen open.
    pub opening_requests: u64,
    /// See [`Self::opening_requests`].
    pub opening_ms: Option<f64>,
    /// Added latency with the breaker open, summarised like every other case ([`HUNG_CASE`]).
    pub latency: Option<OverheadCase>,
    /// Of its kvmesh samples: how many skipped the call (`breaker_open`) and how many waited for
    /// the indexer (a half-open probe: `timeout`, `reset`, `dispatch_failed`).
    pub skipped: u64,
    /// See [`Self::skipped`].
    pub waited: u64,
    /// The concurrent burst, when run.
    pub burst: Option<Burst>,
    /// Peak `upstream_cx_active` of Envoy's indexer cluster over the whole hang; `None`: never read.
    pub max_indexer_connections: Option<u64>,
    /// Envoy's bound on that number (circuit breaker + one per worker thread's pool).
    pub connection_bound: u64,
    /// SIGCONT → first request routed by the indexer, ms; `None`: not within the patience.
    pub resume_ms: Option<f64>,
}

/// How a kvmesh sample with the indexer hung got its route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HungRoute {
    /// The breaker skipped the call.
    Skipped,
    /// The call went out and got no answer (a probe, or the breaker still closed).
    Waited,
    /// Anything else (routed by the indexer, another fallback).
    Other,
}

/// Classifies one sample by its `x-kvmesh-fallback` value.
pub fn hung_route(fallback: Option<&str>) -> HungRoute {
    match fallback {
        Some("breaker_open") => HungRoute::Skipped,
        Some("timeout" | "reset" | "dispatch_failed") => HungRoute::Waited,
        _ => HungRoute::Other,
    }
}

/// The next streak of breaker-skipped requests: `OPEN_STREAK` in a row means the breaker is open.
pub fn open_streak(streak: u64, fallback: Option<&str>) -> u64 {
    if hung_route(fallback) == HungRoute::Skipped {
        streak + 1
    } else {
        0
    }
}

fn judged(target: String, met: Option<bool>, measured: String) -> Judged {
    Judged { target, met, measured }
}

/// The three targets, judged.
pub fn targets(h: &HungIndexer) -> Vec<Judged> {
    let latency = h.latency.as_ref();
    let added = judged(
        format!("added p50 with the breaker open < {HUNG_ADDED_P50_TARGET_MS} ms"),
        latency.map(|c| c.p50_added_ms < HUNG_ADDED_P50_TARGET_MS),
        latency.map_or("n/a".into(), |c| format!("{:.3} ms", c.p50_added_ms)),
    );
    let bounded = judged(
        format!("connections to the hung indexer ≤ Envoy's bound ({})", h.connection_bound),
        h.max_indexer_connections.map(|n| n <= h.connection_bound),
        h.max_indexer_connections.map_or("n/a".into(), |n| match &h.burst {
            Some(b) => format!("peak {n}, {} concurrent clients at most", b.concurrency),
            None => format!("peak {n}"),
        }),
    );
    let resumed = judged(
        format!("routing resumes ≤ {:.0} s after SIGCONT", RESUME_TARGET_MS / 1000.0),
        Some(h.resume_ms.is_some_and(|ms| ms <= RESUME_TARGET_MS)),
        h.resume_ms.map_or("not within the patience".into(), |ms| format!("{ms:.0} ms")),
    );
    vec![added, bounded, resumed]
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "**met**",
        Some(false) => "**missed**",
        None => "not measured",
    }
}

fn num(v: Option<f64>) -> String {
    v.map_or("n/a".into(), |x| format!("{x:.3}"))
}

/// The report section (Markdown, no heading).
pub fn render(h: &HungIndexer) -> String {
    let mut s = String::new();
    let opening = match h.opening_ms {
        Some(ms) => format!(
            "the breaker was seen open after {} sequential requests ({ms:.0} ms; each waited up to `indexer_timeout_ms: {}` until then)",
            h.opening_requests, h.indexer_timeout_ms
        ),
        None => format!("the breaker was **never seen open** ({} requests sent)", h.opening_requests),
    };
    // Writing to a String cannot fail; the results are ignored on purpose.
    let _ = writeln!(
        s,
        "The indexer SIGSTOPped (it holds its socket and answers nothing): {opening}. Then, with the breaker open, `{HUNG_CASE}` \
         latency samples (one request at a time, kvmesh and plain interleaved, gateway time from Envoy's access log, as in \
         the table above); a half-open probe waits for the deadline again once per `breaker_open_ms` per Envoy worker \
         thread, so it shows in p99, not p50."
    );
    if let Some(c) = &h.latency {
        let _ = writeln!(
            s,
            "\n| samples | **added p50 ms** | added p99 ms | kvmesh p50 / p99 ms | plain p50 / p99 ms | skipped the call | waited for the indexer |\n|---|---|---|---|---|---|---|\n| {} | **{:.3}** | {} | {} / {} | {} / {} | {} | {} |",
            c.samples.map_or("n/a".into(), |n| n.to_string()),
            c.p50_added_ms,
            num(c.p99_added_ms),
            num(c.kvmesh_p50_ms),
            num(c.kvmesh_p99_ms),
            num(c.plain_p50_ms),
            num(c.plain_p99_ms),
            h.skipped,
            h.waited
        );
    }
    if let Some(b) = &h.burst {
        let _ = writeln!(
            s,
            "\nBurst during the hang: {} closed-loop clients for {:.1} s on the canned route: {} ok, {} failed, {} routed without the indexer.",
            b.concurrency, b.seconds, b.ok, b.failed, b.fallbacks
        );
    }
    let _ = writeln!(s);
    for t in targets(h) {
        let _ = writeln!(s, "Target: {}: {} ({}).\n", t.target, verdict(t.met), t.measured);
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hung(p50: Option<f64>, peak: Option<u64>, resume: Option<f64>) -> HungIndexer {
        HungIndexer {
            indexer_timeout_ms: 100,
            opening_requests: 8,
            opening_ms: Some(512.0),
            latency: p50.map(|p| OverheadCase {
                name: HUNG_CASE.into(),
                p50_added_ms: p,
                p99_added_ms: Some(101.0),
                samples: Some(50),
                ..Default::default()
            }),
            skipped: 48,
            waited: 2,
            burst: Some(Burst {
                concurrency: 50,
                ok: 900,
                failed: 0,
                fallbacks: 880,
                seconds: 2.0,
            }),
            max_indexer_connections: peak,
            connection_bound: 258,
            resume_ms: resume,
        }
    }

    #[test]
    fn each_target_is_met_missed_or_not_measured() {
        let table: [(HungIndexer, [Option<bool>; 3]); 5] = [
            (hung(Some(0.4), Some(12), Some(900.0)), [Some(true); 3]),
            (hung(Some(10.0), Some(259), Some(2000.5)), [Some(false); 3]),
            (hung(Some(9.99), Some(258), Some(2000.0)), [Some(true); 3]),
            (hung(None, None, Some(10.0)), [None, None, Some(true)]),
            (hung(Some(1.0), Some(3), None), [Some(true), Some(true), Some(false)]),
        ];
        for (h, want) in table {
            let got: Vec<Option<bool>> = targets(&h).iter().map(|t| t.met).collect();
            assert_eq!(got, want, "{h:?}");
        }
    }

    #[test]
    fn the_section_states_each_target_with_its_number() {
        let md = render(&hung(Some(0.4), Some(12), Some(900.0)));
        for want in [
            "after 8 sequential requests (512 ms; each waited up to `indexer_timeout_ms: 100`",
            "| 50 | **0.400** | 101.000 | n/a / n/a | n/a / n/a | 48 | 2 |",
            "50 closed-loop clients for 2.0 s on the canned route: 900 ok, 0 failed, 880 routed without the indexer.",
            "Target: added p50 with the breaker open < 10 ms: **met** (0.400 ms).",
            "Target: connections to the hung indexer ≤ Envoy's bound (258): **met** (peak 12, 50 concurrent clients at most).",
            "Target: routing resumes ≤ 2 s after SIGCONT: **met** (900 ms).",
        ] {
            assert!(md.contains(want), "missing {want:?} in:\n{md}");
        }
        let never = HungIndexer { opening_ms: None, resume_ms: None, ..hung(None, None, None) };
        let md = render(&never);
        assert!(md.contains("**never seen open** (8 requests sent)"), "{md}");
        assert!(md.contains("added p50 with the breaker open < 10 ms: not measured (n/a)"), "{md}");
        assert!(md.contains("after SIGCONT: **missed** (not within the patience)"), "{md}");
    }

    #[test]
    fn routes_and_streaks_follow_the_fallback_header() {
        let table = [
            (Some("breaker_open"), HungRoute::Skipped),
            (Some("timeout"), HungRoute::Waited),
            (Some("reset"), HungRoute::Waited),
            (Some("dispatch_failed"), HungRoute::Waited),
            (Some("no_decision"), HungRoute::Other),
            (None, HungRoute::Other),
        ];
        for (fallback, want) in table {
            assert_eq!(hung_route(fallback), want, "{fallback:?}");
        }
        let mut streak = 0;
        for (f, want) in [
            (Some("timeout"), 0),
            (Some("breaker_open"), 1),
            (Some("breaker_open"), 2),
            (None, 0),
            (Some("breaker_open"), 1),
        ] {
            streak = open_streak(streak, f);
            assert_eq!(streak, want);
        }
    }
}
