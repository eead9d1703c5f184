//! Models and LoRA adapters over HTTP and ZMQ, as vLLM serves them: `/v1/models` lists the
//! served names and the adapters (`parent` = base), a request names a base name, an adapter or
//! nothing (the base) and anything else is vLLM's 404; adapters load and unload at run time; an
//! adapter's blocks are keyed by its name (a prompt cached under the base model is a full miss
//! under an adapter, and `BlockStored` carries `lora_id`/`lora_name`); `--max-loras` bounds the
//! distinct adapters running, a swap costs `--lora-load-ms`, and `vllm:lora_requests_info` shows
//! who runs and who waits.

// Test code: a failed unwrap is a failed test (clippy.toml allows this in #[test] fns only).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod common;

use std::time::{Duration, Instant};

use common::{client, poll, Ev, Sim, Subscriber};
use kvmesh_sim::hash::{chain, chain_for};
use serde_json::{json, Value};

const BS: usize = 4;

fn complete(sim: &Sim, model: Option<&str>, prompt: &[u32], max_tokens: u32) -> (u16, Value) {
    let mut body = json!({"prompt": prompt, "max_tokens": max_tokens});
    if let Some(m) = model {
        body["model"] = json!(m);
    }
    sim.post("/v1/completions", &body)
}

fn cached(body: &Value) -> u64 {
    body["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens")
}

/// POSTs and returns (status, raw text): the load/unload answers are plain text.
fn post_text(sim: &Sim, path: &str, body: &Value) -> (u16, String) {
    let resp = client().post(sim.url(path)).json(body).send().expect("POST");
    (resp.status().as_u16(), resp.text().expect("body"))
}

/// The `vllm:lora_requests_info` series: (running, waiting, max_lora, value).
fn lora_info(sim: &Sim) -> Vec<(String, String, String, f64)> {
    let text = client().get(sim.url("/metrics")).send().unwrap().text().unwrap();
    kvmesh_core::prom::parse(&text)
        .unwrap()
        .into_iter()
        .filter(|s| s.name == "vllm:lora_requests_info")
        .map(|s| {
            let l = |k| s.label(k).unwrap_or_else(|| panic!("label {k}")).to_owned();
            (l("running_lora_adapters"), l("waiting_lora_adapters"), l("max_lora"), s.value)
        })
        .collect()
}

/// The newest series (vLLM's value is the time it was last set): what runs and waits now.
fn lora_now(sim: &Sim) -> (String, String) {
    let series = lora_info(sim);
    let newest = series.iter().max_by(|a, b| a.3.total_cmp(&b.3)).expect("a lora series");
    (newest.0.clone(), newest.1.clone())
}

#[test]
fn served_names_adapters_and_unknown_models_as_vllm() {
    let sim = Sim::spawn(&[
        "--served-model-name",
        "base",
        "alias",
        "--enable-lora",
        "--lora-modules",
        "a1=/adapters/a1",
        r#"{"name":"a2","path":"/adapters/a2","base_model_name":"alias"}"#,
        "--speedup",
        "100",
    ]);
    let models = sim.get("/v1/models");
    let rows: Vec<(String, String, Value)> = models["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| {
            (
                m["id"].as_str().unwrap().into(),
                m["root"].as_str().unwrap().into(),
                m["parent"].clone(),
            )
        })
        .collect();
    assert_eq!(
        rows,
        [
            ("base".into(), "base".into(), Value::Null),
            ("alias".into(), "base".into(), Value::Null),
            ("a1".into(), "/adapters/a1".into(), json!("base")),
            ("a2".into(), "/adapters/a2".into(), json!("alias")),
        ]
    );

    // Base name, alias, no model: the base model, answered under the first name; an adapter is
    // answered under its own name.
    for (model, answered) in
        [(Some("base"), "base"), (Some("alias"), "base"), (None, "base"), (Some("a1"), "a1")]
    {
        let (status, body) = complete(&sim, model, &[1, 2, 3], 2);
        assert_eq!(status, 200, "{model:?}: {body}");
        assert_eq!(body["model"], answered, "{model:?}");
    }
    let (status, body) = complete(&sim, Some("gpt-4"), &[1, 2, 3], 2);
    assert_eq!(
        (status, body),
        (
            404,
            json!({"error": {
                "message": "The model `gpt-4` does not exist.", "type": "NotFoundError", "param": "model", "code": 404,
            }})
        )
    );

    // Run-time load and unload, with vLLM's answers.
    let load = |name: &str, path: &str| {
        post_text(&sim, "/v1/load_lora_adapter", &json!({"lora_name": name, "lora_path": path}))
    };
    assert_eq!(
        load("a3", "/adapters/a3"),
        (200, "Success: LoRA adapter 'a3' added successfully.".into())
    );
    let (status, text) = load("a3", "/adapters/a3");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!((status, err["error"]["type"].as_str()), (400, Some("InvalidUserInput")));
    assert!(err["error"]["message"].as_str().unwrap().contains("has already been loaded"));
    assert_eq!(load("a4", "").0, 400);
    let models = sim.get("/v1/models");
    let a3 = &models["data"][4];
    assert_eq!((a3["id"].as_str(), a3["parent"].as_str()), (Some("a3"), Some("base")));
    let (status, body) = complete(&sim, Some("a3"), &[1, 2, 3], 1);
    assert_eq!((status, body["model"].as_str()), (200, Some("a3")));

    let unload =
        |name: &str| post_text(&sim, "/v1/unload_lora_adapter", &json!({"lora_name": name}));
    assert_eq!(unload("a3"), (200, "Success: LoRA adapter 'a3' removed successfully.".into()));
    let (status, text) = unload("a3");
    let err: Value = serde_json::from_str(&text).unwrap();
    assert_eq!(status, 404);
    assert_eq!(err["error"]["message"], "The lora adapter 'a3' cannot be found.");
    assert_eq!(err["error"]["type"], "NotFoundError");
    assert_eq!(complete(&sim, Some("a3"), &[1, 2, 3], 1).0, 404);
    assert_eq!(sim.get("/v1/models")["data"].as_array().unwrap().len(), 4);
    // A reload takes a new lora_id (the counter never goes back).
    assert_eq!(load("a3", "/adapters/a3").0, 200);

    // Without --enable-lora: no load route, adapters are unknown models, no lora metric.
    let plain = Sim::spawn(&["--speedup", "100"]);
    assert_eq!(
        post_text(&plain, "/v1/load_lora_adapter", &json!({"lora_name": "a", "lora_path": "/p"})).0,
        404
    );
    assert_eq!(complete(&plain, Some("a1"), &[1, 2, 3], 1).0, 404);
    assert_eq!(complete(&plain, Some("deepseek-v4"), &[1, 2, 3], 1).0, 200);
    assert!(lora_info(&plain).is_empty());
}

#[test]
fn adapter_blocks_are_keyed_by_the_adapter_in_the_cache_and_the_events() {
    let topic = "kv@lora";
    let sim = Sim::spawn(&[
        "--block-size",
        "4",
        "--speedup",
        "1000",
        "--kv-events-endpoint",
        "tcp://127.0.0.1:*",
        "--kv-events-topic",
        topic,
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        "a1=/p/a1",
        "a2=/p/a2",
    ]);
    let mut sub = Subscriber::connect(sim.kv_events.as_deref().unwrap(), None, topic, true);
    poll("the first KV event batch", || {
        assert_eq!(sim.post("/reset_prefix_cache", &json!({})).0, 200);
        sub.pump().then_some(())
    });
    let prompt: Vec<u32> = (3000..3010).collect();
    let hit = |model: Option<&str>| {
        let (status, body) = complete(&sim, model, &prompt, 1);
        assert_eq!(status, 200, "{body}");
        cached(&body)
    };

    // Cached under the base model: a full miss under each adapter, then each hits its own.
    assert_eq!(hit(None), 0);
    assert_eq!(hit(None), 8);
    assert_eq!(hit(Some("a1")), 0, "the base model's blocks never serve an adapter");
    assert_eq!(hit(Some("a1")), 8);
    assert_eq!(hit(Some("a2")), 0, "nor another adapter's");
    assert_eq!(hit(Some("a2")), 8);
    assert_eq!(hit(Some("deepseek-v4")), 8, "the base model still hits its own");

    let want = sim.cache();
    sub.until("the event stream to match /admin/cache", |s| s.model == want);
    let stored: Vec<Ev> = sub
        .applied
        .iter()
        .flat_map(|(_, evs, _)| evs.clone())
        .filter(|e| matches!(e, Ev::Stored { .. }))
        .collect();
    let ev = |lora: Option<(u64, &str)>| Ev::Stored {
        hashes: chain_for(&prompt, BS, lora.map(|l| l.1), None)[..2].to_vec(),
        parent: None,
        tokens: prompt[..8].to_vec(),
        block_size: BS,
        lora: lora.map(|(id, n)| (id, n.to_owned())),
    };
    assert_eq!(stored, [ev(None), ev(Some((1, "a1"))), ev(Some((2, "a2")))]);
    assert_eq!(chain(&prompt, BS, None), chain_for(&prompt, BS, None, None));

    // The dump names each block's adapter; six blocks, two per key.
    let dump = sim.get("/admin/cache");
    let mut names: Vec<Value> =
        dump["blocks"].as_array().unwrap().iter().map(|b| b["lora_name"].clone()).collect();
    names.sort_by_key(|v| v.to_string());
    assert_eq!(
        names,
        [json!("a1"), json!("a1"), json!("a2"), json!("a2"), Value::Null, Value::Null]
    );
}

#[test]
fn max_loras_makes_other_adapters_wait_and_a_swap_costs_the_load_time() {
    let sim = Sim::spawn(&[
        "--enable-lora",
        "--max-loras",
        "1",
        "--lora-load-ms",
        "300",
        "--lora-modules",
        "a1=/p/a1",
        "a2=/p/a2",
        "--itl-ms",
        "10",
    ]);
    let loads = || sim.metric("kvmesh_sim_lora_loads_total");
    let prompt: Vec<u32> = (100..110).collect();

    // a2 was loaded last at start: it holds the only slot, so it runs without a load.
    let (status, _) = complete(&sim, Some("a2"), &prompt, 1);
    assert_eq!((status, loads()), (200, 0.0));
    // a1 must be swapped in: the request pays the load time.
    let t = Instant::now();
    assert_eq!(complete(&sim, Some("a1"), &prompt, 1).0, 200);
    assert!(t.elapsed() >= Duration::from_millis(300), "{:?}", t.elapsed());
    assert_eq!(loads(), 1.0);

    // A long a1 request (200 tokens × 10 ms) runs; an a2 request must wait for the slot, a base
    // request must not.
    std::thread::scope(|s| {
        let long = s.spawn(|| {
            let r = complete(&sim, Some("a1"), &prompt, 200);
            (r.0, Instant::now())
        });
        poll("the a1 request to run", || (lora_now(&sim).0 == "a1").then_some(()));
        let waiting = s.spawn(|| {
            let r = complete(&sim, Some("a2"), &prompt, 1);
            (r.0, Instant::now())
        });
        poll("the a2 request to wait", || {
            (lora_now(&sim) == ("a1".into(), "a2".into())
                && sim.metric("vllm:num_requests_waiting") == 1.0)
                .then_some(())
        });
        let (status, _) = complete(&sim, None, &prompt, 1);
        let base_done = Instant::now();
        assert_eq!(status, 200);
        assert_eq!(lora_now(&sim).1, "a2", "the base request went ahead of the waiting a2");
        let (s1, long_done) = long.join().unwrap();
        let (s2, waited_done) = waiting.join().unwrap();
        assert_eq!((s1, s2), (200, 200));
        assert!(base_done < long_done && long_done < waited_done);
    });
    assert_eq!(loads(), 2.0, "a2 swapped back in once");
    let series = lora_info(&sim);
    assert!(series.iter().all(|s| s.2 == "1"), "max_lora");
    assert_eq!(lora_now(&sim), (String::new(), String::new()), "idle at the end");
}
