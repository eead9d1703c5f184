//! Two base models and two LoRA adapters behind one gateway, on real vLLM CPU engines
//! (`make test-vllm`; needs `scripts/setup-vllm.sh`, which also writes the second model and the
//! adapters).
//!
//! w0 serves `deepseek-v4` (block size 32) with the adapters `ds4-sql` and `ds4-chat`; w1 serves
//! `deepseek-v4-mini` (another size of the architecture, block size 64). The indexer reads a fleet
//! file with both models (`[[models]]`, each worker's `model`). Checked against what the engines
//! themselves report:
//! 1. the engines: `/v1/models` lists the adapters with `parent`, and after the adapters' traffic
//!    `vllm:lora_requests_info{max_lora, running_lora_adapters, waiting_lora_adapters}` named each;
//! 2. per model and per adapter, a multi-turn conversation through the gateway: every turn goes to
//!    its model's worker and its predicted overlap × the model's block size == `cached_tokens`
//!    (every continuation turn hits its history);
//! 3. a prompt cached under the base model, re-sent under each adapter, is predicted and served as
//!    a full miss (vLLM keys adapter blocks apart), then hits under that adapter;
//! 4. both event streams decoded without errors or gaps, and `GET /v1/models` through the gateway
//!    lists both models and both adapters.

mod vllm_common;

use kvmesh_core::api::Role;
use kvmesh_core::headers;
use kvmesh_e2e::client::{filler, post_json};
use kvmesh_e2e::stack::{fleet_toml, Stack, StackSpec, Worker, WorkerSpec};
use kvmesh_e2e::vllm::{
    lora_dir, mini_model_dir, start_engines, Engines, VllmOptions, LORA_ADAPTERS, MINI_MODEL_NAME,
    MODEL_NAME,
};
use serde_json::{json, Value};
use vllm_common::{awkward_text, index_view, settle, usage, EventWatch, Rng};

/// `deepseek-v4`'s block size on w0.
const BLOCK_A: u32 = 32;
/// `deepseek-v4-mini`'s block size on w1: another size, so a per-model index is needed.
const BLOCK_B: u32 = 64;

/// One turn's numbers: (model, turn, worker, predicted tokens, cached tokens, prompt tokens).
type Turn = (String, usize, String, u64, u64, u64);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_models_and_two_adapters_on_real_vllm() -> anyhow::Result<()> {
    let (stack, _dir) = start().await?;
    let w0 = EventWatch::start(stack.workers[0].kv_events.as_deref().unwrap_or_default())?;
    let w1 = EventWatch::start(stack.workers[1].kv_events.as_deref().unwrap_or_default())?;
    let watches = [("w0", &w0), ("w1", &w1)];

    engines_list_the_adapters(&stack).await?;

    // 2 and 3. One system prompt for every conversation: under the base model, each adapter and
    // the other model the same text must be kept apart.
    let system = filler(44, 90);
    let mut turns = conversation(&stack, &watches, MODEL_NAME, "w0", BLOCK_A, &system, 1).await?;
    for adapter in LORA_ADAPTERS {
        turns.extend(base_prompt_misses_under(&stack, &watches, adapter, &system).await?);
    }
    for (i, adapter) in LORA_ADAPTERS.iter().enumerate() {
        turns.extend(
            conversation(&stack, &watches, adapter, "w0", BLOCK_A, &system, 2 + i as u64).await?,
        );
    }
    turns.extend(conversation(&stack, &watches, MINI_MODEL_NAME, "w1", BLOCK_B, &system, 9).await?);

    let equal = turns.iter().filter(|t| t.3 == t.4).count();
    eprintln!(
        "multi-model calibration: {equal}/{} turns with predicted overlap x block size == cached_tokens",
        turns.len()
    );
    for (model, turn, worker, predicted, cached, prompt) in &turns {
        eprintln!(
            "  {model} turn {turn} on {worker}: predicted {predicted}, cached {cached}, prompt {prompt}"
        );
    }
    assert_eq!(equal, turns.len(), "predicted != cached on some turn");
    let missed: Vec<_> = turns.iter().filter(|t| t.1 > 0 && t.4 == 0).collect();
    assert!(missed.is_empty(), "continuation turns that missed their own history: {missed:?}");

    adapters_were_reported(&stack).await?;

    // 4. The event streams and the gateway's model list.
    settle(&stack, &watches).await?;
    for (id, watch) in &watches {
        let v = index_view(&stack, id).await?;
        eprintln!("events {id}: engine published {} batches; indexer {v:?}", watch.batches());
        assert_eq!((v.decode_errors, v.gaps), (0, 0), "{id}: {v:?}");
        assert!(v.blocks_held > 0, "{id}: {v:?}");
    }
    let listed: Value =
        stack.client().get(stack.gateway("/v1/models")).send().await?.json().await?;
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .map(|d| d.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    eprintln!("GET /v1/models through the gateway: {ids:?}");
    for want in [MODEL_NAME, MINI_MODEL_NAME].iter().chain(LORA_ADAPTERS.iter()) {
        assert!(ids.contains(want), "{want} not in {listed}");
    }
    Ok(())
}

/// Starts w0 (`deepseek-v4` + the adapters) and w1 (`deepseek-v4-mini`), one per core, then the
/// gateway over them with the multi-model fleet file. The returned directory holds the logs.
async fn start() -> anyhow::Result<(Stack, tempfile::TempDir)> {
    let dir = tempfile::Builder::new().prefix("kvmesh-e2e-multi-model-").tempdir()?;
    let started = std::time::Instant::now();
    let a = VllmOptions {
        lora_modules: LORA_ADAPTERS.iter().map(|n| ((*n).to_owned(), lora_dir(n))).collect(),
        max_loras: Some(2),
        ..VllmOptions::default()
    };
    let b = VllmOptions {
        model: Some(mini_model_dir()),
        served_model_name: Some(MINI_MODEL_NAME.to_owned()),
        ..VllmOptions::default()
    };
    let (s0, s1) = (WorkerSpec::new("w0", Role::Both), WorkerSpec::new("w1", Role::Both));
    let mut engines = start_engines(&[(&s0, &a, BLOCK_A), (&s1, &b, BLOCK_B)], dir.path()).await?;

    // The engines already run: the stack adopts them as external workers (it starts none), and
    // takes their processes so they die with it.
    let mut spec = StackSpec::aggregate(0);
    spec.workers = engines.iter().map(Worker::external_spec).collect();
    spec.engines = Engines::External;
    spec.block_size = BLOCK_A;
    spec.filter_config = json!({"debug_headers": true});
    spec.work_dir = Some(dir.path().to_path_buf());
    let mut stack = Stack::start(spec).await?;
    for (w, e) in stack.workers.iter_mut().zip(&mut engines) {
        w.proc = e.proc.take();
    }
    // The harness writes a one-model fleet file: replace it with the two models and restart the
    // indexer on it (Envoy's cluster already lists both workers).
    let fleet = multi_model_fleet(&stack)?;
    eprintln!("engines up in {:.0} s; the fleet file:\n{fleet}", started.elapsed().as_secs_f64());
    std::fs::write(&stack.fleet_path, &fleet)?;
    stack.restart_indexer().await?;
    eprintln!(
        "real-vLLM multi-model stack up in {:.0} s (logs in {})",
        started.elapsed().as_secs_f64(),
        dir.path().display()
    );
    Ok((stack, dir))
}

/// The harness's fleet file with `[model]` replaced by `[[models]]` (deepseek-v4 with its adapters,
/// deepseek-v4-mini) and each worker's `model`.
fn multi_model_fleet(stack: &Stack) -> anyhow::Result<String> {
    let workers: Vec<&Worker> = stack.workers.iter().collect();
    let one =
        fleet_toml(&stack.spec, &workers, stack.gateway_port, stack.admin_port, stack.indexer_port);
    let mut fleet: toml::Table = one.parse()?;
    fleet.remove("model");
    let models = toml::Value::try_from(json!([
        {"name": MODEL_NAME, "block_size": BLOCK_A, "adapters": LORA_ADAPTERS},
        {"name": MINI_MODEL_NAME, "block_size": BLOCK_B},
    ]))?;
    fleet.insert("models".into(), models);
    let list = fleet
        .get_mut("workers")
        .and_then(toml::Value::as_array_mut)
        .ok_or_else(|| anyhow::anyhow!("no [[workers]] in {one}"))?;
    for w in list.iter_mut().filter_map(toml::Value::as_table_mut) {
        let model = if w.get("id").and_then(toml::Value::as_str) == Some("w1") {
            MINI_MODEL_NAME
        } else {
            MODEL_NAME
        };
        w.insert("model".into(), model.into());
    }
    Ok(toml::to_string(&fleet)?)
}

/// 1. The engine lists its adapters, their `parent` its base model (the facts vllm-sim mirrors).
async fn engines_list_the_adapters(stack: &Stack) -> anyhow::Result<()> {
    let w0 = stack.worker("w0")?;
    let models: Value = stack.client().get(w0.url("/v1/models")).send().await?.json().await?;
    let data = models["data"].as_array().cloned().unwrap_or_default();
    let parent_of = |id: &str| {
        data.iter().find(|m| m["id"] == id).map(|m| m["parent"].as_str().map(str::to_owned))
    };
    assert_eq!(parent_of(MODEL_NAME), Some(None), "{models}");
    for a in LORA_ADAPTERS {
        assert_eq!(parent_of(a), Some(Some(MODEL_NAME.to_owned())), "{models}");
    }
    let listed: Vec<(&str, &str)> = data
        .iter()
        .map(|m| (m["id"].as_str().unwrap_or("?"), m["parent"].as_str().unwrap_or("-")))
        .collect();
    eprintln!("w0 /v1/models (id, parent): {listed:?}");
    Ok(())
}

/// 1. After the adapters' requests, `vllm:lora_requests_info` (set at each scheduler step, so
///    absent before the first) has had a series naming each adapter, with `max_lora` = the slots.
async fn adapters_were_reported(stack: &Stack) -> anyhow::Result<()> {
    let w0 = stack.worker("w0")?;
    let text = stack.client().get(w0.url("/metrics")).send().await?.text().await?;
    let info: Vec<&str> =
        text.lines().filter(|l| l.starts_with("vllm:lora_requests_info{")).collect();
    eprintln!("w0 vllm:lora_requests_info series: {info:#?}");
    for a in LORA_ADAPTERS {
        assert!(
            info.iter().any(|l| l.contains("max_lora=\"2\"")
                && l.contains("running_lora_adapters=\"")
                && l.contains(a)),
            "{a}: {info:?}"
        );
    }
    Ok(())
}

/// A four-turn conversation under `model` through the gateway; every turn on `worker`, each
/// turn's numbers returned.
async fn conversation(
    stack: &Stack,
    watches: &[(&str, &EventWatch)],
    model: &str,
    worker: &str,
    block: u32,
    system: &str,
    seed: u64,
) -> anyhow::Result<Vec<Turn>> {
    let mut rng = Rng::new(seed);
    let session = format!("multi-model-{model}");
    let mut msgs = vec![json!({"role": "system", "content": system})];
    let mut turns = Vec::new();
    for turn in 0..4 {
        msgs.push(json!({"role": "user", "content": format!("{model} turn {turn}: {}", awkward_text(&mut rng, 10, 20))}));
        let body = json!({"model": model, "messages": msgs, "max_tokens": 4 + rng.below(8)});
        let (t, reply) = send(stack, watches, &body, &session, worker, block).await?;
        turns.push((model.to_owned(), turn, t.0, t.1, t.2, t.3));
        msgs.push(json!({"role": "assistant", "content": reply}));
    }
    Ok(turns)
}

/// 3. A prompt the base model has cached (its system prompt and first turn), sent under an
///    adapter: predicted and served as a miss; sent again: a hit of the same size both ways.
async fn base_prompt_misses_under(
    stack: &Stack,
    watches: &[(&str, &EventWatch)],
    adapter: &str,
    system: &str,
) -> anyhow::Result<Vec<Turn>> {
    let msgs = json!([
        {"role": "system", "content": system},
        {"role": "user", "content": format!("the same words under {MODEL_NAME} and {adapter}")},
    ]);
    let session = format!("base-then-{adapter}");
    let base = json!({"model": MODEL_NAME, "messages": msgs, "max_tokens": 2});
    send(stack, watches, &base, &session, "w0", BLOCK_A).await?;
    let again = send(stack, watches, &base, &session, "w0", BLOCK_A).await?.0;
    assert!(again.2 > 0, "the base model's prompt did not hit under the base model: {again:?}");
    let under = json!({"model": adapter, "messages": msgs, "max_tokens": 2});
    let miss = send(stack, watches, &under, &session, "w0", BLOCK_A).await?.0;
    eprintln!(
        "{MODEL_NAME}'s prompt: cached {} under {MODEL_NAME}; under {adapter}: predicted {}, cached {}",
        again.2, miss.1, miss.2
    );
    assert_eq!((miss.1, miss.2), (0, 0), "a base-model prompt under {adapter} is a full miss");
    let hit = send(stack, watches, &under, &session, "w0", BLOCK_A).await?.0;
    assert_eq!(hit.2, again.2, "under {adapter} the prompt hits as it did under the base model");
    let label = |m: &str| format!("{m} (the base prompt)");
    Ok([(label(MODEL_NAME), 1, again), (label(adapter), 0, miss), (label(adapter), 1, hit)]
        .into_iter()
        .map(|(m, t, (w, p, c, n))| (m, t, w, p, c, n))
        .collect())
}

/// Sends one chat request through the gateway once the index has caught up with the engines;
/// returns (worker, predicted tokens, cached tokens, prompt tokens) and the reply's text. The
/// request must land on `worker`, the only one serving its model.
async fn send(
    stack: &Stack,
    watches: &[(&str, &EventWatch)],
    body: &Value,
    session: &str,
    worker: &str,
    block: u32,
) -> anyhow::Result<((String, u64, u64, u64), String)> {
    settle(stack, watches).await?;
    let r = post_json(
        stack.client(),
        &stack.gateway("/v1/chat/completions"),
        body,
        &[(headers::DEFAULT_SESSION_HEADER, session)],
    )
    .await?;
    anyhow::ensure!(r.status == 200, "{} {} for {body}", r.status, r.text);
    let decided = r.header(headers::DEBUG_WORKER).unwrap_or("?").to_owned();
    assert_eq!(decided, worker, "{} went to {decided}", body["model"]);
    let (prompt, cached) = usage(&r.json()).unwrap_or_default();
    let predicted = r.overlap_blocks().unwrap_or(u64::MAX).saturating_mul(u64::from(block));
    Ok(((decided, predicted, cached, prompt), r.chat_content().unwrap_or_default()))
}
