//! A whole kvmesh stack on loopback: vllm-sim workers, the indexer, and Envoy with the filter.
//!
//! One [`StackSpec`] describes the fleet; [`Stack::start`] starts the workers first (each binds port 0
//! and reports its addresses), then writes the fleet file the indexer reads and renders the Envoy
//! bootstrap from the same worker list, so the two can never disagree. A spec with several models
//! (or LoRA adapters) starts each simulator for its worker's model and writes `[[models]]`.
//! Policies other than [`EnvoyPolicy::Kvmesh`] run Envoy alone with one of its own load
//! balancers — the baselines the benchmark compares against. Under the kvmesh policy the
//! spec's [`Edge`] says which front door picks: the wasm filter, or the indexer's endpoint picker
//! over Envoy's ext_proc (the fleet file gets `[epp] listen = "127.0.0.1:0"`, the indexer's READY
//! line says which port it bound — [`Stack::epp_addr`] — and the bootstrap's `kvmesh_epp` cluster
//! points there; a restarted indexer binds the same port again), or both.
//!
//! Over 600 lines: the lifecycle of every process of a stack (start, restart, kill, replicas,
//! readiness waits) in one type; the spec and fleet rendering are in `stack/`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use anyhow::{bail, Context};

use crate::envoy_config::{render_bootstrap_edge, BootstrapVars, BootstrapWorker, EppTarget};
use crate::procs::{binary, free_port, Proc};
use crate::prom::Metrics;
pub use crate::worker::{Worker, WorkerSpec};

mod fleet_file;
mod spec;
pub use spec::{Edge, EnvoyPolicy, ModelSpec, Ports, StackSpec};

/// A running stack. Dropping it kills every process.
pub struct Stack {
    pub spec: StackSpec,
    pub workers: Vec<Worker>,
    pub indexer: Option<Proc>,
    pub envoy: Option<Proc>,
    pub gateway_port: u16,
    pub admin_port: u16,
    pub indexer_port: u16,
    /// The endpoint picker's ext_proc address, `ip:port` (the indexer's READY `epp=`), when the
    /// spec's edge calls it; what Envoy's `kvmesh_epp` cluster names.
    pub epp_addr: Option<String>,
    pub fleet_path: PathBuf,
    /// The workers the fleet file lists since the last `rewrite_fleet` (`None`: all of them): a
    /// (re)started indexer waits for these, not for a worker that left.
    listed: Option<std::collections::BTreeSet<String>>,
    dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
    http: reqwest::Client,
}

impl Stack {
    pub async fn start(spec: StackSpec) -> anyhow::Result<Self> {
        spec.check_filter_config()?;
        spec.check_models()?;
        spec.check_edge()?;
        let (dir, tmp) = match &spec.work_dir {
            Some(d) => {
                std::fs::create_dir_all(d)?;
                (d.clone(), None)
            }
            None => {
                let t = tempfile::Builder::new().prefix("kvmesh-e2e-").tempdir()?;
                (t.path().to_path_buf(), Some(t))
            }
        };
        let workers = match &spec.engines {
            crate::vllm::Engines::Sim => start_sims(&spec, &dir)?,
            crate::vllm::Engines::Vllm(opts) => {
                // Real engines serve the one dummy model `vllm::start_workers` sets up; a fleet of
                // several models there needs a model directory per base model.
                if !spec.models.is_empty() {
                    bail!("several models (StackSpec::models) run on simulators or external engines, not on engines this harness starts");
                }
                crate::vllm::start_workers(&spec.workers, opts, spec.block_size, &dir).await?
            }
            crate::vllm::Engines::External => crate::vllm::external_workers(&spec.workers)?,
        };
        let gateway_port = spec.ports.gateway.map_or_else(free_port, Ok)?;
        let admin_port = spec.ports.admin.map_or_else(free_port, Ok)?;
        let indexer_port = spec.ports.indexer.map_or_else(free_port, Ok)?;
        let fleet_path = dir.join("fleet.toml");
        let fleet = fleet_toml(
            &spec,
            &workers.iter().collect::<Vec<_>>(),
            gateway_port,
            admin_port,
            indexer_port,
        );
        std::fs::write(&fleet_path, fleet)?;
        let http = reqwest::Client::builder().timeout(Duration::from_secs(30)).build()?;
        let mut stack = Self {
            spec,
            workers,
            indexer: None,
            envoy: None,
            gateway_port,
            admin_port,
            indexer_port,
            epp_addr: None,
            fleet_path,
            listed: None,
            dir,
            _tmp: tmp,
            http,
        };
        if stack.spec.policy == EnvoyPolicy::Kvmesh {
            stack.start_indexer().await?;
        }
        stack.start_envoy().await?;
        stack.wait_picker_healthy().await?;
        Ok(stack)
    }

    /// On an edge with the picker: waits until Envoy's gRPC health check of `kvmesh_epp` marks it
    /// up (it is checked every second; until then Envoy does not call it — requests fail open, or
    /// fail with `failure_mode_allow: false`).
    pub fn wait_picker_healthy(
        &self,
    ) -> impl std::future::Future<Output = anyhow::Result<()>> + Send + 'static {
        // Owned values only: the future must not hold the stack (not Sync) across its awaits.
        let wanted = self.spec.edge.uses_epp() && self.envoy.is_some();
        let url = self.admin("/stats?filter=^cluster\\.kvmesh_epp\\.membership_healthy$");
        let client = self.http.clone();
        async move {
            if !wanted {
                return Ok(());
            }
            crate::poll::until("Envoy's health check marking the picker up", || {
                let (c, u) = (client.clone(), url.clone());
                async move {
                    let text = c.get(&u).send().await.ok()?.text().await.ok()?;
                    text.trim().ends_with(": 1").then_some(())
                }
            })
            .await
        }
    }

    /// Starts (or restarts) the indexer on its port and waits until it answers.
    pub async fn start_indexer(&mut self) -> anyhow::Result<()> {
        if let Some(mut old) = self.indexer.take() {
            old.kill();
        }
        let picks = self.spec.edge.uses_epp();
        if let Some(port) = self.spec.ports.epp.filter(|_| picks) {
            // Envoy's `kvmesh_epp` cluster names this port: a restart must bind it again.
            pin_epp_port(&self.fleet_path, port)?;
        }
        let mut cmd = Command::new(binary("kvmesh-indexer", self.spec.release)?);
        cmd.arg("--config")
            .arg(&self.fleet_path)
            .args(["--listen", &format!("127.0.0.1:{}", self.indexer_port)]);
        let mut proc = Proc::spawn("indexer", cmd, &self.dir)?;
        proc.wait_ready()?;
        if picks {
            let addr = proc
                .ready_field("epp")
                .with_context(|| {
                    format!("the indexer's READY line has no epp=: {}", proc.ready_line())
                })?
                .to_owned();
            self.spec.ports.epp = Some(split_host_port(&addr)?.1);
            self.epp_addr = Some(addr);
        }
        self.indexer = Some(proc);
        // Listening is not serving: wait until the indexer has seen every listed decode worker
        // healthy, or the first requests get "no healthy decode-capable worker".
        let fleet_url = self.indexer_url(kvmesh_core::api::FLEET_PATH);
        let listed = |w: &&Worker| self.listed.as_ref().is_none_or(|l| l.contains(&w.id));
        let decoders = self.workers.iter().filter(listed).filter(|w| w.role.decodes()).count();
        let client = self.http.clone();
        crate::poll::until("indexer sees every decode worker healthy", || {
            let client = client.clone();
            let url = fleet_url.clone();
            async move {
                let fleet: kvmesh_core::api::FleetSnapshot =
                    client.get(&url).send().await.ok()?.json().await.ok()?;
                (fleet.decode_candidates().count() >= decoders).then_some(())
            }
        })
        .await?;
        Ok(())
    }

    /// Rewrites the fleet file with the workers `keep` accepts and `routing_toml` as the `[routing]`
    /// table (the running indexer reloads it); returns once the indexer's fleet lists exactly them.
    pub async fn rewrite_fleet(
        &mut self,
        keep: impl Fn(&Worker) -> bool,
        routing_toml: &str,
    ) -> anyhow::Result<()> {
        self.spec.routing_toml = routing_toml.to_owned();
        // `&Worker` is not Send: the list must not live across an await.
        let (want, text) = {
            let listed: Vec<&Worker> = self.workers.iter().filter(|w| keep(w)).collect();
            let want: std::collections::BTreeSet<String> =
                listed.iter().map(|w| w.id.clone()).collect();
            (
                want,
                fleet_toml(
                    &self.spec,
                    &listed,
                    self.gateway_port,
                    self.admin_port,
                    self.indexer_port,
                ),
            )
        };
        let metrics_url = self.indexer_url("/metrics");
        let reloads = |m: &Metrics| m.sum("kvmesh_config_reloads_total", &[("result", "ok")]);
        let before = reloads(&self.scrape(&metrics_url).await?);
        std::fs::write(&self.fleet_path, text)?;
        self.listed = Some(want.clone());
        let url = self.indexer_url(kvmesh_core::api::FLEET_PATH);
        let client = self.http.clone();
        crate::poll::until("indexer reloaded the fleet file", || {
            let (client, url, metrics_url, want) =
                (client.clone(), url.clone(), metrics_url.clone(), want.clone());
            async move {
                let text = client.get(&metrics_url).send().await.ok()?.text().await.ok()?;
                if reloads(&Metrics::parse(&text).ok()?) <= before {
                    return None;
                }
                let fleet: kvmesh_core::api::FleetSnapshot =
                    client.get(&url).send().await.ok()?.json().await.ok()?;
                let have: std::collections::BTreeSet<String> =
                    fleet.workers.into_iter().map(|w| w.id).collect();
                (have == want).then_some(())
            }
        })
        .await
    }

    /// Restarts the indexer (a crash and a start) and waits until `/readyz` says every worker's
    /// start-up replay is done, so its index is rebuilt.
    pub async fn restart_indexer(&mut self) -> anyhow::Result<()> {
        self.kill_indexer();
        self.start_indexer().await?;
        let ready = self.indexer_url("/readyz");
        let client = self.http.clone();
        crate::poll::until("the restarted indexer replayed every worker", || {
            let (c, u) = (client.clone(), ready.clone());
            async move { c.get(&u).send().await.ok().filter(|r| r.status().is_success()).map(|_| ()) }
        })
        .await?;
        self.wait_picker_healthy().await
    }

    /// Kills the indexer (SIGKILL: a crash, not a shutdown).
    pub fn kill_indexer(&mut self) {
        if let Some(mut p) = self.indexer.take() {
            p.kill();
        }
    }

    /// Stops Envoy (SIGKILL) and starts it again from the current spec — e.g. after changing
    /// `spec.edge` (another `failure_mode_allow`) — on the same ports; waits until it is ready.
    pub async fn restart_envoy(&mut self) -> anyhow::Result<()> {
        self.spec.check_edge()?;
        if let Some(mut old) = self.envoy.take() {
            old.kill();
        }
        self.start_envoy().await?;
        self.wait_picker_healthy().await
    }

    async fn start_envoy(&mut self) -> anyhow::Result<()> {
        let envoy = envoy_binary()?;
        let edge = self.spec.edge;
        let epp = match &self.epp_addr {
            Some(addr) if edge.uses_epp() => {
                let (host, port) = split_host_port(addr)?;
                Some(EppTarget {
                    host,
                    port,
                    message_timeout_ms: self.spec.epp_message_timeout_ms,
                    // The conformance harness steers with headers; GIE's subset hint is one more.
                    subset_from_header: self.spec.epp_conformance,
                })
            }
            _ => None,
        };
        let vars = BootstrapVars {
            listen_host: "127.0.0.1".into(),
            listen_port: self.gateway_port,
            admin_port: self.admin_port,
            indexer_host: "127.0.0.1".into(),
            indexer_port: self.indexer_port,
            // Pure ext_proc loads no wasm: the module need not exist.
            wasm_path: if edge.uses_wasm() {
                wasm_path()?.display().to_string()
            } else {
                String::new()
            },
            filter_config_json: self.filter_config().to_string(),
            workers: self
                .workers
                .iter()
                .filter(|w| w.role.decodes() || self.spec.policy != EnvoyPolicy::Kvmesh)
                .map(|w| {
                    let (host, port) = split_host_port(&w.http)?;
                    // Several models: the names each worker serves, so the baselines route by model.
                    let models = match self.spec.model(w.model.as_deref()) {
                        Some(m) if self.spec.has_model_catalog() => std::iter::once(&m.name)
                            .chain(&m.aliases)
                            .chain(&m.adapters)
                            .cloned()
                            .collect(),
                        _ => Vec::new(),
                    };
                    Ok(BootstrapWorker { id: w.id.clone(), host, port, models })
                })
                .collect::<anyhow::Result<_>>()?,
            max_body_bytes: self.spec.max_body_bytes,
            policy: self.spec.policy.as_str().into(),
            session_header: self.spec.session_header.clone(),
            upstream_timeout_s: 300,
            indexer_max_connections: self.spec.indexer_max_connections,
            wasm_failure_policy: self.spec.wasm_failure_policy.clone(),
        };
        let yaml = render_bootstrap_edge(&vars, &self.spec.envoy_limits, edge, epp.as_ref())?;
        let path = self.dir.join("envoy.yaml");
        std::fs::write(&path, yaml)?;
        let mut cmd = Command::new(envoy);
        cmd.arg("-c").arg(&path).args([
            "--disable-hot-restart",
            "--concurrency",
            &self.spec.envoy_concurrency.to_string(),
            "-l",
            "info",
        ]);
        // A drain (see `drain_envoy`) asks every connection to close at once and stops accepting
        // after ENVOY_DRAIN_TIME_S.
        cmd.args([
            "--drain-strategy",
            "immediate",
            "--drain-time-s",
            &ENVOY_DRAIN_TIME_S.to_string(),
        ]);
        cmd.arg("--log-path").arg(self.dir.join("envoy-access.log"));
        self.envoy = Some(Proc::spawn("envoy", cmd, &self.dir)?);
        let ready = format!("http://127.0.0.1:{}/ready", self.admin_port);
        let client = self.http.clone();
        let envoy = self.envoy.as_mut().context("envoy")?;
        let name = envoy.name().to_owned();
        let deadline = std::time::Instant::now() + crate::poll::patience();
        loop {
            if let Ok(r) = client.get(&ready).send().await {
                if r.status().is_success() {
                    break;
                }
            }
            if !envoy.is_running() {
                bail!("{name} exited before it was ready:\n{}", envoy.log_tail(60));
            }
            if std::time::Instant::now() > deadline {
                bail!("{name} not ready in time:\n{}", envoy.log_tail(60));
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(())
    }

    /// Stops Envoy the way a rollout should, and the way `kvmesh-stack` does on SIGTERM: a
    /// graceful listener drain (connections are asked to close, listeners stop accepting after
    /// [`ENVOY_DRAIN_TIME_S`]), then waiting until no downstream request is active — in-flight
    /// streams finish — for at most `bound`, then SIGTERM. Returns the requests still active
    /// when it gave up waiting (0 = a clean drain).
    pub async fn drain_envoy(&mut self, bound: Duration) -> anyhow::Result<u64> {
        let Some(mut envoy) = self.envoy.take() else { return Ok(0) };
        self.http.post(self.admin("/drain_listeners?graceful")).send().await?.error_for_status()?;
        let active_url = self.admin("/stats?filter=^http\\.kvmesh\\.downstream_rq_active$");
        let deadline = std::time::Instant::now() + bound;
        let active = loop {
            let text = self.http.get(&active_url).send().await?.text().await?;
            let active: u64 =
                text.lines().find_map(|l| l.split_once(": ")?.1.trim().parse().ok()).unwrap_or(0);
            if active == 0 || std::time::Instant::now() >= deadline {
                break active;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        tracing::info!(active, "envoy drained; stopping it");
        envoy.terminate(Duration::from_secs(5));
        Ok(active)
    }

    /// The filter's plugin configuration (see [`StackSpec::filter_config_json`]).
    pub fn filter_config(&self) -> serde_json::Value {
        self.spec.filter_config_json()
    }

    pub fn gateway(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.gateway_port)
    }
    pub fn admin(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.admin_port)
    }
    pub fn indexer_url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.indexer_port)
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    pub fn client(&self) -> &reqwest::Client {
        &self.http
    }

    /// The spec of another gateway replica over this stack's workers: its own indexer and Envoy
    /// (fresh ports and directory), the workers as external engines, so it starts and stops no
    /// engine. Two replicas over one fleet, as a mesh runs them, each indexer fed by every worker.
    pub fn replica_spec(&self) -> StackSpec {
        let workers = self.workers.iter().map(Worker::external_spec).collect();
        StackSpec {
            workers,
            engines: crate::vllm::Engines::External,
            ports: Ports::default(),
            work_dir: None,
            ..self.spec.clone()
        }
    }

    /// The workers serving base model `model` (all of them in a single-model stack).
    pub fn workers_of(&self, model: &str) -> Vec<&Worker> {
        self.workers
            .iter()
            .filter(|w| self.spec.model(w.model.as_deref()).is_none_or(|m| m.name == model))
            .collect()
    }

    pub fn worker(&self, id: &str) -> anyhow::Result<&Worker> {
        self.workers.iter().find(|w| w.id == id).with_context(|| format!("no worker {id}"))
    }

    /// Scrapes a Prometheus endpoint.
    pub async fn scrape(&self, url: &str) -> anyhow::Result<Metrics> {
        let text = self.http.get(url).send().await?.error_for_status()?.text().await?;
        Ok(Metrics::parse(&text)?)
    }

    /// Envoy's `/stats/prometheus` (where the filter's metrics are).
    pub async fn envoy_metrics(&self) -> anyhow::Result<Metrics> {
        self.scrape(&self.admin("/stats/prometheus")).await
    }

    /// Sum of an engine counter over every worker.
    pub async fn engine_sum(&self, name: &str) -> anyhow::Result<f64> {
        let mut total = 0.0;
        for w in &self.workers {
            total += self.scrape(&w.url("/metrics")).await?.sum(name, &[]);
        }
        Ok(total)
    }

    /// Resets every worker's prefix cache (between benchmark policies).
    pub async fn reset_caches(&self) -> anyhow::Result<()> {
        for w in &self.workers {
            self.http.post(w.url("/reset_prefix_cache")).send().await?.error_for_status()?;
        }
        Ok(())
    }

    /// Kills worker `id`'s engine with SIGKILL (its whole process group: a crash, not a shutdown).
    pub fn kill_worker(&mut self, id: &str) -> anyhow::Result<()> {
        let w = self
            .workers
            .iter_mut()
            .find(|w| w.id == id)
            .with_context(|| format!("no worker {id}"))?;
        if let Some(mut p) = w.proc.take() {
            p.kill();
        }
        Ok(())
    }

    /// Starts worker `id`'s real engine again on the same ports and waits until it is healthy.
    pub async fn restart_vllm_worker(&mut self, id: &str) -> anyhow::Result<()> {
        let crate::vllm::Engines::Vllm(opts) = self.spec.engines.clone() else {
            bail!("restart_vllm_worker needs real vLLM engines")
        };
        let index = self
            .workers
            .iter()
            .position(|w| w.id == id)
            .with_context(|| format!("no worker {id}"))?;
        let extra = self
            .spec
            .workers
            .iter()
            .find(|w| w.id == id)
            .map(|w| w.args.clone())
            .unwrap_or_default();
        let (block_size, dir) = (self.spec.block_size, self.dir().to_path_buf());
        let w = &mut self.workers[index];
        crate::vllm::restart_worker(w, &opts, block_size, index, extra, &dir).await
    }
}

/// One `vllm-sim` per worker, each on free ports it reports in its READY line.
fn start_sims(spec: &StackSpec, dir: &Path) -> anyhow::Result<Vec<Worker>> {
    let sim = binary("vllm-sim", spec.release)?;
    let mut procs = Vec::new();
    let adapter_dir = dir.join("lora");
    for w in &spec.workers {
        let mut cmd = Command::new(&sim);
        cmd.args(["--port", "0", "--id", &w.id, "--role", w.role.as_str()]);
        match spec.model(w.model.as_deref()) {
            Some(m) => {
                // vLLM loads an adapter from its directory; the simulator only names it, but
                // the path it is given exists either way.
                for a in &m.adapters {
                    std::fs::create_dir_all(adapter_dir.join(a))?;
                }
                cmd.args(m.engine_args(&adapter_dir));
            }
            None => {
                cmd.args(["--block-size", &spec.block_size.to_string()]);
            }
        }
        if spec.kv_events {
            cmd.args([
                "--kv-events-endpoint",
                "tcp://127.0.0.1:*",
                "--kv-events-replay-endpoint",
                "tcp://127.0.0.1:*",
            ]);
        }
        cmd.args(&spec.sim_args).args(&w.args);
        procs.push((w, Proc::spawn(&format!("sim-{}", w.id), cmd, dir)?));
    }
    let mut workers = Vec::new();
    for (w, mut proc) in procs {
        proc.wait_ready()?;
        let http = proc.ready_field("http").context("sim READY line without http=")?.to_owned();
        workers.push(Worker {
            id: w.id.clone(),
            role: w.role,
            model: w.model.clone(),
            http,
            kv_events: proc.ready_field("kv_events").map(str::to_owned),
            replay: proc.ready_field("replay").map(str::to_owned),
            proc: Some(proc),
        });
    }
    Ok(workers)
}

/// Envoy's `--drain-time-s` in stacks: how long a draining listener still accepts connections.
pub const ENVOY_DRAIN_TIME_S: u64 = 2;

/// The fleet file the indexer reads: one description for the indexer and the Envoy bootstrap.
/// A single-model spec gets one `[model]` table; a spec with a model catalog
/// ([`StackSpec::has_model_catalog`]) gets one `[[models]]` table per model and each worker's
/// `model`.
pub fn fleet_toml(
    spec: &StackSpec,
    workers: &[&Worker],
    gateway_port: u16,
    admin_port: u16,
    indexer_port: u16,
) -> String {
    let catalog = spec.has_model_catalog();
    let mut out = format!("listen = \"127.0.0.1:{indexer_port}\"\n\n");
    if catalog {
        out.push_str(&models_toml(&spec.models));
    } else {
        // One model without aliases or adapters: a `[model]` table, as every single-model
        // fleet is written.
        let (name, block_size, extra) = match spec.models.first() {
            Some(m) => (m.name.as_str(), m.block_size, toml_lines(&m.extra_toml)),
            None => ("deepseek-v4", spec.block_size, String::new()),
        };
        out.push_str(&format!(
            "[model]\nname = {}\nblock_size = {block_size}\n{extra}{}\n",
            toml_str(name),
            spec.model_toml
        ));
    }
    out.push_str(&format!(
        "\n[gateway]\nlisten = \"127.0.0.1:{gateway_port}\"\nadmin = \"127.0.0.1:{admin_port}\"\n\n[routing]\n{}\n",
        spec.routing_toml
    ));
    if let Ok(filter) = toml::Value::try_from(spec.filter_config_json()) {
        if let Ok(text) = toml::to_string(&filter) {
            out.push_str(&format!("\n[filter]\n{text}"));
        }
    }
    if spec.edge.uses_epp() {
        // Port 0 until the first indexer said which port it bound (`Ports::epp`).
        out.push_str(&format!("\n[epp]\nlisten = \"127.0.0.1:{}\"\n", spec.ports.epp.unwrap_or(0)));
        if spec.epp_conformance {
            out.push_str("conformance = true\n");
        }
    }
    let default_model = spec.models.first().map(|m| m.name.as_str());
    for w in workers {
        out.push_str(&format!("\n[[workers]]\nid = \"{}\"\n", w.id));
        if catalog {
            if let Some(model) = w.model.as_deref().or(default_model) {
                out.push_str(&format!("model = {}\n", toml_str(model)));
            }
        }
        out.push_str(&format!("role = \"{}\"\nendpoint = \"{}\"\n", w.role.as_str(), w.http));
        if let Some(ev) = &w.kv_events {
            out.push_str(&format!("kv_events = \"{ev}\"\n"));
        }
        if let Some(r) = &w.replay {
            out.push_str(&format!("kv_replay = \"{r}\"\n"));
        }
    }
    out
}

/// The `[[models]]` tables of a fleet with a model catalog, the default model first.
fn models_toml(models: &[ModelSpec]) -> String {
    let list = |names: &[String]| {
        let quoted: Vec<String> = names.iter().map(|n| toml_str(n)).collect();
        format!("[{}]", quoted.join(", "))
    };
    let mut out = String::new();
    for m in models {
        out.push_str(&format!("[[models]]\nname = {}\n", toml_str(&m.name)));
        if !m.aliases.is_empty() {
            out.push_str(&format!("aliases = {}\n", list(&m.aliases)));
        }
        out.push_str(&format!("block_size = {}\n", m.block_size));
        if !m.adapters.is_empty() {
            out.push_str(&format!("adapters = {}\n", list(&m.adapters)));
        }
        out.push_str(&toml_lines(&m.extra_toml));
        out.push('\n');
    }
    out
}

/// Extra lines for a table, ending in a newline (nothing when there are none).
fn toml_lines(extra: &str) -> String {
    let extra = extra.trim_end();
    if extra.is_empty() {
        String::new()
    } else {
        format!("{extra}\n")
    }
}

/// `s` as a TOML basic string, quotes and escapes included.
fn toml_str(s: &str) -> String {
    toml::Value::String(s.to_owned()).to_string()
}

/// Makes the fleet file's `[epp] listen` `127.0.0.1:<port>` (left alone when it says so already).
/// Edits the file as written — a test may have rewritten it — rather than writing it anew.
fn pin_epp_port(path: &Path, port: u16) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(path)?;
    let mut doc: toml::Table = toml::from_str(&text).context("the fleet file")?;
    let want = format!("127.0.0.1:{port}");
    let epp = doc.entry("epp").or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let table = epp.as_table_mut().context("the fleet file's `epp` is not a table")?;
    if table.get("listen").and_then(toml::Value::as_str) == Some(want.as_str()) {
        return Ok(());
    }
    table.insert("listen".to_owned(), toml::Value::String(want));
    std::fs::write(path, toml::to_string(&doc)?)?;
    Ok(())
}

fn split_host_port(addr: &str) -> anyhow::Result<(String, u16)> {
    let (h, p) = addr.rsplit_once(':').with_context(|| format!("bad address {addr}"))?;
    Ok((h.to_owned(), p.parse().with_context(|| format!("bad port in {addr}"))?))
}

/// `$KVMESH_ENVOY`, else `.tools/bin/envoy`.
pub fn envoy_binary() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("KVMESH_ENVOY")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate::procs::repo_root().join(".tools/bin/envoy"));
    if !path.exists() {
        bail!("{} not found: run `make setup`", path.display());
    }
    Ok(path)
}

/// `$KVMESH_WASM`, else the `make wasm` output.
pub fn wasm_path() -> anyhow::Result<PathBuf> {
    let path = std::env::var_os("KVMESH_WASM").map(PathBuf::from).unwrap_or_else(|| {
        crate::procs::repo_root().join("target/wasm32-wasip1/wasm/kvmesh_filter.wasm")
    });
    if !path.exists() {
        bail!("{} not found: run `make wasm`", path.display());
    }
    Ok(path)
}

#[cfg(test)]
mod fleet_toml_tests {
    use super::*;
    use kvmesh_core::api::Role;

    fn worker(id: &str, model: Option<&str>, n: u16) -> Worker {
        Worker {
            id: id.into(),
            role: Role::Both,
            model: model.map(str::to_owned),
            http: format!("127.0.0.1:{}", 8100 + n),
            kv_events: Some(format!("tcp://127.0.0.1:{}", 5557 + n)),
            replay: None,
            proc: None,
        }
    }

    #[test]
    fn a_single_model_fleet_is_one_model_table_and_plain_workers() {
        let spec = StackSpec::aggregate(2);
        let (w0, w1) = (worker("w0", None, 0), worker("w1", None, 1));
        let text = fleet_toml(&spec, &[&w0, &w1], 1, 2, 3);
        assert_eq!(
            text,
            "listen = \"127.0.0.1:3\"\n\n[model]\nname = \"deepseek-v4\"\nblock_size = 16\n\n\n\
             [gateway]\nlisten = \"127.0.0.1:1\"\nadmin = \"127.0.0.1:2\"\n\n[routing]\n\n\n\
             [filter]\nsession_header = \"x-session-id\"\n\n\
             [[workers]]\nid = \"w0\"\nrole = \"both\"\nendpoint = \"127.0.0.1:8100\"\nkv_events = \"tcp://127.0.0.1:5557\"\n\n\
             [[workers]]\nid = \"w1\"\nrole = \"both\"\nendpoint = \"127.0.0.1:8101\"\nkv_events = \"tcp://127.0.0.1:5558\"\n"
        );
    }

    #[test]
    fn several_models_are_a_catalog_and_every_worker_names_its_model() {
        let mut a = ModelSpec::new("base-a", 16).aliases(&["a"]).adapters(&["a-sql", "a-chat"]);
        a.extra_toml = "chat_template = \"/t.jinja\"".into();
        let b = ModelSpec::new("base-b", 32).adapters(&["b-code"]);
        let spec = StackSpec::multi_model(vec![a, b], 2);
        spec.check_models().unwrap();
        // A worker without a model serves the first one, and the fleet file says so.
        let workers = [
            worker("w0", None, 0),
            worker("w1", Some("base-a"), 1),
            worker("w2", Some("base-b"), 2),
        ];
        let text = fleet_toml(&spec, &workers.iter().collect::<Vec<_>>(), 1, 2, 3);
        let doc: toml::Table = toml::from_str(&text).unwrap();
        assert!(doc.get("model").is_none(), "[[models]] and [model] are exclusive:\n{text}");
        let models = doc["models"].as_array().unwrap();
        let names: Vec<&str> = models.iter().map(|m| m["name"].as_str().unwrap()).collect();
        assert_eq!(names, ["base-a", "base-b"]);
        assert_eq!(models[0]["block_size"].as_integer(), Some(16));
        assert_eq!(models[1]["block_size"].as_integer(), Some(32));
        assert_eq!(models[0]["aliases"].as_array().unwrap().len(), 1);
        assert_eq!(models[0]["adapters"].as_array().unwrap().len(), 2);
        assert_eq!(models[0]["chat_template"].as_str(), Some("/t.jinja"));
        assert!(models[1].get("aliases").is_none());
        let served: Vec<&str> = doc["workers"]
            .as_array()
            .unwrap()
            .iter()
            .map(|w| w["model"].as_str().unwrap())
            .collect();
        assert_eq!(served, ["base-a", "base-a", "base-b"]);
    }

    #[test]
    fn each_model_starts_its_engines_with_its_names_block_size_and_adapters() {
        let a = ModelSpec::new("base-a", 16).aliases(&["a"]).adapters(&["a-sql", "a-chat"]);
        let dir = Path::new("/lora");
        assert_eq!(
            a.engine_args(dir),
            [
                "--served-model-name",
                "base-a",
                "a",
                "--block-size",
                "16",
                "--enable-lora",
                "--lora-modules",
                "a-sql=/lora/a-sql",
                "a-chat=/lora/a-chat",
                "--max-loras",
                "2"
            ]
        );
        let b = ModelSpec { max_loras: Some(1), ..ModelSpec::new("base-b", 32).adapters(&["x"]) };
        assert!(b.engine_args(dir).ends_with(&["--max-loras".to_owned(), "1".to_owned()]));
        assert_eq!(
            ModelSpec::new("c", 32).engine_args(dir),
            ["--served-model-name", "c", "--block-size", "32"]
        );
    }

    #[test]
    fn the_picker_edges_get_an_epp_listener_that_a_restart_binds_again() {
        let mut spec = StackSpec::aggregate(1);
        let w0 = worker("w0", None, 0);
        assert!(!fleet_toml(&spec, &[&w0], 1, 2, 3).contains("[epp]"), "the wasm edge: no picker");
        spec.edge = Edge::ExtProc { failure_mode_allow: false };
        spec.epp_conformance = true;
        let doc: toml::Table = toml::from_str(&fleet_toml(&spec, &[&w0], 1, 2, 3)).unwrap();
        assert_eq!(doc["epp"]["listen"].as_str(), Some("127.0.0.1:0"), "the first start: port 0");
        assert_eq!(doc["epp"]["conformance"].as_bool(), Some(true));
        // Once the indexer said which port it bound, the file names it, and a restart keeps it.
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("fleet.toml");
        std::fs::write(&path, fleet_toml(&spec, &[&w0], 1, 2, 3)).unwrap();
        pin_epp_port(&path, 43210).unwrap();
        let doc: toml::Table = toml::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(doc["epp"]["listen"].as_str(), Some("127.0.0.1:43210"));
        assert_eq!(doc["epp"]["conformance"].as_bool(), Some(true), "the rest is kept");
        assert_eq!(doc["workers"][0]["id"].as_str(), Some("w0"));
        spec.ports.epp = Some(43210);
        assert!(fleet_toml(&spec, &[&w0], 1, 2, 3).contains("listen = \"127.0.0.1:43210\""));
        spec.policy = EnvoyPolicy::RoundRobin;
        assert!(spec.check_edge().is_err(), "the picker is the indexer's: kvmesh policy only");
    }

    #[test]
    fn one_model_without_adapters_is_still_a_model_table() {
        let mut m = ModelSpec::new("small", 32);
        m.extra_toml = "tokenizer = \"/t.json\"\n".into();
        let spec = StackSpec::multi_model(vec![m], 1);
        assert!(!spec.has_model_catalog());
        let w0 = worker("w0", Some("small"), 0);
        let doc: toml::Table = toml::from_str(&fleet_toml(&spec, &[&w0], 1, 2, 3)).unwrap();
        assert_eq!(doc["model"]["name"].as_str(), Some("small"));
        assert_eq!(doc["model"]["block_size"].as_integer(), Some(32));
        assert_eq!(doc["model"]["tokenizer"].as_str(), Some("/t.json"));
        assert!(doc["workers"][0].get("model").is_none());
    }
}
