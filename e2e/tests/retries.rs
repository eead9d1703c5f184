//! What Envoy may retry, and who decides it. Envoy retries an engine's 500/502/503 on the next
//! candidate — but not a request carrying `kv_transfer_params`: a decode worker that failed after
//! pulling the producer's KV has spent that hold, so a retry on another worker would pull the same
//! KV a second time (the filter sets `x-envoy-max-retries: 0` on such a request; the client gets
//! the error). And the client has no say: its `x-envoy-*` router headers are stripped before any
//! filter in every shipped config, whatever `x-forwarded-for` claims about where it came from.

use std::collections::BTreeMap;

use kvmesh_core::headers::DEFAULT_SESSION_HEADER;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::stack::{Stack, StackSpec};
use serde_json::{json, Value};

/// Long cold chats, each disaggregated.
const KV_REQUESTS: u64 = 6;

/// `x-forwarded-for` as a client may send it: absent, an internal address, an external one.
const FORWARDED_FOR: [Option<&str>; 3] = [None, Some("10.1.2.3"), Some("203.0.113.7")];

/// What a client adds to ask Envoy for more retries and other timeouts.
const CLIENT_RETRY_HEADERS: [(&str, &str); 3] = [
    ("x-envoy-retry-on", "5xx,reset,retriable-status-codes"),
    ("x-envoy-max-retries", "3"),
    ("x-envoy-retriable-status-codes", "500"),
];

/// Per worker id, the sum of `name` on its `/metrics`.
async fn per_worker(stack: &Stack, name: &str) -> anyhow::Result<BTreeMap<String, f64>> {
    let mut out = BTreeMap::new();
    for w in &stack.workers {
        out.insert(w.id.clone(), stack.scrape(&w.url("/metrics")).await?.sum(name, &[]));
    }
    Ok(out)
}

fn chat(system: String, user: String) -> Value {
    json!({"model": "deepseek-v4", "max_tokens": 4,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_decode_worker_failing_after_its_pull_is_not_retried_elsewhere() -> anyhow::Result<()> {
    let mut spec = StackSpec::disaggregated(1, 3);
    spec.filter_config = json!({"debug_headers": true, "indexer_timeout_ms": 8000});
    spec.routing_toml = "min_remote_prefill_tokens = 1024\nprefill_timeout_ms = 5000\n".into();
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    for w in stack.workers.iter().filter(|w| w.id.starts_with('d')) {
        let r = c
            .post(w.url("/admin/faults"))
            .json(&json!({"fail_after_pull_status": 500}))
            .send()
            .await?;
        assert!(r.status().is_success(), "{}: {}", w.id, r.text().await?);
    }
    let legs0 = per_worker(&stack, "vllm:generation_tokens_total").await?;
    let url = stack.gateway("/v1/chat/completions");
    let mut statuses = Vec::new();
    for i in 0..KV_REQUESTS {
        let body = chat(filler(100 + i, 1500), filler(200 + i, 40));
        let session = format!("kv-{i}");
        let mut extra = vec![(DEFAULT_SESSION_HEADER, session.as_str())];
        // A client asking for retries does not get them either.
        extra.extend(CLIENT_RETRY_HEADERS);
        if let Some(xff) = FORWARDED_FOR[i as usize % FORWARDED_FOR.len()] {
            extra.push(("x-forwarded-for", xff));
        }
        let r = post_json(&c, &url, &body, &extra).await?;
        statuses.push(r.status);
    }
    let legs = per_worker(&stack, "vllm:generation_tokens_total").await?;
    let prefill_legs =
        legs.get("p0").copied().unwrap_or(0.0) - legs0.get("p0").copied().unwrap_or(0.0);
    let pulls = per_worker(&stack, "kvmesh_sim_nixl_pulls_total").await?;
    let decode_pulls: f64 = pulls.iter().filter(|(w, _)| w.starts_with('d')).map(|(_, n)| n).sum();
    eprintln!(
        "statuses {statuses:?}; {prefill_legs} prefill legs, {decode_pulls} pulls by decode workers {pulls:?}"
    );
    assert_eq!(prefill_legs, KV_REQUESTS as f64, "every request was disaggregated");
    assert_eq!(
        decode_pulls, prefill_legs,
        "a producer's kv_transfer_params reached more than one decode worker (Envoy retried a request carrying them)"
    );
    assert!(
        statuses.iter().all(|s| *s == 500),
        "the client gets the decode worker's error: {statuses:?}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_sent_router_headers_have_no_effect() -> anyhow::Result<()> {
    let mut spec = StackSpec::aggregate(2);
    spec.filter_config = json!({"debug_headers": true});
    let stack = Stack::start(spec).await?;
    let c = stack.client().clone();
    let url = stack.gateway("/v1/completions");
    let body =
        |i: u64| json!({"model": "deepseek-v4", "prompt": filler(300 + i, 40), "max_tokens": 2});
    let fault = |patch: Value| {
        let c = c.clone();
        let urls: Vec<String> = stack.workers.iter().map(|w| w.url("/admin/faults")).collect();
        async move {
            for u in urls {
                let r = c.post(&u).json(&patch).send().await?;
                anyhow::ensure!(r.status().is_success(), "{u}: {}", r.text().await?);
            }
            Ok(())
        }
    };

    for (i, xff) in FORWARDED_FOR.iter().enumerate() {
        let mut extra: Vec<(&str, &str)> = xff.iter().map(|v| ("x-forwarded-for", *v)).collect();
        // A timeout far below the engine's answer time: honoured, it would be a 504.
        fault(json!({"clear": true, "extra_latency_ms": 300})).await?;
        let mut with_timeout = extra.clone();
        with_timeout.extend([
            ("x-envoy-upstream-rq-timeout-ms", "20"),
            ("x-envoy-upstream-rq-per-try-timeout-ms", "20"),
        ]);
        let r = post_json(&c, &url, &body(i as u64), &with_timeout).await?;
        assert_eq!(
            r.status, 200,
            "xff {xff:?}: the client's timeout headers were honoured: {}",
            r.text
        );

        // No retries asked for while every worker fails its next request once: honoured, the
        // client would get the 500; the route's policy retries it on the other worker.
        fault(json!({"clear": true, "fail_next_count": 1, "fail_next_status": 500})).await?;
        extra.push(("x-envoy-max-retries", "0"));
        let r = post_json(&c, &url, &body(10 + i as u64), &extra).await?;
        assert_eq!(
            r.status, 200,
            "xff {xff:?}: the client's x-envoy-max-retries was honoured: {}",
            r.text
        );
    }
    Ok(())
}
