//! Start-up: load the model files, bind every socket, spawn the engine, print READY, serve.
//!
//! Order matters for the harnesses: the READY line is printed only once the HTTP listener and
//! the ZeroMQ sockets are bound, so whoever parses it can connect immediately.

use std::io::Write as _;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context as _;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

use crate::api::{self, AppState, Info};
use crate::config::Args;
use crate::engine::{self, EngineParts};
use crate::events::{EventSink, NullSink};
use crate::faults::FaultState;
use crate::metrics::Metrics;
use crate::nixl::PullClient;
use crate::output::OutputVocab;
use crate::publisher;
use crate::sched::Scheduler;

/// The line printed on stdout once everything is bound.
pub fn ready_line(id: &str, http: &str, kv_events: Option<&str>, replay: Option<&str>) -> String {
    let mut line = format!("READY id={id} http={http}");
    if let Some(ep) = kv_events {
        line.push_str(&format!(" kv_events={ep}"));
    }
    if let Some(ep) = replay {
        line.push_str(&format!(" replay={ep}"));
    }
    line
}

/// Runs the simulator until `shutdown` resolves. `args` must have passed `validate`.
pub async fn run(
    args: Args,
    shutdown: impl std::future::Future<Output = ()>,
) -> anyhow::Result<()> {
    let started = std::time::Instant::now();
    let tokenizer_path =
        args.tokenizer.clone().unwrap_or_else(kvmesh_tokens::default_tokenizer_path);
    let tokenizer = Arc::new(kvmesh_tokens::Tokenizer::from_file(&tokenizer_path)?);
    let tokenizer_ms = started.elapsed().as_millis() as u64;
    let template = Arc::new(match &args.chat_template {
        Some(p) => kvmesh_tokens::ChatTemplate::from_file(p, &args.bos_token)?,
        None => kvmesh_tokens::ChatTemplate::deepseek()?,
    });
    let vocab = Arc::new(OutputVocab::from_tokenizer(&tokenizer, args.output_vocab_size)?);
    tracing::info!(tokenizer = %tokenizer_path.display(), tokenizer_ms, reply_words = vocab.len(), load_ms = started.elapsed().as_millis() as u64, "model files loaded");

    let listener = TcpListener::bind((args.host, args.port))
        .await
        .with_context(|| format!("binding {}:{}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    let id = args.id.clone().unwrap_or_else(|| format!("sim-{}", addr.port()));
    let mut metrics = Metrics::new(
        args.model_name(),
        args.dp_rank,
        args.block_size,
        args.num_gpu_blocks,
        args.max_model_len(),
    );
    if args.enable_lora {
        metrics = metrics.with_lora(args.max_loras);
    }
    let metrics = Arc::new(metrics);
    let models = args.registry()?;
    let faults = Arc::new(FaultState::new(args.initial_faults()?));

    let (sink, endpoints): (Box<dyn EventSink>, _) = match args.publisher_config() {
        Some(cfg) => {
            let (sink, ep) = publisher::start(&cfg, faults.clone(), metrics.clone())?;
            (Box::new(sink), Some(ep))
        }
        None => (Box::new(NullSink), None),
    };
    let pull_client =
        PullClient::new(Duration::from_millis(args.nixl_pull_timeout_ms), args.block_size)?;
    let mut sched = Scheduler::new(args.scheduler_config(), vocab.clone());
    for e in models.adapters() {
        // vLLM loads `--lora-modules` through `add_lora`, which activates each in turn.
        sched.adapter_loaded(e.adapter.id);
        tracing::info!(name = %e.adapter.name, id = e.adapter.id, path = %e.path, parent = %e.parent, "LoRA adapter loaded");
    }
    let engine = engine::spawn(
        sched,
        EngineParts {
            sink,
            metrics: metrics.clone(),
            pull_client,
            nixl_us_per_block: args.nixl_us_per_block,
            queue: args.engine_queue,
        },
    );

    let kv_events = endpoints.as_ref().map(|e| e.pub_endpoint.clone());
    let replay = endpoints.as_ref().and_then(|e| e.replay_endpoint.clone());
    let info = Info {
        id: id.clone(),
        model: args.model_name().to_owned(),
        served_model_names: args.served_model_name.clone(),
        enable_lora: args.enable_lora,
        max_loras: args.max_loras,
        max_cpu_loras: args.max_cpu_loras(),
        lora_load_ms: args.lora_load_ms,
        role: args.role,
        http: addr.to_string(),
        advertise_host: args.advertise_host(),
        port: addr.port(),
        kv_events: kv_events.clone(),
        replay: replay.clone(),
        kv_events_layout: args.kv_events_layout,
        dp_rank: args.dp_rank,
        block_size: args.block_size,
        num_gpu_blocks: args.num_gpu_blocks,
        max_model_len: args.max_model_len(),
        speedup: args.speedup,
    };
    let (vanish_tx, vanish_rx) = mpsc::unbounded_channel();
    let worker_header =
        AppState::worker_header(&id).context("the worker id must be a valid HTTP header value")?;
    let vocab_size = u32::try_from(tokenizer.vocab_size()).unwrap_or(u32::MAX);
    let state = AppState {
        info,
        engine,
        models: parking_lot::RwLock::new(models),
        tokenizer,
        template,
        vocab,
        vocab_size,
        metrics,
        faults,
        default_max_tokens: args.default_max_tokens,
        vanish: vanish_tx.clone(),
        worker_header,
    };
    let app = api::router(Arc::new(state), args.max_body_bytes);

    let line = ready_line(&id, &addr.to_string(), kv_events.as_deref(), replay.as_deref());
    tracing::info!(
        version = env!("CARGO_PKG_VERSION"),
        id = %id, http = %addr, kv_events = ?kv_events, replay = ?replay, role = ?args.role,
        block_size = args.block_size, num_gpu_blocks = args.num_gpu_blocks, speedup = args.speedup,
        models = ?args.served_model_name, enable_lora = args.enable_lora, max_loras = args.max_loras,
        "vllm-sim ready"
    );
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    if let Some(ms) = args.faults.vanish_ms.filter(|&ms| ms > 0) {
        let _ = vanish_tx.send(Duration::from_millis(ms));
    }
    crate::server::serve(listener, app, vanish_rx, shutdown).await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ready_line_omits_what_is_off() {
        assert_eq!(ready_line("w", "127.0.0.1:1", None, None), "READY id=w http=127.0.0.1:1");
        assert_eq!(
            ready_line("w", "127.0.0.1:1", Some("tcp://127.0.0.1:2"), Some("tcp://127.0.0.1:3")),
            "READY id=w http=127.0.0.1:1 kv_events=tcp://127.0.0.1:2 replay=tcp://127.0.0.1:3"
        );
    }
}
