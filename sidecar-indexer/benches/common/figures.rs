//! Machine-readable bench figures: besides the printed `FIGURE` lines, each figure is appended as
//! one JSON line to the file `$KVMESH_BENCH_FIGURES` names (`make bench` feeds them to the report).

use std::io::Write as _;

/// Environment variable naming a file to append each figure to as one JSON line.
pub const FIGURES_ENV: &str = "KVMESH_BENCH_FIGURES";

/// Appends `figure` to `$KVMESH_BENCH_FIGURES`, when set (the printed lines are unchanged).
pub fn emit(figure: serde_json::Value) {
    let Some(path) = std::env::var_os(FIGURES_ENV) else { return };
    let appended = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&path)
        .and_then(|mut f| writeln!(f, "{figure}"));
    if let Err(e) = appended {
        eprintln!("{FIGURES_ENV}: cannot append to {}: {e}", std::path::Path::new(&path).display());
    }
}
