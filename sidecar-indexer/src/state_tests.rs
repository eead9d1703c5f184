//! Placement through the real service (`router(state).oneshot`): the views `route::plan` builds, the
//! backlog and speculative holdings `route::plan` records, and the decisions they lead to.

use std::collections::BTreeMap;
use std::sync::{Arc, OnceLock};

use axum::body::Body;
use axum::http::{Request, StatusCode};
use http_body_util::BodyExt;
use kvmesh_core::api::{DoneReport, Outcome, ReasonCode, RouteDecision, DONE_PATH, ROUTE_PATH};
use kvmesh_core::headers;
use tower::ServiceExt;

use crate::config::{Config, MapEnv};
use crate::http::router;
use crate::scrape::EngineSample;
use crate::service::Service;
use crate::tokenize::PromptTokenizer;

fn tokenizer() -> PromptTokenizer {
    static PATH: OnceLock<std::path::PathBuf> = OnceLock::new();
    let path = PATH.get_or_init(kvmesh_tokens::default_tokenizer_path);
    PromptTokenizer::load(path, None, "<｜begin▁of▁sentence｜>", 1 << 20).unwrap()
}

/// Two decode-capable workers (nothing listens on their ports; scrapes fail slowly enough).
fn service(extra_routing: &str) -> Arc<Service> {
    seeded(extra_routing, crate::clock::Entropy::Os)
}

/// [`service`] drawing its randomness from `entropy`.
fn seeded(extra_routing: &str, entropy: crate::clock::Entropy) -> Arc<Service> {
    let text = format!(
        "listen = \"127.0.0.1:0\"\n[model]\nname = \"m\"\nblock_size = 4\n[routing]\nscrape_interval_ms = 60000\nscrape_timeout_ms = 1000\n{extra_routing}\n\
         [[workers]]\nid = \"w0\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:1\"\n[[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:2\"\n"
    );
    let config = Config::from_toml_str(&text, &MapEnv::default()).unwrap();
    Service::start_seeded(config, None, Arc::new(MapEnv::default()), tokenizer(), entropy).unwrap()
}

fn body(ids: impl Iterator<Item = u32>) -> String {
    let ids: Vec<String> = ids.map(|i| i.to_string()).collect();
    format!(r#"{{"model":"m","prompt":[{}]}}"#, ids.join(","))
}

async fn route(svc: &Arc<Service>, body: String) -> RouteDecision {
    let req = Request::post(ROUTE_PATH)
        .header(headers::KVMESH_PATH, "/v1/completions")
        .body(Body::from(body))
        .unwrap();
    let resp = router(svc.state.clone()).oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
    serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap()
}

async fn done(svc: &Arc<Service>, d: &RouteDecision) {
    let report = DoneReport {
        request_id: "r".into(),
        endpoint: None,
        outcome: Outcome::Success,
        status: Some(200),
        booking_id: d.booking_id.clone(),
        usage: None,
    };
    let req =
        Request::post(DONE_PATH).body(Body::from(serde_json::to_vec(&report).unwrap())).unwrap();
    assert_eq!(router(svc.state.clone()).oneshot(req).await.unwrap().status(), StatusCode::OK);
}

fn metric(svc: &Service, line: &str) -> bool {
    svc.state.metrics.render().lines().any(|l| l == line)
}

#[tokio::test]
async fn a_sibling_follows_the_speculative_holdings_of_its_prefix() {
    let svc = service("");
    // A new 400-token prefix, then a sibling sharing it (its own 20-token tail) before any event.
    let first = route(&svc, body(1000..1400)).await;
    assert_eq!(first.overlap_blocks, 0);
    done(&svc, &first).await; // served: nothing queued any more, only the blocks are fresh
    let sibling = route(&svc, body((1000..1400).chain(5000..5020))).await;
    assert_eq!(sibling.worker, first.worker, "{}", sibling.reason);
    assert_eq!(sibling.overlap_blocks, 0, "speculation is never reported as index overlap");
    // Its speculative holdings make it the worker holding the most; the metric counts them.
    assert_eq!(sibling.reason_codes, [ReasonCode::BestOverlap], "{}", sibling.reason);
    assert!(
        sibling.predicted_ttft_ms.is_some_and(|ms| ms < 5.0),
        "{:?}",
        sibling.predicted_ttft_ms
    );
    assert!(metric(&svc, "kvmesh_speculative_overlap_blocks_total 100"));
    assert!(
        metric(&svc, "router_kv_overlap_blocks_total{model=\"m\"} 0"),
        "engine-truth counter untouched"
    );
    assert!(metric(&svc, "kvmesh_predicted_ttft_seconds_count 2"));
}

#[tokio::test]
async fn without_speculation_the_sibling_sees_nothing() {
    let svc = service("speculative_ttl_ms = 0");
    let first = route(&svc, body(1000..1400)).await;
    done(&svc, &first).await;
    let sibling = route(&svc, body((1000..1400).chain(5000..5020))).await;
    // Nothing cached anywhere: the fastest worker, not one holding the most.
    assert_eq!(sibling.reason_codes, [ReasonCode::LowestCost], "{}", sibling.reason);
    assert_eq!((sibling.overlap_blocks, sibling.best_overlap_blocks), (0, 0));
    assert!(metric(&svc, "kvmesh_speculative_overlap_blocks_total 0"));
}

#[tokio::test]
async fn booked_prefill_spreads_a_cold_burst_and_done_drains_it() {
    let svc = service("");
    let mut per = BTreeMap::new();
    let mut decisions = Vec::new();
    for i in 0..10u32 {
        // Distinct 2000-token prompts: 100 ms of prefill each at the default 20k tokens/s.
        let d = route(&svc, body(i * 10_000..i * 10_000 + 2000)).await;
        *per.entry(d.worker.clone()).or_insert(0) += 1;
        decisions.push(d);
    }
    // Each booking queues its prefill on its worker, so the next one goes to the other (give or
    // take a near tie while the first drains).
    assert!(per.len() == 2 && per.values().all(|n| (4..=6).contains(n)), "{per:?}");
    // Queued prefill ahead shows in the prediction: the first request saw idle workers, and every
    // prompt is as long and as uncached as the first.
    let idle = decisions[0].predicted_ttft_ms.unwrap();
    assert!(
        decisions.iter().skip(1).any(|d| d.predicted_ttft_ms.unwrap() > idle + 1.0),
        "{:?}",
        decisions.iter().map(|d| (&d.reason, d.predicted_ttft_ms)).collect::<Vec<_>>()
    );
    for d in &decisions {
        done(&svc, d).await;
    }
    // Released bookings leave nothing queued, whatever the drain model still holds.
    let d = route(&svc, body(900_000..902_000)).await;
    assert!((d.predicted_ttft_ms.unwrap() - idle).abs() < 1e-6, "{} vs idle {idle}", d.reason);
}

#[tokio::test]
async fn engine_requests_this_replica_did_not_book_count_as_queued_work() {
    let svc = service("");
    // Another gateway's traffic: w0's engine reports 6 waiting requests this indexer never routed.
    {
        let mut fleet = svc.state.fleet.write();
        let w0 = fleet.workers.iter_mut().find(|w| w.cfg.id == "w0").unwrap();
        w0.engine = Some(EngineSample { waiting: 6.0, running: 2.0, ..EngineSample::default() });
    }
    for i in 0..6u32 {
        let d = route(&svc, body(i * 10_000..i * 10_000 + 400)).await;
        // 6 × unknown_request_blocks (64) × block_size (4) tokens ahead on w0; without them the
        // two idle workers tie and each draw picks w0 half the time.
        assert_eq!(d.worker, "w1", "{}", d.reason);
        done(&svc, &d).await;
    }
}

// Paused-clock tests of the shells (`crate::clock`): the ticker, TTL sweeps and scrape health run
// on tokio's clock, which these tests step by minutes without waiting.

/// Polls until `cond` holds (the spawned shell task ran), in 100-ms steps of the paused clock (no
/// real waiting; idle steps let tokio advance to the shells' own timers), failing after an hour
/// of it.
async fn until(what: &str, mut cond: impl FnMut() -> bool) {
    for _ in 0..36_000 {
        if cond() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    panic!("never held: {what}");
}

fn active(svc: &Service, worker: &str) -> u64 {
    svc.state.load.lock().worker(worker).active_requests
}

#[tokio::test(start_paused = true)]
async fn the_expiry_ticker_releases_only_bookings_older_than_load_expiry_secs() {
    let svc = service("load_expiry_secs = 600");
    svc.state.load.lock().book("w0", 4, 16, Some("old"), crate::clock::now());
    tokio::time::advance(std::time::Duration::from_secs(300)).await;
    svc.state.load.lock().book("w1", 4, 16, Some("young"), crate::clock::now());
    tokio::time::advance(std::time::Duration::from_secs(299)).await;
    // The ticker's pass at 599 s releases nothing.
    crate::service::expire_load(&svc.state, crate::clock::now());
    assert_eq!((active(&svc, "w0"), active(&svc, "w1")), (1, 1));
    let ticker = tokio::spawn(crate::service::expiry_loop(svc.clone()));
    tokio::time::advance(std::time::Duration::from_secs(2)).await;
    until("the old booking expired", || active(&svc, "w0") == 0).await;
    assert_eq!(active(&svc, "w1"), 1, "a booking 301 s old is not expired");
    assert!(metric(&svc, "kvmesh_load_expired_total{reason=\"timeout\"} 1"));
    tokio::time::advance(std::time::Duration::from_secs(300)).await;
    until("the young booking expired", || active(&svc, "w1") == 0).await;
    assert!(metric(&svc, "kvmesh_load_expired_total{reason=\"timeout\"} 2"));
    ticker.abort();
}

#[tokio::test(start_paused = true)]
async fn approximate_blocks_expire_on_the_clock_routes_read() {
    // The blocks a decision records are stamped on the indexer's clock and expired by the
    // service's ticker passes on it: a paused clock steps the TTL without waiting.
    let svc = service("mode = \"approximate\"\napprox_ttl_secs = 60");
    let prompt = || body(7000..7040);
    let first = route(&svc, prompt()).await;
    done(&svc, &first).await;
    svc.barrier();
    let overlap = |svc: &Arc<Service>| {
        let (svc, b) = (svc.clone(), prompt());
        async move {
            let d = route(&svc, b).await;
            done(&svc, &d).await;
            (d.worker, d.overlap_blocks)
        }
    };
    // Held within the TTL (a pass at 59 s keeps them), routed to where they are.
    tokio::time::advance(std::time::Duration::from_secs(59)).await;
    crate::service::expire_load(&svc.state, crate::clock::now());
    svc.barrier();
    let (worker, held) = overlap(&svc).await;
    assert_eq!(worker, first.worker);
    assert!(held > 0, "learned from its own decision: {held}");
    svc.barrier();
    // That route re-stamped them at 59 s; a pass past 59 + 60 s drops them.
    tokio::time::advance(std::time::Duration::from_secs(61)).await;
    crate::service::expire_load(&svc.state, crate::clock::now());
    svc.barrier();
    assert_eq!(overlap(&svc).await.1, 0, "gone after the TTL");
    assert!(svc.state.metrics.approx_expired.get() > 0, "counted");
}

#[tokio::test(start_paused = true)]
async fn speculative_holdings_leave_the_gauge_after_their_ttl() {
    let svc = service("speculative_ttl_ms = 2000");
    let slot = svc.state.fleet.read().workers[0].ranks[0].slot;
    let chains = [kvmesh_core::hashing::SequenceHash(1), kvmesh_core::hashing::SequenceHash(2)];
    svc.state.placement.lock().speculative.record(slot, &chains, crate::clock::now());
    tokio::time::advance(std::time::Duration::from_millis(1999)).await;
    svc.state.refresh_gauges();
    assert!(metric(&svc, "kvmesh_speculative_blocks 2"), "held within the TTL");
    tokio::time::advance(std::time::Duration::from_millis(2)).await;
    svc.state.refresh_gauges();
    assert!(metric(&svc, "kvmesh_speculative_blocks 0"), "gone after the TTL");
}

#[tokio::test(start_paused = true)]
async fn sessions_expire_on_the_clock_routes_read() {
    let svc = service("");
    let ttl = svc.state.config().routing.kv_home_ttl_secs;
    let k = 42u64;
    svc.state.sessions.lock().served(k, "w1", crate::clock::now());
    assert_eq!(
        svc.state.sessions.lock().kv_home.get(k, crate::clock::now()).map(|w| &**w),
        Some("w1")
    );
    tokio::time::advance(std::time::Duration::from_secs(ttl.saturating_sub(1))).await;
    assert!(
        svc.state.sessions.lock().kv_home.get(k, crate::clock::now()).is_some(),
        "kept within its TTL"
    );
    tokio::time::advance(std::time::Duration::from_secs(2)).await;
    assert_eq!(svc.state.sessions.lock().kv_home.get(k, crate::clock::now()), None);
}

#[tokio::test(start_paused = true)]
async fn unanswered_scrapes_make_a_worker_unhealthy_then_one_answer_heals_it() {
    // Nothing listens on the workers' ports: every scrape fails (refused, or its timeout on the
    // paused clock). Three failures in a row (the default) take w0 and w1 out; 60-s intervals pass
    // without waiting.
    let svc = service("");
    let generation = svc.state.fleet.read().generation;
    let scraper = tokio::spawn(crate::service::scrape_loop(svc.clone()));
    until("both workers unhealthy", || svc.state.fleet.read().workers.iter().all(|w| !w.healthy))
        .await;
    scraper.abort();
    let fleet = svc.state.fleet.read();
    assert!(fleet.workers.iter().all(|w| w.scrape_failures >= 3 && w.engine.is_none()));
    assert_eq!(fleet.generation, generation + 1, "one round flipped both: one generation");
    drop(fleet);
    assert!(svc.state.snapshot().decode_candidates().next().is_none());

    let cfg = svc.state.config();
    crate::service::apply_scrapes(
        &svc.state,
        &cfg,
        vec![("w0".into(), Ok(String::new()))],
        crate::clock::now(),
    );
    let fleet = svc.state.fleet.read();
    assert!(fleet.workers[0].healthy && fleet.workers[0].scrape_failures == 0);
    assert!(!fleet.workers[1].healthy);
    assert_eq!(fleet.generation, generation + 2);
}

#[test]
fn scrape_failures_below_the_limit_keep_a_worker_and_the_generation() {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let svc = rt.block_on(async { service("unhealthy_after_failures = 2") });
    let cfg = svc.state.config();
    let generation = svc.state.fleet.read().generation;
    let fail = || vec![("w0".to_string(), Err::<String, String>("refused".into()))];
    crate::service::apply_scrapes(&svc.state, &cfg, fail(), crate::clock::now());
    assert!(svc.state.fleet.read().workers[0].healthy);
    assert_eq!(svc.state.fleet.read().generation, generation);
    crate::service::apply_scrapes(&svc.state, &cfg, fail(), crate::clock::now());
    assert!(!svc.state.fleet.read().workers[0].healthy);
    assert_eq!(svc.state.fleet.read().generation, generation + 1);
    assert!(metric(&svc, "kvmesh_engine_scrapes_total{result=\"error\",worker=\"w0\"} 2"));
}

#[tokio::test]
async fn a_seeded_service_repeats_its_booking_ids_and_near_tie_draws() {
    // Every worker is a near tie, so each cold prompt's worker is drawn from the service's RNG.
    let routing = "near_tie_ms = 1000000.0";
    let run = |entropy| async move {
        let svc = seeded(routing, entropy);
        let mut seen = Vec::new();
        for i in 0..20u32 {
            let d = route(&svc, body(i * 1000..i * 1000 + 40)).await;
            done(&svc, &d).await;
            seen.push((d.worker, d.booking_id.unwrap()));
        }
        seen
    };
    let a = run(crate::clock::Entropy::Seeded(7)).await;
    assert_eq!(a, run(crate::clock::Entropy::Seeded(7)).await);
    assert!(
        a.iter().any(|(w, _)| w == "w0") && a.iter().any(|(w, _)| w == "w1"),
        "draws, not one worker: {a:?}"
    );
    let b = run(crate::clock::Entropy::Seeded(8)).await;
    assert_ne!(a[0].1, b[0].1, "another seed, another booking-id nonce");
}

#[tokio::test]
async fn an_unmeasured_worker_takes_its_measured_peers_throughput() {
    // w0 and w2 decode, w1 prefills. Only w0's engine has computed prompts (5,000 tokens in 1 s of
    // prefill over 2 s): w2 takes w0's 5,000 tokens/s, not the 20,000 default; w1 (another role,
    // maybe other hardware) keeps the default.
    let text = "listen = \"127.0.0.1:0\"\n[model]\nname = \"m\"\nblock_size = 4\n[routing]\nscrape_interval_ms = 60000\nscrape_timeout_ms = 1000\n\
         [[workers]]\nid = \"w0\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:1\"\n[[workers]]\nid = \"w1\"\nrole = \"prefill\"\nendpoint = \"127.0.0.1:2\"\n\
         [[workers]]\nid = \"w2\"\nrole = \"decode\"\nendpoint = \"127.0.0.1:3\"\n";
    let config = Config::from_toml_str(text, &MapEnv::default()).unwrap();
    let svc = Service::start_seeded(
        config,
        None,
        Arc::new(MapEnv::default()),
        tokenizer(),
        crate::clock::Entropy::Os,
    )
    .unwrap();
    let cfg = svc.state.config();
    let engine = |tokens: u32, prefill_s: f64| {
        format!("vllm:prompt_tokens_total {tokens}\nvllm:prompt_tokens_cached_total 0\nvllm:request_prefill_time_seconds_sum {prefill_s}\n")
    };
    let t0 = crate::clock::now();
    let tps = |svc: &Service| -> Vec<f64> {
        let fleet = svc.state.fleet.read();
        fleet.workers.iter().map(|w| fleet.prefill_tokens_per_s(w, &cfg.routing).round()).collect()
    };
    let idle = |id: &str| (id.to_string(), Ok(engine(0, 0.0)));
    crate::service::apply_scrapes(
        &svc.state,
        &cfg,
        vec![("w0".into(), Ok(engine(0, 0.0))), idle("w1"), idle("w2")],
        t0,
    );
    assert_eq!(tps(&svc), vec![20_000.0; 3], "nothing measured: the default");
    crate::service::apply_scrapes(
        &svc.state,
        &cfg,
        vec![("w0".into(), Ok(engine(5000, 1.0))), idle("w1"), idle("w2")],
        t0 + std::time::Duration::from_secs(2),
    );
    assert_eq!(tps(&svc), vec![5_000.0, 20_000.0, 5_000.0]);
    let fleet = svc.state.fleet.read();
    assert_eq!(fleet.workers[2].meter.prefill_tokens_per_s(), None, "w2 itself measured nothing");
}

/// Issue 44: two base models (`a` with adapters `a1`, `a2`; `b` with alias `bee`), workers w0, w1
/// on `a` and w2 on `b`; one index for all.
fn multi() -> Arc<Service> {
    let text = "listen = \"127.0.0.1:0\"\n[routing]\nscrape_interval_ms = 60000\nscrape_timeout_ms = 1000\nserved_models_poll_ms = 0\n\
         [[models]]\nname = \"a\"\nblock_size = 4\nadapters = [\"a1\", \"a2\"]\n\
         [[models]]\nname = \"b\"\naliases = [\"bee\"]\nblock_size = 4\n\
         [[workers]]\nid = \"w0\"\nmodel = \"a\"\nrole = \"both\"\nendpoint = \"127.0.0.1:1\"\n\
         [[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:2\"\n\
         [[workers]]\nid = \"w2\"\nmodel = \"b\"\nrole = \"both\"\nendpoint = \"127.0.0.1:3\"\n";
    let config = Config::from_toml_str(text, &MapEnv::default()).unwrap();
    Service::start_with_tokenizer(config, None, Arc::new(MapEnv::default()), tokenizer()).unwrap()
}

/// A completion body for `model` (none: no `model` field) with token ids `ids`.
fn body_for(model: Option<&str>, ids: &[u32]) -> String {
    let ids: Vec<String> = ids.iter().map(|i| i.to_string()).collect();
    match model {
        Some(m) => format!(r#"{{"model":"{m}","prompt":[{}]}}"#, ids.join(",")),
        None => format!(r#"{{"prompt":[{}]}}"#, ids.join(",")),
    }
}

/// A route call's status, body and `x-kvmesh-error` header.
async fn call(
    svc: &Arc<Service>,
    body: String,
    worker: Option<&str>,
) -> (StatusCode, Vec<u8>, String) {
    let mut req = Request::post(ROUTE_PATH).header(headers::KVMESH_PATH, "/v1/completions");
    if let Some(w) = worker {
        req = req.header(headers::OVERRIDE_WORKER, w);
    }
    let resp =
        router(svc.state.clone()).oneshot(req.body(Body::from(body)).unwrap()).await.unwrap();
    let status = resp.status();
    let reason = resp
        .headers()
        .get(kvmesh_core::api::ERROR_REASON_HEADER)
        .map_or(String::new(), |v| v.to_str().unwrap().to_owned());
    (status, resp.into_body().collect().await.unwrap().to_bytes().to_vec(), reason)
}

/// Stores `tokens` (4-token blocks) on `worker`'s first rank as its engine would, under `lora`.
fn store(svc: &Service, worker: &str, tokens: &[u32], lora: Option<&str>) {
    use crate::events::applier::ApplierMsg;
    use crate::events::decode::{EventBatch, KvEvent};
    let slot = {
        let fleet = svc.state.fleet.read();
        fleet.workers.iter().find(|w| w.cfg.id == worker).unwrap().ranks[0].slot
    };
    let n = tokens.len() / 4;
    let event = KvEvent::Stored {
        block_hashes: (0..n as u64).map(|i| 1000 * u64::from(tokens[0]) + i).collect(),
        parent: None,
        token_ids: tokens[..n * 4].to_vec(),
        block_size: 4,
        lora_name: lora.map(str::to_owned),
        cache_salt: None,
        medium: None,
        group_idx: None,
        spec_kind: None,
        sliding_window: None,
        extra_terms: vec![],
    };
    let batch = EventBatch { ts: 0.0, events: vec![event], dp_rank: None };
    svc.state.applier.send(ApplierMsg::Batch { slot, seq: 0, batch }).unwrap();
    svc.barrier();
}

fn decision(body: &[u8]) -> RouteDecision {
    serde_json::from_slice(body).unwrap()
}

#[tokio::test]
async fn each_model_routes_within_its_workers_and_reads_matches_only_there() {
    let svc = multi();
    let prompt: Vec<u32> = (7000..7040).collect();
    // w2 (model b) holds the prompt; the same chains under model a are another model's blocks.
    store(&svc, "w2", &prompt, None);
    for model in [None, Some("a"), Some("a1")] {
        let (status, body, _) = call(&svc, body_for(model, &prompt), None).await;
        assert_eq!(status, StatusCode::OK, "{model:?}");
        let d = decision(&body);
        assert!(d.worker == "w0" || d.worker == "w1", "{model:?} → {}", d.worker);
        assert_eq!(d.best_overlap_blocks, 0, "{model:?}: model b's blocks are not a's");
    }
    for model in ["b", "bee"] {
        let d = decision(&call(&svc, body_for(Some(model), &prompt), None).await.1);
        assert_eq!((d.worker.as_str(), d.overlap_blocks), ("w2", 9), "{model}");
    }
    assert!(metric(&svc, "router_kv_overlap_blocks_total{model=\"b\"} 18"));
    assert!(metric(&svc, "router_kv_overlap_blocks_total{model=\"a\"} 0"));
    let decided = |model: &str| -> u64 {
        let text = svc.state.metrics.render();
        text.lines()
            .filter(|l| {
                l.starts_with("kvmesh_decisions_total{")
                    && l.contains(&format!("model=\"{model}\""))
            })
            .map(|l| l.rsplit(' ').next().unwrap().parse::<u64>().unwrap())
            .sum()
    };
    assert_eq!((decided("a"), decided("b")), (3, 2));
    assert!(metric(&svc, "kvmesh_adapter_decisions_total{adapter=\"a1\",model=\"a\"} 1"));
}

#[tokio::test]
async fn an_adapter_request_matches_only_blocks_stored_under_its_adapter() {
    let svc = multi();
    let prompt: Vec<u32> = (9000..9040).collect();
    store(&svc, "w1", &prompt, Some("a1"));
    let overlap = |d: RouteDecision| (d.worker, d.best_overlap_blocks);
    let a1 = overlap(decision(&call(&svc, body_for(Some("a1"), &prompt), None).await.1));
    assert_eq!(a1, ("w1".to_owned(), 9));
    for other in ["a", "a2"] {
        let (_, best) =
            overlap(decision(&call(&svc, body_for(Some(other), &prompt), None).await.1));
        assert_eq!(best, 0, "{other} must not match a1's blocks");
    }
}

#[tokio::test]
async fn an_unknown_model_is_vllms_404_and_counted() {
    let svc = multi();
    let (status, body, reason) = call(&svc, body_for(Some("gpt-4"), &[1, 2, 3]), None).await;
    assert_eq!(status, StatusCode::NOT_FOUND);
    assert_eq!(reason, "unknown_model");
    let got: serde_json::Value = serde_json::from_slice(&body).unwrap();
    assert_eq!(got, serde_json::to_value(kvmesh_core::models::not_found("gpt-4")).unwrap());
    assert!(metric(&svc, "kvmesh_route_errors_total{model=\"\",reason=\"unknown_model\"} 1"));
    // An override naming another model's worker is refused, never followed.
    let (status, _, reason) = call(&svc, body_for(Some("a"), &[1, 2, 3]), Some("w2")).await;
    assert_eq!((status, reason.as_str()), (StatusCode::BAD_REQUEST, "override_other_model"));
    let (status, body, _) = call(&svc, body_for(Some("bee"), &[1, 2, 3]), Some("w2")).await;
    assert_eq!((status, decision(&body).worker.as_str()), (StatusCode::OK, "w2"));
}

#[tokio::test]
async fn the_fleet_and_models_endpoints_list_every_model() {
    let svc = multi();
    let snap = svc.state.snapshot();
    let models: Vec<_> = snap.models.iter().map(|m| (m.name.as_str(), m.adapters.len())).collect();
    assert_eq!(models, vec![("a", 2), ("b", 0)]);
    let served: Vec<_> = snap.workers.iter().map(|w| (w.id.as_str(), w.model.as_str())).collect();
    assert_eq!(served, vec![("w0", "a"), ("w1", "a"), ("w2", "b")]);
    let req = Request::get(crate::http::MODELS_PATH).body(Body::empty()).unwrap();
    let resp = router(svc.state.clone()).oneshot(req).await.unwrap();
    let list: serde_json::Value =
        serde_json::from_slice(&resp.into_body().collect().await.unwrap().to_bytes()).unwrap();
    let ids: Vec<_> =
        list["data"].as_array().unwrap().iter().map(|e| e["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec!["a", "a1", "a2", "b", "bee"]);
    // Adapters an engine reports join the catalog; one named like another entry is refused.
    let mut served = crate::catalog::Served::default();
    served.by_worker.insert("w2".into(), ("b".into(), vec!["b-x".into(), "a1".into()]));
    svc.state.served.lock().served = served;
    assert!(svc.state.rebuild_catalog());
    let d = decision(&call(&svc, body_for(Some("b-x"), &[5, 6, 7, 8, 9]), None).await.1);
    assert_eq!(d.worker, "w2");
    assert!(metric(&svc, "kvmesh_served_adapters_refused_total{reason=\"collision\"} 1"));
    assert!(!svc.state.rebuild_catalog(), "unchanged, and the refusal is counted once");
    assert!(metric(&svc, "kvmesh_served_adapters_refused_total{reason=\"collision\"} 1"));
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, ..Default::default() })]
    /// No request is ever placed on a worker that does not serve its model: any mix of model
    /// names (base, alias, adapter, none, unknown), prompts, overrides and blocks stored anywhere.
    #[test]
    fn no_request_is_placed_on_a_worker_of_another_model(
        steps in proptest::collection::vec(
            (0usize..7, proptest::collection::vec(0u32..64, 4..40), proptest::option::of(0usize..3), 0usize..4),
            1..12,
        ),
    ) {
        static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
        static SVC: OnceLock<Arc<Service>> = OnceLock::new();
        let rt = RT.get_or_init(|| tokio::runtime::Runtime::new().unwrap());
        let svc = SVC.get_or_init(|| rt.block_on(async { multi() }));
        let names = [None, Some("a"), Some("a1"), Some("a2"), Some("b"), Some("bee"), Some("zzz")];
        let pool = |m: Option<&str>| match m {
            None | Some("a" | "a1" | "a2") => Some(&["w0", "w1"][..]),
            Some("b" | "bee") => Some(&["w2"][..]),
            _ => None,
        };
        for (model, prompt, over, holder) in steps {
            let model = names[model];
            let workers = ["w0", "w1", "w2"];
            if holder < 3 {
                store(svc, workers[holder], &prompt, None);
            }
            let over = over.map(|i| workers[i]);
            let (status, body, reason) = rt.block_on(call(svc, body_for(model, &prompt), over));
            match (pool(model), status) {
                (None, s) => proptest::prop_assert_eq!((s, reason.as_str()), (StatusCode::NOT_FOUND, "unknown_model")),
                (Some(p), StatusCode::OK) => {
                    let d = decision(&body);
                    proptest::prop_assert!(p.contains(&d.worker.as_str()), "{:?} on {}", model, d.worker);
                }
                (Some(p), s) => {
                    proptest::prop_assert_eq!(s, StatusCode::BAD_REQUEST);
                    proptest::prop_assert!(over.is_some_and(|o| !p.contains(&o)), "{}", reason);
                }
            }
        }
    }
}

#[tokio::test]
async fn a_models_new_block_size_clears_only_its_workers_and_refuses_old_sized_events() {
    let svc = multi();
    let prompt: Vec<u32> = (3000..3040).collect();
    store(&svc, "w0", &prompt, None);
    store(&svc, "w2", &prompt, None);
    let held = |svc: &Service, id: &str| svc.state.debug_blocks(id).unwrap()[0].blocks.len();
    assert_eq!((held(&svc, "w0"), held(&svc, "w2")), (10, 10));
    let mut config = (*svc.state.config()).clone();
    config.models[1].block_size = 8;
    assert!(svc.reload(config).await.unwrap());
    svc.barrier();
    assert_eq!((held(&svc, "w0"), held(&svc, "w2")), (10, 0), "only model b's worker is cleared");
    assert_eq!(svc.state.snapshot().models[1].block_size, 8);
    // w2's engine still sending 4-token blocks: refused, counted under its model.
    store(&svc, "w2", &prompt, None);
    assert_eq!(held(&svc, "w2"), 0);
    assert!(metric(&svc, "kvmesh_kv_block_size_mismatch_total{model=\"b\",worker=\"w2\"} 1"));
    assert!(metric(&svc, "kvmesh_kv_block_size_mismatch_total{model=\"a\",worker=\"w0\"} 0"));
}
