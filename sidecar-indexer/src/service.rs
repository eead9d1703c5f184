//! Assembling and running an indexer: state, the applier thread, one listener per (worker, rank),
//! the engine scraper, the load-expiry ticker and configuration reloads.
//!
//! Reload semantics (SIGHUP or a changed file): the new file is parsed and validated in full (and a
//! tokenizer loaded for every model whose tokenizer settings changed) before anything changes; a
//! bad file changes nothing and is counted. Then: removed workers leave the index (their listeners are stopped and joined first, so
//! nothing they queued lands after the removal); added workers get slots and listeners; workers whose
//! event wiring changed are cleared and re-subscribed; workers that only changed endpoint or role keep
//! their index state. A model's new block size rewires its workers (so does a worker's new model);
//! a new index mode rewires every worker. `listen` needs a restart.
//! The service is the one owner of fleet changes: Kubernetes-discovered workers ([`discovery`], its
//! child) reach the fleet through this same reload, as file config + discovered workers, and a
//! file reload keeps them.
//!
//! Over 600 lines: start-up, the reload transaction (plan under the read lock, register, swap)
//! and the background loops that feed it stay together; the engine scrape loop is the next to
//! move, beside `scrape.rs` (whose owner bounds its body).

pub mod discovery;
pub mod served;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::mpsc::sync_channel;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use parking_lot::{Mutex, RwLock};

use crate::catalog::{Models, Served};
use crate::clock::{self, Entropy};
use crate::config::{
    Config, ConfigError, EnvSource, IndexMode, ModelConfig, RoutingConfig, WorkerConfig,
};
use crate::events::applier::{Applier, ApplierConfig, ApplierMsg, IndexGauges};
use crate::events::budget::EventLimits;
use crate::events::listener::{self, ListenerSpec, ListenerStats};
use crate::index::KvIndex;
use crate::load::LoadTracker;
use crate::metrics::Metrics;
use crate::recent::Sessions;
use crate::scrape::{parse_engine_metrics, EngineSample};
use crate::state::{AppState, Fleet, RankRuntime, WorkerRuntime};
use crate::tokenize::{PromptTokenizer, TokenizeError};

/// Why the service could not start or reload.
#[derive(Debug, thiserror::Error)]
pub enum ServiceError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] TokenizeError),
    #[error("metrics: {0}")]
    Metrics(#[from] prometheus::Error),
    #[error("cannot start a thread: {0}")]
    Thread(#[from] std::io::Error),
    #[error("cannot build the HTTP client for prefill legs: {0}")]
    LegClient(#[from] reqwest::Error),
}

/// A running indexer (everything but the HTTP server).
pub struct Service {
    pub state: Arc<AppState>,
    /// The listeners' ZMQ contexts, a few hundred sockets each (events/listener).
    zmq: listener::Contexts,
    /// Byte bounds of event ingestion, shared by every listener (events/budget.rs).
    event_limits: Arc<EventLimits>,
    config_path: Option<PathBuf>,
    env: Arc<dyn EnvSource>,
    reload_lock: tokio::sync::Mutex<()>,
    /// The file's config and the discovered workers; the effective config merges both (service/discovery.rs).
    pub(crate) discovery: discovery::DiscoveryLink,
}

fn event_limits(c: &Config) -> (usize, usize, usize) {
    (c.routing.event_max_frame_bytes, c.routing.replay_max_bytes, c.routing.event_queue_bytes)
}

fn applier_config(c: &Config) -> ApplierConfig {
    ApplierConfig {
        max_entries: c.routing.index_max_entries,
        max_blocks_per_worker: c.routing.max_blocks_per_worker,
        approx_ttl: Duration::from_secs(c.routing.approx_ttl_secs),
        approx_max_blocks_per_worker: c.routing.approx_max_blocks_per_worker,
    }
}

/// Base model `m`'s tokenizer, its caches bounded by `r`.
fn load_tokenizer(m: &ModelConfig, r: &RoutingConfig) -> Result<PromptTokenizer, TokenizeError> {
    PromptTokenizer::load(
        &m.tokenizer_path(),
        m.chat_template.as_deref(),
        &m.bos_token,
        r.tokenize_cache_bytes,
    )
    .map(|t| t.with_memo_bytes(r.tokenize_memo_bytes))
}

/// Whether worker `w` (in `old`) must be cleared and re-subscribed under `new`: its event wiring
/// changed, the index mode changed, it serves another model now, or its model's block size changed.
fn needs_rewire(old: &Config, new: &Config, was: &WorkerConfig, w: &WorkerConfig) -> bool {
    let block_size =
        |c: &Config, w: &WorkerConfig| c.model_named(c.worker_model(w)).map(|m| m.block_size);
    old.routing.mode != new.routing.mode
        || was.events_differ(w)
        || old.worker_model(was) != new.worker_model(w)
        || block_size(old, was) != block_size(new, w)
}

impl Service {
    /// Builds the state, starts the applier and the listeners. `config_path` enables reloads.
    pub fn start(
        config: Config,
        config_path: Option<PathBuf>,
        env: Arc<dyn EnvSource>,
    ) -> Result<Arc<Self>, ServiceError> {
        let tokenizer = load_tokenizer(config.model(), &config.routing)?;
        Self::start_with_tokenizer(config, config_path, env, tokenizer)
    }

    /// [`Service::start`] with the default model's tokenizer already loaded (tests share one); the
    /// other models' are loaded from their files.
    pub fn start_with_tokenizer(
        config: Config,
        config_path: Option<PathBuf>,
        env: Arc<dyn EnvSource>,
        tokenizer: PromptTokenizer,
    ) -> Result<Arc<Self>, ServiceError> {
        Self::start_seeded(config, config_path, env, tokenizer, Entropy::Os)
    }

    /// [`Service::start_with_tokenizer`] drawing its randomness (booking-id nonce, tie-breaks)
    /// from `entropy` (`crate::clock`).
    pub fn start_seeded(
        config: Config,
        config_path: Option<PathBuf>,
        env: Arc<dyn EnvSource>,
        tokenizer: PromptTokenizer,
        entropy: Entropy,
    ) -> Result<Arc<Self>, ServiceError> {
        let metrics = Arc::new(Metrics::new()?);
        let mut given = Some(tokenizer);
        let runtimes = crate::catalog::runtimes(&config, &[], |m| match given.take() {
            Some(t) => Ok(t),
            None => load_tokenizer(m, &config.routing),
        })?;
        for m in &config.models {
            metrics.init_model_series(&m.name);
        }
        let (models, _) = Models::new(runtimes, &Served::default());
        let index = Arc::new(RwLock::new(KvIndex::new(
            config.routing.index_max_entries,
            config.routing.max_blocks_per_worker,
        )));
        index.read().set_recovery_blocks(config.routing.recovery_max_blocks);
        let gauges = Arc::new(IndexGauges::default());
        let free_slots = Arc::new(Mutex::new(Vec::new()));
        let (tx, rx) = sync_channel(config.routing.event_queue_batches);
        let applier = Applier::new(
            index.clone(),
            metrics.clone(),
            gauges.clone(),
            free_slots.clone(),
            applier_config(&config),
        );
        std::thread::Builder::new().name("kv-applier".into()).spawn(move || applier.run(rx))?;
        let routing = &config.routing;
        let state = Arc::new(AppState {
            // The nonce keeps this process's booking ids apart from a previous process's.
            load: Mutex::new(LoadTracker::new(
                Duration::from_secs(routing.load_expiry_secs),
                routing.max_bookings,
                entropy.nonce(),
            )),
            config: RwLock::new(Arc::new(config.clone())),
            fleet: RwLock::new(Fleet::default()),
            index,
            gauges,
            models: RwLock::new(Arc::new(models)),
            served: Default::default(),
            metrics,
            applier: tx,
            engine_totals: Default::default(),
            free_slots,
            next_slot: Mutex::new(0),
            started: clock::now(),
            sessions: Mutex::new(Sessions::new(routing, clock::now())),
            // Legs carry their own deadline (tokio timeout); idle connections to workers are reused.
            legs: reqwest::Client::builder().pool_max_idle_per_host(32).build()?,
            dry_runs: Default::default(),
            route_inflight: Default::default(),
            placement: Mutex::new(crate::state::Placement::new(routing, entropy.rng())),
            decisions_since_scrape: Default::default(),
            body_memo: Default::default(),
            scrape_soon: Default::default(),
            background: Default::default(),
        });
        let (frame, replay, queue) = event_limits(&config);
        let event_limits = Arc::new(EventLimits::new(frame, replay, queue));
        let svc = Arc::new(Self {
            state,
            zmq: listener::Contexts::default(),
            event_limits,
            config_path,
            env,
            reload_lock: tokio::sync::Mutex::new(()),
            discovery: discovery::DiscoveryLink::new(&config),
        });
        let workers: Vec<WorkerRuntime> =
            config.workers.iter().map(|w| svc.add_worker(w, &config)).collect::<Result<_, _>>()?;
        {
            let mut fleet = svc.state.fleet.write();
            fleet.workers = workers;
            fleet.generation = 1;
            fleet.reindex();
        }
        tracing::info!(
            workers = config.workers.len(),
            models = %config.models.iter().map(|m| format!("{} (block_size {})", m.name, m.block_size)).collect::<Vec<_>>().join(", "),
            mode = config.routing.mode.as_str(),
            "indexer started"
        );
        Ok(svc)
    }

    fn add_worker(&self, w: &WorkerConfig, config: &Config) -> Result<WorkerRuntime, ServiceError> {
        let model = config.worker_model(w).to_owned();
        self.state.metrics.register_worker(&w.id, &model);
        let ranks =
            (0..w.dp_ranks).map(|rank| self.add_rank(w, rank, config)).collect::<Result<_, _>>()?;
        Ok(WorkerRuntime {
            cfg: w.clone(),
            model,
            ranks,
            healthy: true,
            scrape_failures: 0,
            engine: None,
            hits: Default::default(),
            queries: Default::default(),
            routable: self.discovery.routable(&w.id),
            meter: Default::default(),
        })
    }

    fn add_rank(
        &self,
        w: &WorkerConfig,
        rank: u32,
        config: &Config,
    ) -> Result<RankRuntime, ServiceError> {
        let slot = self.state.alloc_slot();
        let stats = Arc::new(ListenerStats::default());
        let model = config.worker_model(w);
        let _ = self.state.applier.send(ApplierMsg::AddWorker {
            slot,
            label: w.id.as_str().into(),
            model: model.into(),
            block_size: config.model_named(model).map_or(0, |m| m.block_size),
            stats: stats.clone(),
        });
        let listener = match (config.routing.mode, w.events_endpoint(rank)) {
            (IndexMode::Precise, Some(events_endpoint)) => {
                let spec = ListenerSpec {
                    worker: w.id.clone(),
                    rank,
                    slot,
                    events_endpoint,
                    replay_endpoint: w.replay_endpoint(rank),
                    bind: w.kv_events_bind,
                    topic: w.kv_topic.clone(),
                    replay_timeout: Duration::from_millis(config.routing.replay_timeout_ms),
                };
                Some(listener::spawn(
                    self.zmq.for_slot(slot),
                    spec,
                    self.state.applier.clone(),
                    stats.clone(),
                    self.state.metrics.clone(),
                    self.event_limits.clone(),
                )?)
            }
            _ => {
                stats.synced.store(true, Ordering::Relaxed);
                None
            }
        };
        Ok(RankRuntime { rank, slot, stats, listener })
    }

    /// Stops a rank's listener (blocking until its thread is gone) and removes it from the index.
    fn retire_rank(&self, mut r: RankRuntime) {
        if let Some(l) = r.listener.take() {
            l.stop();
        }
        let _ = self.state.applier.send(ApplierMsg::RemoveWorker { slot: r.slot });
    }

    /// Waits until the applier has applied everything queued so far.
    pub fn barrier(&self) {
        let (tx, rx) = sync_channel(1);
        if self.state.applier.send(ApplierMsg::Barrier(tx)).is_ok() {
            let _ = rx.recv_timeout(Duration::from_secs(30));
        }
    }

    /// Re-reads the config file and applies it. Returns whether anything changed.
    pub async fn reload_from_file(self: &Arc<Self>) -> Result<bool, ServiceError> {
        let Some(path) = self.config_path.clone() else {
            return Ok(false);
        };
        let env = self.env.clone();
        let parsed = tokio::task::spawn_blocking(move || Config::load(&path, env.as_ref()))
            .await
            .map_err(|e| ServiceError::Config(ConfigError::Parse(e.to_string())))?;
        let mut new = parsed?;
        // A --listen override outlives reloads: the socket cannot move anyway.
        new.listen = self.state.config().listen.clone();
        // Discovered workers outlive file reloads: the new file is merged with them (service/discovery.rs).
        discovery::reload_file(self, new).await
    }

    /// Applies a validated configuration (see the module docs). Returns whether anything changed.
    pub async fn reload(self: &Arc<Self>, new: Config) -> Result<bool, ServiceError> {
        let _guard = self.reload_lock.lock().await;
        let old = self.state.config();
        if *old == new {
            self.state.metrics.config_reloads.with_label_values(&["unchanged"]).inc();
            return Ok(false);
        }
        let result = self.clone().apply_reload(old, new).await;
        self.state
            .metrics
            .config_reloads
            .with_label_values(&[if result.is_ok() { "ok" } else { "error" }])
            .inc();
        result.map(|()| true)
    }

    async fn apply_reload(
        self: Arc<Self>,
        old: Arc<Config>,
        new: Config,
    ) -> Result<(), ServiceError> {
        if old.listen != new.listen {
            tracing::warn!(old = %old.listen, new = %new.listen, "listen changed: takes effect on restart");
        }
        // Tokenizers are kept for models whose tokenizer settings and cache bounds are unchanged,
        // and loaded for the others before anything changes (a bad file changes nothing).
        let bounds_changed = old.routing.tokenize_cache_bytes != new.routing.tokenize_cache_bytes
            || old.routing.tokenize_memo_bytes != new.routing.tokenize_memo_bytes;
        let kept =
            if bounds_changed { Vec::new() } else { self.state.models().runtimes().to_vec() };
        let c = new.clone();
        let runtimes = tokio::task::spawn_blocking(move || {
            crate::catalog::runtimes(&c, &kept, |m| load_tokenizer(m, &c.routing))
        })
        .await
        .map_err(|e| ServiceError::Config(ConfigError::Parse(e.to_string())))??;
        let this = self.clone();
        tokio::task::spawn_blocking(move || this.apply_reload_blocking(&old, new, runtimes))
            .await
            .map_err(|e| ServiceError::Config(ConfigError::Parse(e.to_string())))?
    }

    fn apply_reload_blocking(
        &self,
        old: &Config,
        new: Config,
        runtimes: Vec<Arc<crate::catalog::ModelRuntime>>,
    ) -> Result<(), ServiceError> {
        let _ = self.state.applier.send(ApplierMsg::Configure(applier_config(&new)));
        let (frame, replay, queue) = event_limits(&new);
        self.event_limits.set(frame, replay, queue);
        // A smaller body memo bound takes effect now (routes only shrink it when they keep one).
        self.state.body_memo.lock().shrink_to(new.routing.body_memo_bytes);
        // Three steps, so the fleet lock is never held across a blocking send (registering a rank
        // sends to the applier's bounded queue, which may be full) nor across a listener's stop:
        // plan under the read lock, build new ranks with no lock held, then swap under the write
        // lock (route queries never see an empty fleet). Membership changes only here, under
        // `reload_lock`, so the plan still holds at the swap; health and routability flips made
        // meanwhile live in the runtimes that are moved over.
        let rewired: Vec<&WorkerConfig> = {
            let fleet = self.state.fleet.read();
            new.workers
                .iter()
                .filter(|w| {
                    fleet
                        .workers
                        .iter()
                        .any(|o| o.cfg.id == w.id && needs_rewire(old, &new, &o.cfg, w))
                })
                .collect()
        };
        let added: Vec<&WorkerConfig> = {
            let fleet = self.state.fleet.read();
            new.workers.iter().filter(|w| !fleet.workers.iter().any(|o| o.cfg.id == w.id)).collect()
        };
        let mut failure = None;
        let mut fresh_ranks: HashMap<String, Vec<RankRuntime>> = HashMap::new();
        for w in rewired {
            match (0..w.dp_ranks)
                .map(|rank| self.add_rank(w, rank, &new))
                .collect::<Result<Vec<_>, _>>()
            {
                Ok(r) => {
                    fresh_ranks.insert(w.id.clone(), r);
                }
                Err(e) => failure = Some(e),
            }
        }
        let mut fresh_workers: HashMap<String, WorkerRuntime> = HashMap::new();
        for w in added {
            match self.add_worker(w, &new) {
                Ok(rt) => {
                    fresh_workers.insert(w.id.clone(), rt);
                }
                Err(e) => failure = Some(e),
            }
        }
        let mut retire: Vec<RankRuntime> = Vec::new();
        let mut removed: Vec<(String, String)> = Vec::new();
        {
            let mut fleet = self.state.fleet.write();
            let mut old_workers = std::mem::take(&mut fleet.workers);
            let mut next = Vec::with_capacity(new.workers.len());
            let mut changed_membership = false;
            for w in &new.workers {
                let rt = match old_workers.iter().position(|o| o.cfg.id == w.id) {
                    Some(i) => {
                        let mut rt = old_workers.swap_remove(i);
                        if let Some(ranks) = fresh_ranks.remove(&w.id) {
                            tracing::info!(worker = %w.id, "event wiring, model or block size changed: clearing and re-subscribing");
                            self.state
                                .metrics
                                .kv_resyncs
                                .with_label_values(&[&w.id, "events_rewired"])
                                .inc();
                            retire.append(&mut rt.ranks);
                            rt.ranks = ranks;
                        }
                        let model = new.worker_model(w);
                        changed_membership |= rt.cfg.endpoint != w.endpoint
                            || rt.cfg.role != w.role
                            || rt.model != model;
                        if rt.model != model {
                            self.state.metrics.forget_worker(&w.id, &rt.model);
                            self.state.metrics.register_worker(&w.id, model);
                            rt.model = model.to_owned();
                        }
                        rt.cfg = w.clone();
                        rt
                    }
                    None => match fresh_workers.remove(&w.id) {
                        Some(rt) => {
                            tracing::info!(worker = %w.id, endpoint = %w.endpoint, "worker added");
                            changed_membership = true;
                            rt
                        }
                        // Its listener could not start (`failure`).
                        None => continue,
                    },
                };
                next.push(rt);
            }
            for mut gone in old_workers {
                tracing::info!(worker = %gone.cfg.id, "worker removed: its blocks leave the index");
                changed_membership = true;
                retire.append(&mut gone.ranks);
                removed.push((gone.cfg.id, gone.model));
            }
            fleet.workers = next;
            fleet.reindex();
            if changed_membership {
                fleet.generation += 1;
            }
        }
        if let Some(e) = failure {
            tracing::error!(error = %e, "reload partly applied: a listener could not start");
        }
        // Built for a plan that no longer holds (cannot happen under reload_lock): retire them.
        for (_, ranks) in fresh_ranks {
            retire.extend(ranks);
        }
        for (_, mut rt) in fresh_workers {
            retire.append(&mut rt.ranks);
        }
        // Every retired listener is asked first, then each is waited for: a pool of 1,000 workers
        // scaled away costs one poll interval (100 ms), not 1,000 of them.
        for r in &retire {
            if let Some(l) = &r.listener {
                l.ask_to_stop();
            }
        }
        for r in retire {
            self.retire_rank(r);
        }
        for (id, model) in removed {
            crate::route::bookings::forget_worker(&self.state, &id);
            self.state.placement.lock().remove_worker(&id);
            self.state.metrics.forget_worker(&id, &model);
            self.state.served.lock().served.by_worker.remove(&id);
        }
        self.state.load.lock().set_limits(
            Duration::from_secs(new.routing.load_expiry_secs),
            new.routing.max_bookings,
        );
        self.state.index.read().set_recovery_blocks(new.routing.recovery_max_blocks);
        self.state.sessions.lock().set_limits(&new.routing);
        self.state.placement.lock().set_limits(&new.routing);
        for m in &new.models {
            self.state.metrics.init_model_series(&m.name);
        }
        // Served adapters stay with the workers that reported them (a worker that now serves
        // another model reports again at its next poll).
        self.state.served.lock().served.by_worker.retain(|id, (base, _)| {
            new.workers.iter().any(|w| &w.id == id && new.worker_model(w) == base)
        });
        let (models, _) = Models::new(runtimes, &Served::default());
        *self.state.models.write() = Arc::new(models);
        self.state.rebuild_catalog();
        *self.state.config.write() = Arc::new(new);
        tracing::info!("configuration reloaded");
        Ok(())
    }

    /// Background work: Kubernetes discovery (with `[discovery.kubernetes]`), engine scrapes, load
    /// expiry and (with a config path) reload on change or SIGHUP. Runs until the process ends.
    pub fn spawn_background(self: &Arc<Self>) {
        discovery::spawn(self);
        tokio::spawn(scrape_loop(self.clone()));
        tokio::spawn(served::poll_loop(self.clone()));
        tokio::spawn(expiry_loop(self.clone()));
        if self.config_path.is_some() {
            tokio::spawn(reload_loop(self.clone()));
        }
    }
}

/// Once a second, releases the bookings older than `load_expiry_secs` (`LoadTracker::expire`).
pub(crate) async fn expiry_loop(svc: Arc<Service>) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        expire_load(&svc.state, clock::now());
    }
}

/// One expiry pass at `now`: releases, counts and logs what never reported done, and has the
/// applier drop approximate-mode blocks past `approx_ttl_secs` (a full queue: the next pass).
pub(crate) fn expire_load(state: &AppState, now: Instant) {
    let _ = state.applier.try_send(crate::events::applier::ApplierMsg::Expire { now });
    crate::route::bookings::expire(state, now);
}

fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

async fn reload_loop(svc: Arc<Service>) {
    let Some(path) = svc.config_path.clone() else {
        return;
    };
    let mut hup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on file change only");
            None
        }
    };
    let mut stamp = file_stamp(&path);
    loop {
        let poll = Duration::from_millis(svc.state.config().routing.reload_poll_ms);
        let by_signal = match hup.as_mut() {
            Some(h) => tokio::select! {
                _ = h.recv() => true,
                _ = tokio::time::sleep(poll) => false,
            },
            None => {
                tokio::time::sleep(poll).await;
                false
            }
        };
        let now = file_stamp(&path);
        if !by_signal && now == stamp {
            continue;
        }
        stamp = now;
        match svc.reload_from_file().await {
            Ok(changed) => tracing::info!(signal = by_signal, changed, "config reload checked"),
            Err(e) => {
                svc.state.metrics.config_reloads.with_label_values(&["error"]).inc();
                tracing::error!(error = %e, path = %path.display(), "config reload refused; keeping the running configuration");
            }
        }
    }
}

/// Scrapes every worker's `/metrics` each `scrape_interval_ms` and applies the round ([`apply_scrapes`]).
pub(crate) async fn scrape_loop(svc: Arc<Service>) {
    let client = match reqwest::Client::builder().build() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!(error = %e, "cannot build the scrape client; engine metrics and health are not scraped");
            return;
        }
    };
    loop {
        let cfg = svc.state.config();
        let interval = Duration::from_millis(cfg.routing.scrape_interval_ms);
        let timeout = Duration::from_millis(cfg.routing.scrape_timeout_ms);
        let targets: Vec<(String, String)> = svc
            .state
            .fleet
            .read()
            .workers
            .iter()
            .map(|w| (w.cfg.id.clone(), w.cfg.endpoint.clone()))
            .collect();
        let started = clock::now();
        svc.state.decisions_since_scrape.store(0, Ordering::Relaxed);
        let max_body = cfg.routing.scrape_max_body_bytes;
        let results = futures::future::join_all(targets.into_iter().map(|(id, endpoint)| {
            let (client, metrics) = (client.clone(), &svc.state.metrics);
            async move {
                let res = crate::scrape::body::fetch_metrics(
                    &client, &endpoint, timeout, max_body, &id, metrics,
                )
                .await;
                (id, res.map_err(|e| e.to_string()))
            }
        }))
        .await;
        apply_scrapes(&svc.state, &cfg, results, clock::now());
        // The next round at the interval, or earlier (but not before the burst minimum) when a
        // burst of decisions asked for one.
        let elapsed = || clock::now().saturating_duration_since(started);
        tokio::select! {
            () = tokio::time::sleep(interval.saturating_sub(elapsed())) => {}
            () = svc.state.scrape_soon.notified() => {
                let min = Duration::from_millis(cfg.routing.scrape_burst_min_interval_ms);
                tokio::time::sleep(min.saturating_sub(elapsed())).await;
            }
        }
    }
}

/// Applies one round of scrapes taken at `now`, per worker its `/metrics` text or why it failed:
/// engine samples, the prefill meter, and health (unhealthy after `unhealthy_after_failures`
/// failures in a row, healthy again on the first answer; a flip bumps the fleet generation).
pub(crate) fn apply_scrapes(
    state: &AppState,
    cfg: &Config,
    results: Vec<(String, Result<String, String>)>,
    now: Instant,
) {
    let m = &state.metrics;
    // Parsed before the fleet's write lock is taken: an engine's `/metrics` text runs to hundreds
    // of kilobytes, and every route call reads the fleet.
    let results: Vec<(String, Result<EngineSample, String>)> = results
        .into_iter()
        .map(|(id, res)| (id, res.map(|text| parse_engine_metrics(&text))))
        .collect();
    let mut fleet = state.fleet.write();
    let mut health_changed = false;
    // What each answering engine reports waiting, for the prefill model below.
    let mut waiting = Vec::new();
    for (id, res) in results {
        let Some(w) = fleet.workers.iter_mut().find(|w| w.cfg.id == id) else {
            continue;
        };
        match res {
            Ok(sample) => {
                m.engine_scrapes.with_label_values(&[&id, "ok"]).inc();
                if let Some(h) = sample.hits {
                    let inc = w.hits.advance(h) as u64;
                    m.engine_hits.with_label_values(&[&id]).inc_by(inc);
                    state.engine_totals.hits.fetch_add(inc, Ordering::Relaxed);
                }
                if let Some(q) = sample.queries {
                    let inc = w.queries.advance(q) as u64;
                    m.engine_queries.with_label_values(&[&id]).inc_by(inc);
                    state.engine_totals.queries.fetch_add(inc, Ordering::Relaxed);
                }
                w.meter.observe(&sample, now, cfg.routing.meter_hold());
                waiting.push((
                    id.clone(),
                    sample.waiting.max(0.0) as u64,
                    sample.running.max(0.0) as u64,
                ));
                w.engine = Some(sample);
                w.scrape_failures = 0;
                if !w.healthy {
                    tracing::info!(worker = %id, "worker healthy again");
                    w.healthy = true;
                    health_changed = true;
                }
            }
            Err(e) => {
                m.engine_scrapes.with_label_values(&[&id, "error"]).inc();
                w.scrape_failures = w.scrape_failures.saturating_add(1);
                let limit = cfg.routing.unhealthy_after_failures;
                if w.healthy && limit > 0 && w.scrape_failures >= limit {
                    tracing::warn!(worker = %id, failures = w.scrape_failures, error = %e, "worker unreachable: no traffic until it answers again");
                    w.healthy = false;
                    w.engine = None;
                    health_changed = true;
                }
            }
        }
    }
    if health_changed {
        fleet.generation += 1;
    }
    fleet.remeasure();
    // Each worker's unknown requests are counted in its own model's blocks.
    let unknown_tokens = |model: &str| {
        let bs = cfg.model_named(model).map_or(cfg.model().block_size, |m| m.block_size);
        (cfg.routing.unknown_request_blocks * u64::from(bs)) as f64
    };
    let waiting: Vec<(String, u64, u64, f64, f64)> = waiting
        .into_iter()
        .filter_map(|(id, n, running)| {
            let w = fleet.workers.iter().find(|w| w.cfg.id == id)?;
            let tps = fleet.prefill_tokens_per_s(w, &cfg.routing);
            Some((id, n, running, tps, unknown_tokens(&w.model)))
        })
        .collect();
    // The engines' waiting requests that this indexer did not book join its prefill model, taken
    // after the fleet lock (lock order: fleet, load, placement; never two of them here). At most
    // the requests each engine holds beyond this indexer's live bookings are someone else's.
    drop(fleet);
    let waiting: Vec<_> = {
        let load = state.load.lock();
        waiting
            .into_iter()
            .map(|(id, n, running, tps, unknown)| {
                let not_own =
                    running.saturating_add(n).saturating_sub(load.worker(&id).active_requests);
                (id, n, not_own, tps, unknown)
            })
            .collect()
    };
    let mut placement = state.placement.lock();
    for (id, waiting, not_own, tps, unknown_tokens) in waiting {
        placement.backlog.reconcile(&id, waiting, not_own, unknown_tokens, tps, now);
    }
}
