//! A short fuzz run of every target (part of `make test`), and every regression input replayed.
//! Cases per target: `KVMESH_FUZZ_CASES` (default 4000); the RNG seed is fixed so CI is repeatable
//! (`make fuzz` explores with fresh seeds for longer).

// Fuzz targets report a broken property by panicking (the engines catch it); the production
// lints against panics do not apply to this test tooling.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use kvmesh_fuzz::{regressions_dir, replay, run, Budget, TARGETS};

fn cases() -> u32 {
    std::env::var("KVMESH_FUZZ_CASES").ok().and_then(|v| v.parse().ok()).unwrap_or(4000)
}

#[test]
fn every_target_survives_a_short_run() {
    let mut failures = Vec::new();
    for t in TARGETS {
        let out = run(t, Budget::Cases(cases()), 15);
        eprintln!("{:<16} {} executions", t.name, out.executions);
        if let Some((reason, input)) = out.failure {
            failures.push(format!(
                "{}: {reason}\n  input {:?}",
                t.name,
                String::from_utf8_lossy(&input)
            ));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn every_seed_runs_clean() {
    for t in TARGETS {
        let seeds = (t.seeds)();
        assert!(!seeds.is_empty(), "{} has no seeds", t.name);
        for (i, s) in seeds.iter().enumerate() {
            replay(t, s).unwrap_or_else(|e| panic!("{} seed {i}: {e}", t.name));
        }
    }
}

#[test]
fn every_regression_input_runs_clean() {
    for t in TARGETS {
        let Ok(dir) = std::fs::read_dir(regressions_dir(t.name)) else { continue };
        for entry in dir.flatten() {
            let input = std::fs::read(entry.path()).unwrap();
            replay(t, &input)
                .unwrap_or_else(|e| panic!("{} {}: {e}", t.name, entry.path().display()));
        }
    }
}
