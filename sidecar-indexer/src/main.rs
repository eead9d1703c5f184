//! `kvmesh-indexer`: loads the fleet file, starts the service, serves the API.
//!
//! Prints exactly one line to stdout once the API socket is bound — `READY http=<ip:port>` (the
//! real port when `--listen` asks for port 0) — and logs everything else to stderr.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use kvmesh_indexer::config::{Config, ProcessEnv};
use kvmesh_indexer::http::router;
use kvmesh_indexer::service::Service;

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
    let cli = Cli::parse();
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    if cli.log_json {
        fmt.json().init();
    } else {
        fmt.init();
    }
    let env = Arc::new(ProcessEnv);
    let mut config = Config::load(&cli.config, env.as_ref()).with_context(|| format!("loading {}", cli.config.display()))?;
    if let Some(listen) = cli.listen {
        config.listen = listen;
        config.validate()?;
    }
    for w in config.warnings() {
        tracing::warn!("{w}");
    }
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
    let svc = tokio::task::spawn_blocking(move || Service::start(config, Some(path), env)).await??;
    let listener = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY http={local}")?;
        out.flush()?;
    }
    tracing::info!(http = %local, "serving");
    svc.spawn_background();
    axum::serve(listener, router(svc.state.clone())).with_graceful_shutdown(shutdown()).await?;
    tracing::info!("shut down");
    Ok(())
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
