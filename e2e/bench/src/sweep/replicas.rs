//! Several gateway replicas (issue 47, point 1), the pure part: how the client spreads requests
//! over them as an L4 load balancer would ([`Spread`], [`replica_for`]) and the two figures a
//! replica point adds to a point's summary — session moves ([`session_moves`]) and the load's
//! coefficient of variation ([`load_cov`]).
//!
//! **What a connection is.** The bench's client holds one HTTP connection pool for every request,
//! but a real client of a gateway is one user, or one agent, holding its connection for its
//! conversation. So a *session* is a connection here: [`Spread::PerConnection`] sends every turn
//! of the session `i`-th to start (the schedule's order) to replica `i mod N` — the round robin an
//! L4 balancer does over connections as they open. [`Spread::PerRequest`] sends the request
//! numbered `k` in send order to replica `k mod N` — an L7 balancer, or HTTP/2 connections whose
//! streams are balanced one by one: a conversation's turns land on different replicas, so each
//! replica's indexer must find the KV that another replica's request left, through the engines'
//! events.

use crate::record::RequestRecord;
use crate::stats::balance;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How the client spreads requests over gateway replicas.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Spread {
    /// Round robin over sessions (a session is one client connection): every turn of a session
    /// goes to the same replica.
    #[default]
    PerConnection,
    /// Round robin over requests in send order: consecutive turns of a session go to different
    /// replicas.
    PerRequest,
}

impl Spread {
    /// Both spreads, in the order the sweep runs them.
    pub const ALL: [Spread; 2] = [Spread::PerConnection, Spread::PerRequest];

    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::PerConnection => "per-connection",
            Self::PerRequest => "per-request",
        }
    }

    /// One spread by name.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|x| x.name() == s.trim())
            .ok_or_else(|| format!("unknown spread {s:?} (per-connection, per-request)"))
    }

    /// A comma-separated list of spreads (at least one, none twice).
    pub fn parse_list(s: &str) -> Result<Vec<Self>, String> {
        let mut out = Vec::new();
        for x in s.split(',').filter(|x| !x.trim().is_empty()) {
            let spread = Self::parse(x)?;
            if !out.contains(&spread) {
                out.push(spread);
            }
        }
        if out.is_empty() {
            return Err("--replica-spread: no spread named".into());
        }
        Ok(out)
    }
}

/// The replica (0-based, of `replicas`) that the `session_pos`-th session's request numbered `seq`
/// (0-based, in send order over the whole point) goes to. One gateway: always 0.
pub fn replica_for(spread: Spread, session_pos: usize, seq: u64, replicas: usize) -> usize {
    let n = replicas.max(1);
    match spread {
        Spread::PerConnection => session_pos % n,
        Spread::PerRequest => (seq % n as u64) as usize,
    }
}

/// The replica counts of `--replicas` (comma-separated, each ≥ 1, none twice, in the given order).
pub fn parse_replica_counts(s: &str) -> Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for x in s.split(',').filter(|x| !x.trim().is_empty()) {
        let n: usize = x.trim().parse().map_err(|_| format!("--replicas: {x:?} is not a count"))?;
        if n == 0 {
            return Err("--replicas: a count must be at least 1".into());
        }
        if !out.contains(&n) {
            out.push(n);
        }
    }
    if out.is_empty() {
        return Err("--replicas: no count named".into());
    }
    Ok(out)
}

/// How often a session's turns changed worker.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct SessionMoves {
    /// Follow-up turns (a turn after another answered turn of its session) whose serving worker
    /// is known, with the previous turn's known too.
    pub follow_ups: usize,
    /// Of those, the turns served by another worker than the session's previous turn.
    pub moves: usize,
    /// Sessions with at least one move.
    pub sessions_moved: usize,
}

impl SessionMoves {
    /// Moves per follow-up turn, `None` without follow-ups.
    pub fn rate(&self) -> Option<f64> {
        (self.follow_ups > 0).then(|| self.moves as f64 / self.follow_ups as f64)
    }
}

/// Session moves over the answered records that name their session, turn and worker (the
/// engine's `x-sim-worker`): turns are taken in turn order within each session, and a follow-up
/// turn is compared with the session's previous answered turn.
pub fn session_moves(records: &[RequestRecord]) -> SessionMoves {
    let mut by_session: BTreeMap<&str, Vec<(u32, &str)>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.ok()) {
        if let (Some(s), Some(t), Some(w)) = (r.session.as_deref(), r.turn, r.worker.as_deref()) {
            by_session.entry(s).or_default().push((t, w));
        }
    }
    let mut out = SessionMoves::default();
    for turns in by_session.values_mut() {
        turns.sort_unstable_by_key(|(t, _)| *t);
        let moves = turns.windows(2).filter(|w| w[0].1 != w[1].1).count();
        out.follow_ups += turns.len().saturating_sub(1);
        out.moves += moves;
        out.sessions_moved += usize::from(moves > 0);
    }
    out
}

/// The coefficient of variation (population standard deviation ÷ mean) of prompt tokens per
/// worker over the answered records, idle workers of `fleet` counting 0 — the load figure SGLang's
/// gateway publishes beside max/mean. `None` when nothing was served.
pub fn load_cov(records: &[RequestRecord], fleet: &[String]) -> Option<f64> {
    let b = balance(
        records.iter().filter(|r| r.ok()).filter_map(|r| {
            r.worker.as_deref().map(|w| (w, r.prompt_tokens.or(r.input_tokens).unwrap_or(0) as f64))
        }),
        fleet,
    );
    cov(&b.per_worker.values().copied().collect::<Vec<f64>>())
}

/// Population coefficient of variation of `values`; `None` when their mean is not > 0.
pub fn cov(values: &[f64]) -> Option<f64> {
    let n = values.len() as f64;
    let mean = values.iter().sum::<f64>() / n;
    if !(mean > 0.0 && mean.is_finite()) {
        return None;
    }
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    Some(var.sqrt() / mean)
}

/// The gateway replicas a point ran behind and how the client spread requests over them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaSetup {
    /// Gateway replicas (each an Envoy with the filter and, under kvmesh, its own indexer).
    pub count: usize,
    /// How the client spread requests over them.
    pub spread: Spread,
}

impl Default for ReplicaSetup {
    fn default() -> Self {
        Self { count: 1, spread: Spread::PerConnection }
    }
}

impl ReplicaSetup {
    /// One gateway: the sweep as before.
    pub fn single(&self) -> bool {
        self.count <= 1
    }

    /// The point directory's extra level (`n4-per-request`), empty for one gateway.
    pub fn dir_part(&self) -> Option<String> {
        (!self.single()).then(|| format!("n{}-{}", self.count, self.spread.name()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(session: &str, turn: u32, worker: &str, prompt: u64) -> RequestRecord {
        RequestRecord {
            session: Some(session.into()),
            turn: Some(turn),
            worker: Some(worker.into()),
            status: Some(200),
            prompt_tokens: Some(prompt),
            ..Default::default()
        }
    }

    #[test]
    fn per_connection_keeps_a_session_on_one_replica_and_per_request_rotates() {
        // Session 5's turns, sent as requests 10, 13, 17: one replica per connection, turns
        // spread when each request is balanced on its own.
        let per_conn: Vec<usize> =
            [10, 13, 17].iter().map(|&k| replica_for(Spread::PerConnection, 5, k, 4)).collect();
        assert_eq!(per_conn, [1, 1, 1]);
        let per_req: Vec<usize> =
            [10, 13, 17].iter().map(|&k| replica_for(Spread::PerRequest, 5, k, 4)).collect();
        assert_eq!(per_req, [2, 1, 1]);
        // Sessions in start order round robin over the replicas.
        let first: Vec<usize> =
            (0..6).map(|s| replica_for(Spread::PerConnection, s, 0, 3)).collect();
        assert_eq!(first, [0, 1, 2, 0, 1, 2]);
        for spread in Spread::ALL {
            assert_eq!(replica_for(spread, 7, 9, 1), 0, "one gateway");
            assert_eq!(replica_for(spread, 7, 9, 0), 0, "zero is one");
        }
    }

    #[test]
    fn spreads_and_counts_parse_and_refuse() {
        assert_eq!(
            Spread::parse_list("per-request, per-connection,per-request").unwrap(),
            [Spread::PerRequest, Spread::PerConnection]
        );
        assert!(Spread::parse_list("per-session").is_err());
        assert!(Spread::parse_list(" , ").is_err());
        assert_eq!(parse_replica_counts("1,2,4,8,2").unwrap(), [1, 2, 4, 8]);
        for bad in ["0", "x", "", "2,-1"] {
            assert!(parse_replica_counts(bad).is_err(), "{bad:?}");
        }
        let s =
            serde_json::to_string(&ReplicaSetup { count: 2, spread: Spread::PerRequest }).unwrap();
        assert_eq!(s, r#"{"count":2,"spread":"per-request"}"#);
        assert_eq!(ReplicaSetup::default().dir_part(), None);
        assert_eq!(
            ReplicaSetup { count: 8, spread: Spread::PerConnection }.dir_part().as_deref(),
            Some("n8-per-connection")
        );
    }

    #[test]
    fn moves_count_follow_ups_in_turn_order_and_skip_unknowns() {
        let mut failed = rec("b", 2, "w0", 10);
        failed.status = Some(503);
        let mut unnamed = rec("c", 1, "w0", 10);
        unnamed.worker = None;
        let records = vec![
            rec("a", 2, "w1", 10),
            rec("a", 0, "w0", 10),
            rec("a", 1, "w0", 10), // a: w0 w0 w1 → one move of two follow-ups
            rec("b", 0, "w2", 10),
            rec("b", 1, "w2", 10),
            failed, // not answered: not a follow-up
            rec("c", 0, "w3", 10),
            unnamed,
            rec("d", 0, "w1", 10), // single turn: no follow-up
        ];
        let m = session_moves(&records);
        assert_eq!(m, SessionMoves { follow_ups: 3, moves: 1, sessions_moved: 1 });
        assert_eq!(m.rate(), Some(1.0 / 3.0));
        assert_eq!(session_moves(&[]).rate(), None);
    }

    #[test]
    fn cov_counts_idle_workers_and_is_zero_when_even() {
        let fleet: Vec<String> = ["w0", "w1"].iter().map(|s| s.to_string()).collect();
        let even = [rec("a", 0, "w0", 100), rec("b", 0, "w1", 100)];
        assert_eq!(load_cov(&even, &fleet), Some(0.0));
        // All on one of two workers: values 200 and 0, mean 100, sd 100.
        let skewed = [rec("a", 0, "w0", 100), rec("b", 0, "w0", 100)];
        assert_eq!(load_cov(&skewed, &fleet), Some(1.0));
        assert_eq!(load_cov(&[], &fleet), None);
        assert_eq!(cov(&[]), None);
        let c = cov(&[1.0, 2.0, 3.0]).unwrap();
        assert!((c - (2.0f64 / 3.0).sqrt() / 2.0).abs() < 1e-12, "{c}");
    }
}
