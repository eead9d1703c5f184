//! `kvmesh-indexer`: loads the fleet file, starts the service, serves the API.
//!
//! Prints exactly one line to stdout once every socket is bound — `READY http=<ip:port>` (the
//! real port when `--listen` asks for port 0), then ` metrics=`, ` epp=` and ` epp_health=` for
//! the listeners configured — and logs everything else to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvmesh_indexer::config::{Config, ProcessEnv};
use kvmesh_indexer::http::{metrics_router, router};
use kvmesh_indexer::service::Service;

/// The process's allocator. glibc malloc gives threads their own arenas (up to 8 per core) and
/// keeps each arena's high-water mark resident; the indexer's threads come and go (a listener
/// thread per worker that joins, tokio's blocking pool for tokenization and reloads), so a new
/// thread landing on another arena grew that arena too and RSS crept up for as long as the
/// process ran with every map at its bound (the soak, e2e/bench/README.md "Soak"). mimalloc
/// returns freed pages to the OS and does not keep per-arena high-water marks.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Turns transparent huge pages off for this process (`prctl(PR_SET_THP_DISABLE)`), first thing in
/// `main`, before any thread starts. mimalloc madvises its arena `MADV_HUGEPAGE`; with the kernel's
/// THP mode at `madvise` (the common default) or `always`, the first touch of a 2 MiB range faults
/// in a whole huge page, mimalloc's purges of freed 64 KiB pages split them, and khugepaged
/// collapses partly-populated ranges back into full huge pages (filling up to 511 absent 4 KiB
/// pages of 512 with zeros), so RSS rose in 2 MiB steps long after the heap stopped growing (the
/// soak, e2e/bench/README.md "Soak"). The indexer's hot maps are a few MiB, so huge pages buy
/// little TLB reach here.
fn disable_transparent_huge_pages() -> nix::Result<()> {
    nix::sys::prctl::set_thp_disable(true)
}

/// Descriptors one engine's subscription holds: the SUB and replay DEALER sockets, each with a
/// monitor socket and the PAIR reading it, and their eventfds — 15 measured per worker at 1,000
/// workers (e2e/bench/HISTORY.md, "Scale"), rounded up.
const DESCRIPTORS_PER_WORKER: u64 = 16;
/// Descriptors besides the subscriptions: the listeners, the scrape and client connections, the
/// runtime's own.
const DESCRIPTORS_BASE: u64 = 512;

/// The open-file limit before and after [`raise_open_file_limit`], and its hard ceiling.
struct OpenFileLimit {
    before: u64,
    soft: u64,
    hard: u64,
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit. Every subscribed engine costs ~16
/// descriptors, so the common soft default of 1,024 is exhausted at ~60 workers — libzmq then fails
/// socket creation with "Too many open files" and those workers are never subscribed. Raising the
/// soft limit up to the hard one needs no privilege.
fn raise_open_file_limit() -> nix::Result<OpenFileLimit> {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    let (before, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    if before < hard {
        setrlimit(Resource::RLIMIT_NOFILE, hard, hard)?;
    }
    let (soft, hard) = getrlimit(Resource::RLIMIT_NOFILE)?;
    Ok(OpenFileLimit { before, soft, hard })
}

/// How many workers' subscriptions `limit` descriptors carry, by the measured cost per worker.
fn workers_within(limit: u64) -> u64 {
    limit.saturating_sub(DESCRIPTORS_BASE) / DESCRIPTORS_PER_WORKER
}

/// Logs the open-file limit against the fleet file's workers: a warning when the limit cannot
/// carry them (discovered workers are not known yet; `process_open_fds` / `process_max_fds` and
/// the `KvmeshIndexerFileDescriptors` alert watch the running process).
fn log_open_file_limit(limit: nix::Result<OpenFileLimit>, configured_workers: usize) {
    match limit {
        Ok(l) => {
            let carries = workers_within(l.soft);
            if (configured_workers as u64) > carries {
                tracing::warn!(soft = l.soft, hard = l.hard, carries_workers = carries, configured_workers, "the open-file limit cannot carry every configured worker's event subscription (~{DESCRIPTORS_PER_WORKER} descriptors each): raise the hard RLIMIT_NOFILE (ulimit -Hn, the container runtime's nofile)");
            } else {
                tracing::info!(
                    before = l.before,
                    soft = l.soft,
                    hard = l.hard,
                    carries_workers = carries,
                    "open-file limit"
                );
            }
        }
        Err(e) => {
            tracing::warn!(error = %e, "could not read or raise the open-file limit (RLIMIT_NOFILE)")
        }
    }
}

/// The kvmesh sidecar indexer.
#[derive(Parser, Debug)]
#[command(version, about)]
struct Cli {
    /// Fleet configuration (TOML, or YAML by extension).
    #[arg(long, env = "KVMESH_CONFIG")]
    config: PathBuf,
    /// `ip:port` to serve the API on (overrides `listen` and KVMESH_LISTEN; port 0 = any).
    #[arg(long)]
    listen: Option<String>,
    /// Log as JSON lines instead of text.
    #[arg(long)]
    log_json: bool,
    /// Validate the configuration, print it normalised, and exit.
    #[arg(long)]
    check: bool,
}

fn main() -> anyhow::Result<()> {
    let thp_off = disable_transparent_huge_pages();
    let open_files = raise_open_file_limit();
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cli.log_json {
        fmt.json().init();
    } else {
        fmt.init();
    }
    let env = Arc::new(ProcessEnv);
    let mut config = Config::load(&cli.config, env.as_ref())
        .with_context(|| format!("loading {}", cli.config.display()))?;
    if let Some(listen) = cli.listen {
        config.listen = listen;
        config.validate()?;
    }
    for w in config.warnings() {
        tracing::warn!("{w}");
    }
    if let Err(e) = thp_off {
        tracing::warn!(error = %e, "could not turn transparent huge pages off for this process; RSS may grow in 2 MiB steps");
    }
    log_open_file_limit(open_files, config.workers.len());
    if cli.check {
        println!("{}", toml::to_string_pretty(&config)?);
        return Ok(());
    }
    tracing::info!(version = env!("CARGO_PKG_VERSION"), git = option_env!("KVMESH_GIT_HASH").unwrap_or("unknown"), config = %cli.config.display(), "kvmesh-indexer starting");
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    runtime.block_on(run(config, cli.config, env))
}

async fn run(config: Config, path: PathBuf, env: Arc<ProcessEnv>) -> anyhow::Result<()> {
    let addr = config.listen_addr()?;
    let svc =
        tokio::task::spawn_blocking(move || Service::start(config, Some(path), env)).await??;
    let metrics_addr = config_metrics_addr(&svc)?;
    let listener =
        tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    // The metrics listener (scrapers, probes) is bound before READY, so READY means both serve.
    let metrics_listener = match metrics_addr {
        Some(m) => Some(
            tokio::net::TcpListener::bind(m)
                .await
                .with_context(|| format!("binding metrics_listen {m}"))?,
        ),
        None => None,
    };
    let metrics_local =
        metrics_listener.as_ref().map(tokio::net::TcpListener::local_addr).transpose()?;
    // The endpoint picker's listeners ([epp]), bound before READY too.
    let (epp_addr, epp_health_addr) = svc.state.config().epp.addrs()?;
    let epp_listener = bind_optional(epp_addr, "epp.listen").await?;
    let epp_health_listener = bind_optional(epp_health_addr, "epp.health_listen").await?;
    let epp_local = epp_listener.as_ref().map(tokio::net::TcpListener::local_addr).transpose()?;
    let epp_health_local =
        epp_health_listener.as_ref().map(tokio::net::TcpListener::local_addr).transpose()?;
    {
        let mut line = format!("READY http={local}");
        if let Some(m) = metrics_local {
            line.push_str(&format!(" metrics={m}"));
        }
        if let Some(e) = epp_local {
            line.push_str(&format!(" epp={e}"));
        }
        if let Some(h) = epp_health_local {
            line.push_str(&format!(" epp_health={h}"));
        }
        let mut out = std::io::stdout().lock();
        writeln!(out, "{line}")?;
        out.flush()?;
    }
    tracing::info!(http = %local, metrics = ?metrics_local, epp = ?epp_local, epp_health = ?epp_health_local, debug_endpoints = svc.state.config().debug_enabled(), "serving");
    if let Some(l) = metrics_listener {
        let app = metrics_router(svc.state.clone());
        tokio::spawn(async move {
            if let Err(e) = axum::serve(l, app).await {
                tracing::error!(error = %e, "metrics listener failed");
            }
        });
    }
    // The picker drains its streams on SIGTERM like the HTTP API does, and the process waits for
    // both: a rolling restart finishes the requests in flight through either front door.
    let epp = epp_listener.map(|l| {
        let state = svc.state.clone();
        tokio::spawn(async move {
            if let Err(e) =
                kvmesh_indexer::epp::serve(state, l, epp_health_listener, shutdown()).await
            {
                tracing::error!(error = %e, "endpoint picker listener failed");
            }
        })
    });
    svc.spawn_background();
    axum::serve(listener, router(svc.state.clone())).with_graceful_shutdown(shutdown()).await?;
    if let Some(epp) = epp {
        if let Err(e) = epp.await {
            tracing::error!(error = %e, "endpoint picker task failed");
        }
    }
    tracing::info!("shut down");
    Ok(())
}

async fn bind_optional(
    addr: Option<std::net::SocketAddr>,
    what: &str,
) -> anyhow::Result<Option<tokio::net::TcpListener>> {
    match addr {
        Some(a) => Ok(Some(
            tokio::net::TcpListener::bind(a)
                .await
                .with_context(|| format!("binding {what} {a}"))?,
        )),
        None => Ok(None),
    }
}

fn config_metrics_addr(svc: &Service) -> anyhow::Result<Option<std::net::SocketAddr>> {
    Ok(svc.state.config().metrics_addr()?)
}

async fn shutdown() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_common_soft_default_carries_few_workers_and_a_raised_limit_a_thousand() {
        assert_eq!(workers_within(1_024), 32);
        assert!(workers_within(20_000) >= 1_000);
        assert_eq!(workers_within(100), 0, "a limit below the base carries none, no underflow");
    }

    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one() {
        let l = raise_open_file_limit().expect("getrlimit works on this platform");
        assert_eq!(l.soft, l.hard);
        assert!(l.before <= l.soft);
    }
}
