//! From samples to the report's overhead rows (pure).
//!
//! Added latency is a difference of percentiles measured in the same run: p50(path) −
//! p50(plain) and p99(path) − p99(plain), on the gateway time from Envoy's own timestamps
//! (see `gateway`), for each way through kvmesh (the wasm filter, the ext_proc endpoint
//! picker). The client-observed TTFT difference is computed the same way as a cross-check; it
//! includes the engines' time (tokenizing the whole prompt) on both sides, so it is noisier.
//! Failed samples are counted and left out; samples the filter routed without the indexer (its
//! timeout) stay in: that latency is real. Where the kvmesh time goes is read from the indexer's
//! own timers (`/v1/route` and tokenization histograms), scraped after every kvmesh sample: the
//! rest of the gateway time is the filter and the loopback hop to the indexer.

use crate::manifest::{OverheadCase, ProcessCpu};
use crate::prom::Sample as PromSample;
use crate::stats::percentile;
use serde::{Deserialize, Serialize};

/// Which way in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Path {
    /// Through the kvmesh wasm filter.
    Kvmesh,
    /// The same Envoy without the filter.
    Plain,
    /// Through Envoy's ext_proc filter calling the indexer's endpoint picker (no wasm).
    ExtProc,
}

/// `OverheadCase::edge` of the ext_proc path's rows.
pub const EXT_PROC_EDGE: &str = "ext_proc";
/// Suffix of the ext_proc path's case names (`chat_8k_continuation_ext_proc`).
pub const EXT_PROC_SUFFIX: &str = "_ext_proc";

impl Path {
    /// Short tag used in request ids.
    pub fn tag(self) -> &'static str {
        match self {
            Self::Kvmesh => "k",
            Self::Plain => "p",
            Self::ExtProc => "e",
        }
    }

    /// Distinct per path (0, 1, 2): keeps the paths' generated requests apart.
    pub fn index(self) -> u64 {
        match self {
            Self::Kvmesh => 0,
            Self::Plain => 1,
            Self::ExtProc => 2,
        }
    }

    /// The name of `case`'s row for this path (the wasm path keeps the case's name, which the
    /// targets read).
    pub fn row_name(self, case: &str) -> String {
        match self {
            Self::ExtProc => format!("{case}{EXT_PROC_SUFFIX}"),
            Self::Kvmesh | Self::Plain => case.to_string(),
        }
    }
}

/// The order the paths take in sample or round `n`: `ways` rotated by `n`, so each path takes
/// each position equally often (two paths: alternating).
pub fn order(ways: &[Path], n: u64) -> Vec<Path> {
    let mut v = ways.to_vec();
    if !v.is_empty() {
        let k = (n % v.len() as u64) as usize;
        v.rotate_left(k);
    }
    v
}

/// Whether a response on `way` was routed without the indexer's pipeline: the filter's
/// `x-kvmesh-fallback`; for the picker (which names no fallback) the absence of a decision in its
/// debug headers (`x-kvmesh-decision-mode`; the overhead stack runs with `debug_headers`): the
/// session's pin after a failed route call.
pub fn routed_without_indexer(way: Path, fallback_header: bool, decision_header: bool) -> bool {
    match way {
        Path::Kvmesh => fallback_header,
        Path::ExtProc => !decision_header,
        Path::Plain => false,
    }
}

/// `Sample::fallback` of a picker response without a decision.
pub const PICKER_PIN: &str = "picker_pin";

/// One measured request (a line of `overhead/samples.jsonl`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    /// Case name.
    pub case: String,
    /// Which way in.
    pub path: Option<Path>,
    /// Sample number within the case.
    pub n: u64,
    /// The request's bench id.
    pub id: String,
    /// Gateway time from Envoy's access log, ms.
    pub gateway_ms: Option<f64>,
    /// Of which: last request byte → first upstream byte, ms.
    pub request_ms: Option<f64>,
    /// Client-observed time to the first token, ms.
    pub ttft_ms: Option<f64>,
    /// HTTP status.
    pub status: Option<u16>,
    /// Worker that served it.
    pub worker: Option<String>,
    /// `x-kvmesh-fallback`, when the filter routed without the indexer; [`PICKER_PIN`] for a
    /// picker response without a decision.
    pub fallback: Option<String>,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// kvmesh: the indexer's own time answering this request's `/v1/route`, ms.
    pub indexer_ms: Option<f64>,
    /// kvmesh: of which tokenization, ms.
    pub tokenize_ms: Option<f64>,
    /// kvmesh: of which `find_matches`, ms.
    #[serde(default)]
    pub match_ms: Option<f64>,
    /// kvmesh: of which scoring (views, decide, booking), ms.
    #[serde(default)]
    pub score_ms: Option<f64>,
    /// Why it failed.
    pub error: Option<String>,
}

impl Sample {
    /// Sample `n` of `case` on `path`, as the client measured it (gateway and indexer times are
    /// joined later).
    pub fn measured(
        case: String,
        path: Path,
        n: u64,
        id: String,
        o: crate::client::Outcome,
    ) -> Self {
        Self {
            case,
            path: Some(path),
            n,
            id,
            ttft_ms: o.ttft.map(|d| d.as_secs_f64() * 1e3),
            status: o.status,
            worker: o.worker,
            fallback: o.fallback,
            prompt_tokens: o.usage.and_then(|u| u.prompt_tokens),
            error: o.error,
            ..Default::default()
        }
    }

    /// Success with both measurements present.
    pub fn usable(&self) -> bool {
        self.error.is_none() && self.gateway_ms.is_some()
    }
}

/// Indexer histogram behind [`IndexerTimers::route_s`].
pub const ROUTE_TIMER: &str = "kvmesh_route_duration_seconds";
/// Indexer histogram behind [`IndexerTimers::tokenize_s`].
pub const TOKENIZE_TIMER: &str = "kvmesh_tokenize_duration_seconds";
/// Indexer histogram behind [`IndexerTimers::match_s`].
pub const MATCH_TIMER: &str = "kvmesh_match_duration_seconds";
/// Indexer histogram behind [`IndexerTimers::score_s`].
pub const SCORE_TIMER: &str = "kvmesh_score_duration_seconds";

/// The indexer's cumulative route and tokenization timers (histogram sums and counts).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct IndexerTimers {
    /// Σ seconds answering `/v1/route`.
    pub route_s: f64,
    /// Routes answered.
    pub routes: f64,
    /// Σ seconds tokenizing.
    pub tokenize_s: f64,
    /// Tokenizations.
    pub tokenizations: f64,
    /// Σ seconds in `find_matches`.
    pub match_s: f64,
    /// `find_matches` calls.
    pub matches: f64,
    /// Σ seconds scoring.
    pub score_s: f64,
    /// Scorings.
    pub scores: f64,
}

/// One route's share of the indexer's timers, ms; a stage is `None` unless it ran exactly once.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct RouteShare {
    /// Answering `/v1/route`.
    pub route_ms: f64,
    /// Of which rendering + tokenizing.
    pub tokenize_ms: Option<f64>,
    /// Of which `find_matches`.
    pub match_ms: Option<f64>,
    /// Of which scoring.
    pub score_ms: Option<f64>,
}

impl IndexerTimers {
    /// Reads the timers from a scrape; `None` when the route timer is missing.
    pub fn from_scrape(samples: &[PromSample]) -> Option<Self> {
        let get = |name: &str| crate::prom::sum(samples, name);
        Some(Self {
            route_s: get(&format!("{ROUTE_TIMER}_sum"))?,
            routes: get(&format!("{ROUTE_TIMER}_count"))?,
            tokenize_s: get(&format!("{TOKENIZE_TIMER}_sum")).unwrap_or(0.0),
            tokenizations: get(&format!("{TOKENIZE_TIMER}_count")).unwrap_or(0.0),
            match_s: get(&format!("{MATCH_TIMER}_sum")).unwrap_or(0.0),
            matches: get(&format!("{MATCH_TIMER}_count")).unwrap_or(0.0),
            score_s: get(&format!("{SCORE_TIMER}_sum")).unwrap_or(0.0),
            scores: get(&format!("{SCORE_TIMER}_count")).unwrap_or(0.0),
        })
    }

    /// This route's share when exactly one route was answered since `before` (each stage only
    /// when it ran exactly once).
    pub fn one_route_since(&self, before: &Self) -> Option<RouteShare> {
        let once = |n: f64, m: f64| (n - m - 1.0).abs() < 1e-9;
        if !once(self.routes, before.routes) {
            return None;
        }
        let stage = |n: f64, m: f64, a: f64, b: f64| once(n, m).then_some((a - b) * 1e3);
        Some(RouteShare {
            route_ms: (self.route_s - before.route_s) * 1e3,
            tokenize_ms: stage(
                self.tokenizations,
                before.tokenizations,
                self.tokenize_s,
                before.tokenize_s,
            ),
            match_ms: stage(self.matches, before.matches, self.match_s, before.match_s),
            score_ms: stage(self.scores, before.scores, self.score_s, before.score_s),
        })
    }
}

/// Requests/s of one path over its closed-loop rounds.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Rate {
    /// Successful requests.
    pub ok: u64,
    /// Failed requests.
    pub failed: u64,
    /// Requests the filter routed without the indexer.
    pub fallbacks: u64,
    /// Wall time, seconds.
    pub seconds: f64,
    /// Routes the indexer answered (its route timer's count) during the rounds and while it went
    /// idle after them.
    pub indexer_routes: f64,
    /// The indexer's CPU time (user + system) over the same span, seconds; 0 when not read.
    pub indexer_cpu_s: f64,
    /// Envoy's CPU time over the same span, seconds; 0 when not read.
    pub envoy_cpu_s: f64,
    /// The bench client's (this process's) CPU time over the closed loop, seconds; 0 when not read.
    pub client_cpu_s: f64,
    /// Rounds added up here.
    pub rounds: u32,
    /// Of which rounds whose Envoy, indexer and client CPU times were all read.
    pub cpu_rounds: u32,
}

impl Rate {
    /// Adds another round.
    pub fn add(&mut self, other: Rate) {
        self.ok += other.ok;
        self.failed += other.failed;
        self.fallbacks += other.fallbacks;
        self.seconds += other.seconds;
        self.indexer_routes += other.indexer_routes;
        self.indexer_cpu_s += other.indexer_cpu_s;
        self.envoy_cpu_s += other.envoy_cpu_s;
        self.client_cpu_s += other.client_cpu_s;
        self.rounds += other.rounds;
        self.cpu_rounds += other.cpu_rounds;
    }

    /// Successful requests per second.
    pub fn per_second(&self) -> Option<f64> {
        (self.seconds > 0.0).then(|| self.ok as f64 / self.seconds)
    }

    /// Route throughput per indexer core: routes answered ÷ indexer CPU-seconds (= routes/s ÷
    /// indexer cores busy). `None` when the indexer's CPU was not read or no route was answered.
    pub fn routes_per_indexer_core(&self) -> Option<f64> {
        (self.indexer_cpu_s > 0.0 && self.indexer_routes > 0.0)
            .then(|| self.indexer_routes / self.indexer_cpu_s)
    }

    /// Mean indexer cores busy over the rounds' wall time (CPU spent settling included).
    pub fn indexer_cores(&self) -> Option<f64> {
        (self.indexer_cpu_s > 0.0 && self.seconds > 0.0).then(|| self.indexer_cpu_s / self.seconds)
    }

    /// CPU-ms per request (answered or failed) by process, when every round's CPU was read.
    pub fn cpu_ms_per_request(&self) -> Option<ProcessCpu> {
        let n = (self.ok + self.failed) as f64;
        (self.rounds > 0 && self.cpu_rounds == self.rounds && n > 0.0).then(|| ProcessCpu {
            envoy_ms: self.envoy_cpu_s * 1e3 / n,
            indexer_ms: self.indexer_cpu_s * 1e3 / n,
            client_ms: self.client_cpu_s * 1e3 / n,
        })
    }
}

fn values(samples: &[&Sample], path: Path, f: impl Fn(&Sample) -> Option<f64>) -> Vec<f64> {
    samples.iter().filter(|s| s.path == Some(path) && s.usable()).filter_map(|s| f(s)).collect()
}

fn diff(k: &[f64], p: &[f64], q: f64) -> Option<f64> {
    Some(percentile(k, q)? - percentile(p, q)?)
}

/// Summarises one case on `way` (the wasm filter or the picker) against plain Envoy, as the row
/// named [`Path::row_name`]; `None` when either path has no usable sample. `way_rate`,
/// `plain_rate`: the two paths' requests/s rounds.
pub fn summarize(
    case: &str,
    way: Path,
    samples: &[Sample],
    way_rate: Option<Rate>,
    plain_rate: Option<Rate>,
) -> Option<OverheadCase> {
    let mine: Vec<&Sample> = samples
        .iter()
        .filter(|s| s.case == case && (s.path == Some(way) || s.path == Some(Path::Plain)))
        .collect();
    let gk = values(&mine, way, |s| s.gateway_ms);
    let gp = values(&mine, Path::Plain, |s| s.gateway_ms);
    let tk = values(&mine, way, |s| s.ttft_ms);
    let tp = values(&mine, Path::Plain, |s| s.ttft_ms);
    let tokens: Vec<f64> = mine
        .iter()
        .filter(|s| s.usable())
        .filter_map(|s| s.prompt_tokens)
        .map(|t| t as f64)
        .collect();
    let indexer = values(&mine, way, |s| s.indexer_ms);
    let tokenize = values(&mine, way, |s| s.tokenize_ms);
    let matching = values(&mine, way, |s| s.match_ms);
    let scoring = values(&mine, way, |s| s.score_ms);
    Some(OverheadCase {
        name: way.row_name(case),
        p50_added_ms: diff(&gk, &gp, 50.0)?,
        p99_added_ms: diff(&gk, &gp, 99.0),
        rps_kvmesh: way_rate.and_then(|r| r.per_second()),
        rps_plain: plain_rate.and_then(|r| r.per_second()),
        rps_kvmesh_fallback_share: way_rate
            .filter(|r| r.ok + r.failed > 0)
            .map(|r| r.fallbacks as f64 / (r.ok + r.failed) as f64),
        routes_per_indexer_core: way_rate.and_then(|r| r.routes_per_indexer_core()),
        indexer_cores: way_rate.and_then(|r| r.indexer_cores()),
        samples: Some(gk.len().min(gp.len()) as u64),
        prompt_tokens: (!tokens.is_empty())
            .then(|| tokens.iter().sum::<f64>() / tokens.len() as f64),
        kvmesh_p50_ms: percentile(&gk, 50.0),
        kvmesh_p99_ms: percentile(&gk, 99.0),
        plain_p50_ms: percentile(&gp, 50.0),
        plain_p99_ms: percentile(&gp, 99.0),
        client_p50_added_ms: diff(&tk, &tp, 50.0),
        client_p99_added_ms: diff(&tk, &tp, 99.0),
        indexer_p50_ms: percentile(&indexer, 50.0),
        tokenize_p50_ms: percentile(&tokenize, 50.0),
        match_p50_ms: percentile(&matching, 50.0),
        score_p50_ms: percentile(&scoring, 50.0),
        fallbacks: Some(
            mine.iter().filter(|s| s.path == Some(way) && s.fallback.is_some()).count() as u64,
        ),
        failed: Some(mine.iter().filter(|s| !s.usable()).count() as u64),
        local_route_max_body_bytes: None,
        edge: (way == Path::ExtProc).then(|| EXT_PROC_EDGE.to_string()),
        cpu_ms_per_request: way_rate.and_then(|r| r.cpu_ms_per_request()),
        plain_cpu_ms_per_request: plain_rate.and_then(|r| r.cpu_ms_per_request()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(case: &str, path: Path, g: f64, ttft: f64) -> Sample {
        Sample {
            case: case.into(),
            path: Some(path),
            gateway_ms: Some(g),
            ttft_ms: Some(ttft),
            prompt_tokens: Some(100),
            ..Default::default()
        }
    }

    #[test]
    fn added_latency_is_a_difference_of_percentiles() {
        let mut v = Vec::new();
        for i in 0..100 {
            v.push(s("c", Path::Kvmesh, 1.0 + i as f64 / 100.0, 20.0 + i as f64));
            v.push(s("c", Path::Plain, 0.1, 19.0 + i as f64));
        }
        v.push(Sample {
            case: "c".into(),
            path: Some(Path::Kvmesh),
            error: Some("HTTP 500".into()),
            ..Default::default()
        });
        v.push(Sample { fallback: Some("timeout".into()), ..s("c", Path::Kvmesh, 100.0, 120.0) });
        v.push(s("other", Path::Plain, 50.0, 50.0));
        for (i, x) in v.iter_mut().filter(|x| x.path == Some(Path::Kvmesh)).enumerate() {
            x.indexer_ms = Some(i as f64);
        }
        let r = Rate {
            ok: 300,
            failed: 0,
            fallbacks: 30,
            seconds: 3.0,
            indexer_routes: 330.0,
            indexer_cpu_s: 1.5,
            ..Default::default()
        };
        let plain = Rate { ok: 600, seconds: 3.0, ..Default::default() };
        let c = summarize("c", Path::Kvmesh, &v, Some(r), Some(plain)).unwrap();
        // 101 kvmesh samples (the fallback's 100 ms included): rank 51 = 1.50; p99 rank 100 = 1.99.
        assert!((c.p50_added_ms - (1.5 - 0.1)).abs() < 1e-9, "{c:?}");
        assert!((c.p99_added_ms.unwrap() - (1.99 - 0.1)).abs() < 1e-9, "{c:?}");
        assert_eq!(c.kvmesh_p50_ms, Some(1.5));
        assert_eq!(c.plain_p99_ms, Some(0.1));
        // 101 kvmesh TTFTs (the fallback's counts): nearest rank 51 = 70; plain rank 50 = 68.
        assert!((c.client_p50_added_ms.unwrap() - 2.0).abs() < 1e-9, "{c:?}");
        assert_eq!((c.fallbacks, c.failed, c.samples), (Some(1), Some(1), Some(100)));
        assert_eq!(
            (c.rps_kvmesh, c.rps_plain, c.rps_kvmesh_fallback_share),
            (Some(100.0), Some(200.0), Some(0.1))
        );
        assert_eq!(c.prompt_tokens, Some(100.0));
        assert_eq!(
            (c.routes_per_indexer_core, c.indexer_cores),
            (Some(220.0), Some(0.5)),
            "330 routes on 1.5 CPU-s over 3 s"
        );
        assert_eq!(
            (c.indexer_p50_ms, c.tokenize_p50_ms),
            (Some(50.0), None),
            "ranks over usable kvmesh samples"
        );
        assert_eq!((c.name.as_str(), c.edge.as_deref()), ("c", None));
        assert_eq!(c.cpu_ms_per_request, None, "CPU not read");
    }

    #[test]
    fn the_picker_row_compares_its_own_samples_with_plain() {
        let mut v = Vec::new();
        for i in 0..10 {
            v.push(s("c", Path::Kvmesh, 5.0, 30.0));
            v.push(s("c", Path::ExtProc, 2.0 + i as f64 / 10.0, 25.0));
            v.push(s("c", Path::Plain, 0.5, 20.0));
        }
        v.push(Sample { fallback: Some(PICKER_PIN.into()), ..s("c", Path::ExtProc, 0.9, 21.0) });
        v.push(Sample { error: Some("HTTP 500".into()), ..s("c", Path::Kvmesh, 1.0, 1.0) });
        let round = |ok: u64, envoy: f64, indexer: f64, client: f64| Rate {
            ok,
            seconds: 1.0,
            envoy_cpu_s: envoy,
            indexer_cpu_s: indexer,
            client_cpu_s: client,
            rounds: 1,
            cpu_rounds: 1,
            ..Default::default()
        };
        let mut e = round(400, 0.2, 0.4, 0.08);
        e.add(round(600, 0.3, 0.6, 0.12));
        let c =
            summarize("c", Path::ExtProc, &v, Some(e), Some(round(2000, 0.2, 0.0, 0.2))).unwrap();
        assert_eq!((c.name.as_str(), c.edge.as_deref()), ("c_ext_proc", Some(EXT_PROC_EDGE)));
        // 11 picker samples: 0.9 (the pin, kept), 2.0 … 2.9; rank 6 = 2.4, rank 11 = 2.9.
        assert!((c.p50_added_ms - (2.4 - 0.5)).abs() < 1e-9, "{c:?}");
        assert!((c.p99_added_ms.unwrap() - (2.9 - 0.5)).abs() < 1e-9, "{c:?}");
        assert_eq!((c.fallbacks, c.failed, c.samples), (Some(1), Some(0), Some(10)));
        let cpu = c.cpu_ms_per_request.unwrap();
        assert!(
            (cpu.envoy_ms - 0.5).abs() < 1e-9
                && (cpu.indexer_ms - 1.0).abs() < 1e-9
                && (cpu.client_ms - 0.2).abs() < 1e-9,
            "{cpu:?}: 0.5 Envoy CPU-s, 1.0 indexer, 0.2 client over 1,000 requests"
        );
        assert!(c.plain_cpu_ms_per_request.is_some_and(|p| (p.envoy_ms - 0.1).abs() < 1e-12));
        // A round whose CPU was not read leaves the sum without a per-request figure.
        e.add(Rate { ok: 5, rounds: 1, ..Default::default() });
        assert_eq!(e.cpu_ms_per_request(), None);
    }

    #[test]
    fn paths_take_turns_and_fallbacks_are_read_per_path() {
        let three = [Path::Kvmesh, Path::ExtProc, Path::Plain];
        assert_eq!(order(&three, 0), three);
        assert_eq!(order(&three, 1), [Path::ExtProc, Path::Plain, Path::Kvmesh]);
        assert_eq!(order(&three, 5), [Path::Plain, Path::Kvmesh, Path::ExtProc]);
        let two = [Path::Kvmesh, Path::Plain];
        assert_eq!(order(&two, 2), two, "two paths alternate as before");
        assert_eq!(order(&two, 3), [Path::Plain, Path::Kvmesh]);
        assert!(order(&[], 1).is_empty());
        assert!(routed_without_indexer(Path::Kvmesh, true, false));
        assert!(
            !routed_without_indexer(Path::Kvmesh, false, false),
            "the filter names its fallbacks"
        );
        assert!(
            routed_without_indexer(Path::ExtProc, false, false),
            "no decision: the picker pinned"
        );
        assert!(!routed_without_indexer(Path::ExtProc, false, true));
        assert!(!routed_without_indexer(Path::Plain, true, false));
        assert_eq!([Path::Kvmesh, Path::Plain, Path::ExtProc].map(Path::index), [0, 1, 2]);
        assert_eq!(Path::ExtProc.row_name("chat_8k_cold"), "chat_8k_cold_ext_proc");
        assert_eq!(serde_json::to_string(&Path::ExtProc).unwrap(), "\"ext_proc\"");
    }

    #[test]
    fn indexer_timers_give_one_request_s_share() {
        let scrape = |route: f64, n: f64, tok: f64, tn: f64| {
            crate::prom::parse(&format!(
                "{ROUTE_TIMER}_sum {route}\n{ROUTE_TIMER}_count {n}\n{TOKENIZE_TIMER}_sum {tok}\n{TOKENIZE_TIMER}_count {tn}\n{ROUTE_TIMER}_bucket{{le=\"0.001\"}} 3\n{MATCH_TIMER}_sum {}\n{MATCH_TIMER}_count {n}\n{SCORE_TIMER}_sum {}\n{SCORE_TIMER}_count {tn}\n",
                route / 10.0,
                route / 5.0
            ))
            .unwrap()
        };
        let a = IndexerTimers::from_scrape(&scrape(0.5, 10.0, 0.2, 10.0)).unwrap();
        let b = IndexerTimers::from_scrape(&scrape(0.5012, 11.0, 0.2004, 11.0)).unwrap();
        let share = b.one_route_since(&a).unwrap();
        let (route, tok) = (share.route_ms, share.tokenize_ms);
        assert!((route - 1.2).abs() < 1e-6 && (tok.unwrap() - 0.4).abs() < 1e-6, "{route} {tok:?}");
        assert!(
            (share.match_ms.unwrap() - 0.12).abs() < 1e-6
                && (share.score_ms.unwrap() - 0.24).abs() < 1e-6,
            "{share:?}"
        );
        let c = IndexerTimers::from_scrape(&scrape(0.6, 13.0, 0.3, 12.0)).unwrap();
        assert_eq!(c.one_route_since(&b), None, "two routes in between: not attributable");
        let d = IndexerTimers::from_scrape(&scrape(0.7, 14.0, 0.3, 12.0)).unwrap();
        assert_eq!(
            d.one_route_since(&c).map(|x| (x.tokenize_ms, x.score_ms)),
            Some((None, None)),
            "no tokenization (token-id prompt)"
        );
        assert!(IndexerTimers::from_scrape(&[]).is_none());
    }

    #[test]
    fn a_path_without_samples_gives_no_row() {
        let v = vec![s("c", Path::Kvmesh, 1.0, 2.0), s("c", Path::Plain, 1.0, 2.0)];
        assert!(summarize("c", Path::ExtProc, &v, None, None).is_none());
        assert!(summarize("c", Path::Kvmesh, &v[..1], None, None).is_none());
        let mut r = Rate::default();
        assert_eq!(r.per_second(), None);
        r.add(Rate { ok: 5, failed: 1, fallbacks: 2, seconds: 0.5, ..Default::default() });
        assert_eq!(
            (r.routes_per_indexer_core(), r.indexer_cores()),
            (None, None),
            "indexer CPU not read"
        );
        r.add(Rate {
            ok: 5,
            failed: 0,
            fallbacks: 0,
            seconds: 0.5,
            indexer_routes: 12.0,
            indexer_cpu_s: 0.25,
            ..Default::default()
        });
        assert_eq!((r.per_second(), r.failed, r.fallbacks), (Some(10.0), 1, 2));
        assert_eq!((r.routes_per_indexer_core(), r.indexer_cores()), (Some(48.0), Some(0.25)));
    }
}
