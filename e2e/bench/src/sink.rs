//! Results sink: request tasks send records over a bounded channel to one writer task that
//! appends JSONL lines to the results file.
//!
//! One writer means lines never interleave; the bounded channel ([`SINK_CAPACITY`]) means a slow
//! disk slows the request tasks down instead of growing memory. Records are written in
//! completion order (the report does not depend on order; `index` says where each came from).

use crate::record::RequestRecord;
use std::io::Write;
use std::path::{Path, PathBuf};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Records buffered between request tasks and the writer.
pub const SINK_CAPACITY: usize = 4096;

/// Counts the writer reports when closed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SinkStats {
    /// Records written.
    pub written: u64,
    /// Records that were failures.
    pub failed: u64,
}

/// Why the sink failed.
#[derive(Debug, thiserror::Error)]
pub enum SinkError {
    /// Creating or writing the file failed.
    #[error("writing {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The writer task died.
    #[error("results writer task failed: {0}")]
    Join(String),
}

/// The sending side plus the writer's handle.
pub struct Sink {
    tx: mpsc::Sender<RequestRecord>,
    handle: JoinHandle<Result<SinkStats, SinkError>>,
}

impl Sink {
    /// Creates (truncates) `path` and starts the writer. Logs progress every `log_every` records.
    pub fn create(path: &Path, log_every: u64) -> Result<Self, SinkError> {
        let io = |source| SinkError::Io { path: path.to_path_buf(), source };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let file = std::fs::File::create(path).map_err(io)?;
        let (tx, mut rx) = mpsc::channel::<RequestRecord>(SINK_CAPACITY);
        let owned = path.to_path_buf();
        let handle = tokio::task::spawn_blocking(move || {
            let io = |source| SinkError::Io { path: owned.clone(), source };
            let mut w = std::io::BufWriter::new(file);
            let mut stats = SinkStats::default();
            while let Some(rec) = rx.blocking_recv() {
                let line = serde_json::to_string(&rec).map_err(|e| io(std::io::Error::other(e)))?;
                writeln!(w, "{line}").map_err(io)?;
                stats.written += 1;
                if !rec.ok() {
                    stats.failed += 1;
                }
                if log_every > 0 && stats.written % log_every == 0 {
                    tracing::info!(written = stats.written, failed = stats.failed, "progress");
                }
            }
            w.flush().map_err(io)?;
            Ok(stats)
        });
        Ok(Self { tx, handle })
    }

    /// A sender for request tasks.
    pub fn sender(&self) -> mpsc::Sender<RequestRecord> {
        self.tx.clone()
    }

    /// Drops this sink's sender and waits for the writer to drain (every other sender must be
    /// dropped too, i.e. all request tasks finished).
    pub async fn close(self) -> Result<SinkStats, SinkError> {
        drop(self.tx);
        self.handle.await.map_err(|e| SinkError::Join(e.to_string()))?
    }
}
