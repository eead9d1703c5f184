//! Step 7: the indexer hung (SIGSTOP), the breaker seen open, samples and a burst while it
//! hangs, Envoy's connections to it sampled, and the time to routing again after SIGCONT.

use super::*;

/// Peak `upstream_cx_active` of Envoy's indexer cluster, read every [`CX_EVERY`] until `stop`.
pub(super) fn sample_indexer_connections(
    client: reqwest::Client,
    admin: String,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Option<u64>> {
    let url =
        format!("{admin}/stats/prometheus?filter=^cluster\\.kvmesh_indexer\\.upstream_cx_active$");
    tokio::spawn(async move {
        let peak = AtomicU64::new(0);
        let mut read = false;
        while !stop.load(Ordering::Relaxed) {
            let text = async { client.get(&url).send().await.ok()?.text().await.ok() };
            let n = tokio::time::timeout(Duration::from_secs(2), text)
                .await
                .ok()
                .flatten()
                .and_then(|t| kvmesh_e2e::prom::Metrics::parse(&t).ok())
                .and_then(|m| {
                    m.select(
                        "envoy_cluster_upstream_cx_active",
                        &[("envoy_cluster_name", "kvmesh_indexer")],
                    )
                    .next()
                    .map(|s| s.value)
                });
            if let Some(n) = n.filter(|n| n.is_finite() && *n >= 0.0) {
                read = true;
                peak.fetch_max(n as u64, Ordering::Relaxed);
            }
            tokio::time::sleep(CX_EVERY).await;
        }
        read.then(|| peak.load(Ordering::Relaxed))
    })
}

/// The hung-indexer case (step 7): returns the measurements and the case's samples.
pub(super) async fn hung_indexer(
    stack: &Stack,
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadSettings,
    access_log: &Path,
    shape: &Shape,
) -> Result<(HungIndexer, Vec<Sample>)> {
    let pid = stack.indexer.as_ref().map(Proc::pid).context("the stack has no indexer")?;
    let template = cold_template(HUNG_PROMPT_TOKENS, shape);
    let request = |phase: u64, n: u64| {
        body(&cold_request(&template, cold_seed(args.seed, phase, 0, n)), model)
    };
    let mut h = HungIndexer {
        indexer_timeout_ms: args
            .indexer_timeout_ms
            .unwrap_or(kvmesh_core::filter_config::DEFAULT_INDEXER_TIMEOUT_MS),
        connection_bound: u64::from(
            kvmesh_e2e::envoy_config::DEFAULT_INDEXER_MAX_CONNECTIONS + ENVOY_CONCURRENCY,
        ),
        ..Default::default()
    };
    let stop = Arc::new(AtomicBool::new(false));
    let paused = Paused::stop(pid)?;
    let sampler = sample_indexer_connections(client.clone(), stack.admin(""), Arc::clone(&stop));
    tracing::info!(pid, "overhead: indexer stopped (SIGSTOP)");

    // Until the breaker is seen open: every call before waits for the deadline.
    let hung_at = Instant::now();
    let deadline = hung_at + kvmesh_e2e::poll::patience();
    let mut streak = 0;
    while streak < OPEN_STREAK && Instant::now() < deadline {
        let id = format!("hung-open-{}", h.opening_requests);
        let o = tagged(
            client,
            &urls.kvmesh,
            request(HUNG_PHASE, h.opening_requests),
            &id,
            SAMPLE_TIMEOUT,
        )
        .await;
        h.opening_requests += 1;
        streak = open_streak(streak, o.fallback.as_deref());
    }
    h.opening_ms = (streak >= OPEN_STREAK).then(|| hung_at.elapsed().as_secs_f64() * 1e3);

    // With the breaker open: interleaved samples as in the latency phase.
    let mut samples = Vec::new();
    if h.opening_ms.is_some() {
        for n in 0..args.samples as u64 {
            let order =
                if n % 2 == 0 { [Way::Kvmesh, Way::Plain] } else { [Way::Plain, Way::Kvmesh] };
            for way in order {
                let id = format!("{HUNG_CASE}-{n}-{}", way.tag());
                let b = request(HUNG_PHASE + 1, 2 * n + u64::from(way == Way::Plain));
                let o = tagged(client, urls.of(way), b, &id, SAMPLE_TIMEOUT).await;
                if way == Way::Kvmesh {
                    match hung_route(o.fallback.as_deref()) {
                        HungRoute::Skipped => h.skipped += 1,
                        HungRoute::Waited => h.waited += 1,
                        HungRoute::Other => {}
                    }
                }
                samples.push(Sample::measured(HUNG_CASE.to_string(), way, n, id, o));
            }
        }
    }

    // Concurrency against the hung indexer: the connections must stay bounded.
    if args.rps_seconds > 0.0 {
        let make = {
            let (template, model, seed) = (template.clone(), model.to_string(), args.seed);
            Arc::new(move |n: u64| {
                body(&cold_request(&template, cold_seed(seed, HUNG_PHASE + 2, 0, n)), &model)
            })
        };
        let length = HUNG_BURST.min(Duration::from_secs_f64(args.rps_seconds));
        let r = closed_loop(
            client,
            &urls.kvmesh,
            Way::Kvmesh,
            HUNG_BURST_CONCURRENCY,
            length,
            RPS_TIMEOUT,
            make,
        )
        .await;
        h.burst = Some(Burst {
            concurrency: HUNG_BURST_CONCURRENCY as u64,
            ok: r.ok,
            failed: r.failed,
            fallbacks: r.fallbacks,
            seconds: r.seconds,
        });
    }

    // SIGCONT, then the first request the indexer routes.
    paused.resume();
    let resumed = Instant::now();
    let mut n = 0u64;
    while resumed.elapsed() < kvmesh_e2e::poll::patience() {
        let o = tagged(
            client,
            &urls.kvmesh,
            request(HUNG_PHASE + 3, n),
            &format!("hung-resume-{n}"),
            SAMPLE_TIMEOUT,
        )
        .await;
        n += 1;
        if o.error.is_none() && o.fallback.is_none() && o.decision_mode.is_some() {
            h.resume_ms = Some(resumed.elapsed().as_secs_f64() * 1e3);
            break;
        }
        tokio::time::sleep(RESUME_EVERY).await;
    }
    stop.store(true, Ordering::Relaxed);
    h.max_indexer_connections = sampler.await.ok().flatten();
    tracing::info!(
        opening_requests = h.opening_requests,
        opening_ms = h.opening_ms,
        skipped = h.skipped,
        waited = h.waited,
        max_indexer_connections = h.max_indexer_connections,
        resume_ms = h.resume_ms,
        "overhead: indexer hang measured"
    );

    join_access_log(access_log, &mut samples, kvmesh_e2e::poll::patience()).await;
    h.latency = summarize(HUNG_CASE, Way::Kvmesh, &samples, None, None);
    Ok((h, samples))
}

/// Step 7's report section; writes `overhead/{hung-samples.jsonl,hung.json}` when the case ran.
pub(super) fn hung_section(dir: &Path, hung: Result<(HungIndexer, Vec<Sample>)>) -> Result<String> {
    Ok(match hung {
        Ok((h, hung_samples)) => {
            write_jsonl(&dir.join("hung-samples.jsonl"), &hung_samples)?;
            std::fs::write(dir.join("hung.json"), serde_json::to_string_pretty(&h)?)?;
            hung::render(&h) + "\nPer-request samples: `overhead/hung-samples.jsonl`; figures: `overhead/hung.json`."
        }
        Err(e) => {
            tracing::error!(
                error = format!("{e:#}"),
                "overhead: the hung-indexer case did not run"
            );
            format!("**did not run**: {e:#}")
        }
    })
}
