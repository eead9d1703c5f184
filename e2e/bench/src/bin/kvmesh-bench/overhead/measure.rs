//! Steps 4 and 6: the interleaved latency samples and the closed-loop requests/s rounds.

use super::*;

/// What the latency and requests/s phases share.
pub(super) struct Phase<'a> {
    pub(super) args: &'a OverheadSettings,
    pub(super) client: &'a reqwest::Client,
    pub(super) urls: &'a Urls,
    pub(super) model: &'a str,
    pub(super) shape: &'a Shape,
    pub(super) texts: &'a Arc<Texts>,
    pub(super) metrics_url: &'a str,
}

impl Phase<'_> {
    /// The index of `c`'s size in its list (the shared-prefix sizes or the sizes).
    pub(super) fn size_index(&self, c: &Case) -> usize {
        let list = if c.kind == Kind::SharedPrefix {
            &self.args.shared_prefixes
        } else {
            &self.args.sizes
        };
        list.iter().position(|s| *s == c.size).unwrap_or(0)
    }
}

/// Step 4: the interleaved latency samples, and when the sampling started.
pub(super) async fn latency_samples(p: &Phase<'_>, all_cases: &[Case]) -> (Vec<Sample>, Instant) {
    let mut samples: Vec<Sample> = Vec::new();
    let mut timers = indexer_timers(p.client, p.metrics_url).await;
    let latency_start = Instant::now();
    let ways = p.urls.ways();
    for n in 0..p.args.samples as u64 {
        for case in all_cases {
            for way in order(&ways, n) {
                samples.push(latency_sample(p, case, n, way, &mut timers).await);
            }
        }
        if (n + 1) % 25 == 0 {
            tracing::info!(
                done = n + 1,
                of = p.args.samples,
                elapsed_s = latency_start.elapsed().as_secs_f64(),
                "overhead: latency samples"
            );
        }
    }
    (samples, latency_start)
}

/// One latency sample; a kvmesh one (filter or picker) with its share of the indexer's timers
/// (`timers`: the last reading, updated).
pub(super) async fn latency_sample(
    p: &Phase<'_>,
    case: &Case,
    n: u64,
    way: Way,
    timers: &mut Option<IndexerTimers>,
) -> Sample {
    let h = request_for(case, p.size_index(case), p.texts, n, way, p.args, p.shape);
    let id = format!("{}-{n}-{}", case.name(), way.tag());
    let o = tagged(p.client, p.urls.of(way), body(&h, p.model), &id, SAMPLE_TIMEOUT).await;
    // Between samples, never during one: this request's share of the indexer's timers.
    let mut share = None;
    let local = o.decision_reason.as_deref() == Some(kvmesh_core::headers::LOCAL_ROUTE_REASON);
    // The picker names no fallback: a response without its decision was pinned.
    let pinned = o.error.is_none()
        && way == Way::ExtProc
        && routed_without_indexer(way, o.fallback.is_some(), o.decision_mode.is_some());
    if way != Way::Plain && !local {
        // Wait for this request's tokenization to finish even when the filter gave up (a request
        // the filter routed locally never reached the indexer: nothing to wait for).
        let want = timers.map_or(0.0, |t| t.tokenizations + 1.0);
        let now =
            settle(p.client, p.metrics_url, want, Duration::from_millis(5), SETTLE_SAMPLE).await;
        share = now.zip(*timers).and_then(|(n, b)| n.one_route_since(&b));
        *timers = now;
    }
    let mut sample = Sample {
        indexer_ms: share.map(|s| s.route_ms),
        tokenize_ms: share.and_then(|s| s.tokenize_ms),
        match_ms: share.and_then(|s| s.match_ms),
        score_ms: share.and_then(|s| s.score_ms),
        ..Sample::measured(case.name(), way, n, id, o)
    };
    if pinned {
        sample.fallback = Some(PICKER_PIN.to_string());
    }
    sample
}

/// Step 6: the requests/s rounds (none when `rps_seconds` or `rps_rounds` is 0), by case and path.
pub(super) async fn rps_rounds(
    p: &Phase<'_>,
    all_cases: &[Case],
    pids: Pids,
) -> HashMap<(String, &'static str), Rate> {
    let mut rates: HashMap<(String, &'static str), Rate> = HashMap::new();
    let ways = p.urls.ways();
    if p.args.rps_seconds > 0.0 && p.args.rps_rounds > 0 {
        for case in all_cases {
            for round in 0..p.args.rps_rounds {
                for way in order(&ways, round as u64) {
                    let r = rps_round(p, case, round, way, pids).await;
                    rates.entry((case.name(), way.tag())).or_default().add(r);
                }
            }
        }
    }
    rates
}

/// The request bodies of one requests/s round: new conversations (or new content) per round
/// and path.
pub(super) fn rps_bodies(
    p: &Phase<'_>,
    case: &Case,
    round: usize,
    way: Way,
) -> Arc<impl Fn(u64) -> Vec<u8> + Send + Sync + 'static> {
    let (c, si, m, shape2, seed, k) = (
        case.clone(),
        p.size_index(case),
        p.model.to_string(),
        p.shape.clone(),
        p.args.seed,
        p.args.bases,
    );
    let texts = p.texts.clone();
    let phase = RPS_PHASE + round as u64 * 3 + way.index();
    Arc::new(move |n: u64| {
        let h = match c.kind {
            Kind::Cold => cold_request(&texts.cold[si], cold_seed(seed, phase, si, n)),
            Kind::Continuation => {
                let list = &texts.bases[si];
                next_turn(&list[(n as usize) % list.len()], (phase << 40) | n, &shape2)
            }
            // Salts 0–2 are the latency phase's; every round starts new conversations.
            Kind::SharedPrefix => shared_prefix_request(&texts.shared[si], k, n, phase, &shape2).0,
        };
        h.body(&m, 1, true).to_string().into_bytes()
    })
}

/// The processes' CPU ticks at one moment: Envoy, the indexer, the client (this process).
fn ticks(pids: Pids) -> Option<[u64; 3]> {
    Some([cpu_ticks(pids.envoy?)?, cpu_ticks(pids.indexer?)?, cpu_ticks(std::process::id())?])
}

/// One closed-loop round on one path, with Envoy's, the indexer's and the client's CPU time
/// around it; a kvmesh round (filter or picker) with the indexer's routes too, read until the
/// indexer is idle again (the CPU of the work the round left behind counts).
pub(super) async fn rps_round(
    p: &Phase<'_>,
    case: &Case,
    round: usize,
    way: Way,
    pids: Pids,
) -> Rate {
    let make = rps_bodies(p, case, round, way);
    let kvmesh = way != Way::Plain;
    let timers_before = if kvmesh { indexer_timers(p.client, p.metrics_url).await } else { None };
    let before = ticks(pids);
    let mut r = closed_loop(
        p.client,
        p.urls.of(way),
        way,
        p.args.rps_concurrency,
        Duration::from_secs_f64(p.args.rps_seconds),
        RPS_TIMEOUT,
        make,
    )
    .await;
    let client_after = cpu_ticks(std::process::id());
    // Abandoned tokenizations (filter timeouts) and background completions must not run into
    // the next round.
    let settled = match (kvmesh, pids.indexer) {
        (true, Some(pid)) => {
            settle_cpu(pid, Duration::from_millis(250), IDLE_TICKS, SETTLE_ROUND).await
        }
        _ => Duration::ZERO,
    };
    // Envoy's and the indexer's CPU until settled; the client's over the loop alone (settling
    // polls `/proc` from this process).
    if let (Some([e0, i0, c0]), Some([e1, i1, _]), Some(c1)) = (before, ticks(pids), client_after) {
        r.envoy_cpu_s = e1.saturating_sub(e0) as f64 / 100.0;
        r.indexer_cpu_s = i1.saturating_sub(i0) as f64 / 100.0;
        r.client_cpu_s = c1.saturating_sub(c0) as f64 / 100.0;
        r.cpu_rounds = 1;
    }
    // The round's indexer work, the tokenizations finished while settling included.
    if let Some(t0) = timers_before {
        if let Some(t1) = indexer_timers(p.client, p.metrics_url).await {
            r.indexer_routes = t1.routes - t0.routes;
        }
    }
    let cpu = r.cpu_ms_per_request();
    tracing::info!(
        case = %case.name(), path = way.tag(), round, ok = r.ok, failed = r.failed, fallbacks = r.fallbacks,
        rps = r.per_second().unwrap_or(0.0), settle_s = settled.as_secs_f64(), indexer_routes = r.indexer_routes,
        indexer_cpu_s = r.indexer_cpu_s, envoy_cpu_ms_per_request = cpu.map(|c| c.envoy_ms),
        indexer_cpu_ms_per_request = cpu.map(|c| c.indexer_ms), client_cpu_ms_per_request = cpu.map(|c| c.client_ms),
        "overhead: requests/s round"
    );
    r
}
