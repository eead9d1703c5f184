//! Every Grafana panel query and every recording rule works against a real Prometheus that scraped
//! a running kvmesh stack (Envoy with the filter, the indexer, vllm-sim workers): each query parses
//! and returns data. Scrape jobs use the names the rules and dashboard expect (`kvmesh-gateway`,
//! `kvmesh-indexer`, `engines`; see envoy/prometheus/kvmesh-rules.yaml).

use std::time::Duration;

use anyhow::Context;
use kvmesh_e2e::client::{chat_body, filler, post_json};
use kvmesh_e2e::poll;
use kvmesh_e2e::procs::repo_root;
use kvmesh_e2e::prometheus::{Options, Prometheus, OPERATOR_QUERIES};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

/// Window substituted for Grafana's `$__rate_interval`: wide enough to hold the whole traffic burst.
const RATE_WINDOW: &str = "2m";

/// Metrics the dashboard already queries that no binary exports yet (same list as
/// envoy/check_configs.py). Their targets are skipped, and the test fails once they appear, so the
/// entry gets removed.
const PLANNED: &[&str] = &[];

/// Panels whose values must be numbers (title prefix): the router-vs-engine hit rates.
const MUST_BE_FINITE: &str = "KV hit rate";

/// Grafana variables → concrete values for this Prometheus.
fn substitute(expr: &str) -> String {
    expr.replace("$__rate_interval", RATE_WINDOW)
        .replace("$gateway_job", "kvmesh-gateway")
        .replace("$indexer_job", "kvmesh-indexer")
}

fn dashboard_targets() -> anyhow::Result<Vec<(String, String)>> {
    let path = repo_root().join("envoy/grafana/kvmesh-dashboard.json");
    let dash: Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let mut out = Vec::new();
    let mut stack: Vec<&Value> = dash["panels"].as_array().context("panels")?.iter().collect();
    while let Some(panel) = stack.pop() {
        if let Some(children) = panel["panels"].as_array() {
            stack.extend(children);
        }
        for t in panel["targets"].as_array().into_iter().flatten() {
            let title = format!(
                "{} [{}]",
                panel["title"].as_str().unwrap_or("?"),
                t["refId"].as_str().unwrap_or("?")
            );
            out.push((title, t["expr"].as_str().context("target without expr")?.to_owned()));
        }
    }
    Ok(out)
}

fn recording_rules() -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(repo_root().join("envoy/prometheus/kvmesh-rules.yaml"))?;
    let mut names: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- record: "))
        .map(|s| s.trim().to_owned())
        .collect();
    names.dedup();
    Ok(names)
}

/// Some traffic of every kind the panels look at: shared prefixes, unique prompts, a chat, a stream.
async fn send_traffic(stack: &Stack) -> anyhow::Result<()> {
    let c = stack.client().clone();
    let completions = stack.gateway("/v1/completions");
    let shared = filler(7, 600);
    for i in 0..24u64 {
        let prompt =
            if i % 2 == 0 { format!("{shared} {}", filler(i, 30)) } else { filler(500 + i, 80) };
        let r = post_json(
            &c,
            &completions,
            &json!({"model": "deepseek-v4", "prompt": prompt, "max_tokens": 4}),
            &[],
        )
        .await?;
        anyhow::ensure!(r.status == 200, "completion {i}: {} {}", r.status, r.text);
    }
    let chat = stack.gateway("/v1/chat/completions");
    let mut messages = vec![("user".to_owned(), filler(99, 200))];
    for turn in 0..3 {
        let r =
            post_json(&c, &chat, &chat_body(&messages, 8), &[("x-session-id", "dashboard-check")])
                .await?;
        anyhow::ensure!(r.status == 200, "chat turn {turn}: {} {}", r.status, r.text);
        messages.push(("assistant".to_owned(), r.chat_content().unwrap_or_default()));
        messages.push(("user".to_owned(), filler(100 + turn, 20)));
    }
    let mut streamed = chat_body(&messages, 8);
    streamed["stream"] = json!(true);
    let r = post_json(&c, &chat, &streamed, &[]).await?;
    anyhow::ensure!(r.status == 200, "stream: {} {}", r.status, r.text);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_and_recording_rule_returns_data() -> anyhow::Result<()> {
    let stack = Stack::start(StackSpec::aggregate(3)).await?;
    // The shipped rules, evaluated every second instead of every 30 s so the test need not wait.
    let prom = Prometheus::start(&stack, Options { port: None, fast_rules: true }).await?;
    // The indexer marks workers healthy after its first scrape of them.
    let fleet_url = stack.indexer_url(kvmesh_core::api::FLEET_PATH);
    poll::until("every worker healthy in the indexer's fleet", || async {
        let fleet: Value = stack.client().get(&fleet_url).send().await.ok()?.json().await.ok()?;
        let workers = fleet["workers"].as_array()?;
        (workers.len() == stack.workers.len() && workers.iter().all(|w| w["healthy"] == true))
            .then_some(())
    })
    .await?;
    // A baseline sample of every job before the traffic, so rate() sees the increase.
    poll::until("a first scrape of every job", || async {
        let r = prom.query("count by (job) (up == 1)").await.ok()?;
        (r.len() == 3).then_some(())
    })
    .await?;
    send_traffic(&stack).await?;

    // Wait until every job has been scraped since the traffic ended (and the engine-mirroring
    // indexer metrics have caught up with the engines).
    let after = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs_f64();
    poll::until("a scrape of every job after the traffic", || async {
        let r = prom.query("min by (job) (timestamp(up == 1))").await.ok()?;
        let fresh = r
            .iter()
            .filter(|s| {
                s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse::<f64>().ok())
                    .is_some_and(|t| t > after + 1.0)
            })
            .count();
        (fresh == 3).then_some(())
    })
    .await?;
    poll::until("the indexer's mirror of the engines' prefix-cache counters", || async {
        let r = prom.query("sum(kvmesh_engine_prefix_cache_queries_total) > 0").await.ok()?;
        (!r.is_empty()).then_some(())
    })
    .await?;

    // Series created during the burst need a second sample before rate() sees them: re-check the
    // failing targets until they all pass or patience runs out.
    let mut pending: Vec<(String, String)> = Vec::new();
    let mut failures = Vec::new();
    let mut checked = 0;
    for (title, expr) in dashboard_targets()? {
        let expr = substitute(&expr);
        if let Some(planned) = PLANNED.iter().find(|m| expr.contains(*m)) {
            let present = prom.query(&format!("count({planned})")).await?;
            if !present.is_empty() {
                failures.push(format!("{planned} is exported now: remove it from PLANNED (here and in envoy/check_configs.py)"));
            }
            // It still has to parse.
            if let Err(e) = prom.query(&expr).await {
                failures.push(format!("{title}: does not parse: {e}\n    {expr}"));
            }
            eprintln!("planned   {title}: {planned} not exported yet");
            continue;
        }
        pending.push((title, expr));
    }
    let deadline = std::time::Instant::now() + poll::patience();
    loop {
        let mut still = Vec::new();
        for (title, expr) in pending {
            match prom.query(&expr).await {
                Err(e) => failures.push(format!("{title}: error {e}\n    {expr}")),
                Ok(r) if r.is_empty() => still.push((title, expr)),
                Ok(r) => {
                    let finite = r
                        .iter()
                        .filter(|s| {
                            s["value"][1]
                                .as_str()
                                .and_then(|v| v.parse::<f64>().ok())
                                .is_some_and(f64::is_finite)
                        })
                        .count();
                    // The headline panel must show numbers, not NaN: a stack that routes nothing would
                    // otherwise pass with 0/0.
                    if finite == 0 && title.starts_with(MUST_BE_FINITE) {
                        still.push((title, expr));
                        continue;
                    }
                    checked += 1;
                    eprintln!("ok        {title}: {} series ({finite} finite)", r.len());
                }
            }
        }
        pending = still;
        if pending.is_empty() || std::time::Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    if !pending.is_empty() {
        // Say what the stack did export, so a missing series is easy to tell from a wrong query.
        let names =
            prom.query("count by (__name__, job) ({job=~\"kvmesh-.*\"})").await.unwrap_or_default();
        let mut names: Vec<String> = names
            .iter()
            .map(|s| {
                format!(
                    "{}/{}",
                    s["metric"]["job"].as_str().unwrap_or("?"),
                    s["metric"]["__name__"].as_str().unwrap_or("?")
                )
            })
            .collect();
        names.sort();
        for (title, expr) in &pending {
            failures.push(format!("{title}: no data\n    {expr}"));
        }
        failures.push(format!("series present: {}", names.join(" ")));
    }

    // The queries `make run PROMETHEUS=1` prints must at least parse.
    for (what, expr) in OPERATOR_QUERIES {
        if let Err(e) = prom.query(expr).await {
            failures.push(format!("operator query ({what}): {e}\n    {expr}"));
        }
    }

    // Recording rules are evaluated by this Prometheus from the same rule file: each must produce.
    for record in recording_rules()? {
        let got = poll::until(&format!("recording rule {record}"), || async {
            let r = prom.query(&record).await.ok()?;
            (!r.is_empty()).then_some(r.len())
        })
        .await;
        match got {
            Ok(n) => {
                checked += 1;
                eprintln!("ok        rule {record}: {n} series");
            }
            Err(e) => failures.push(format!("recording rule {record}: {e}")),
        }
    }
    assert!(failures.is_empty(), "{} queries failed:\n{}", failures.len(), failures.join("\n"));
    assert!(checked > 20, "only {checked} queries checked");
    Ok(())
}
