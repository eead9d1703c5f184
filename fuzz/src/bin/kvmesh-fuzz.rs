//! `kvmesh-fuzz [--seconds N] [--cases N] [--seed N] [target…]`: runs each fuzz target (all by
//! default) for a time or case budget with the proptest engine, prints executions per target, and
//! writes a failing input (shrunk) to `fuzz/regressions/<target>/` (exit 1). `make fuzz` calls it.
//! `--write-corpus DIR` writes every target's seeds to `DIR/<target>/` (libFuzzer's start corpus).

// Fuzz targets report a broken property by panicking (the engines catch it); the production
// lints against panics do not apply to this test tooling.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use kvmesh_fuzz::{regressions_dir, run, Budget, TARGETS};

fn main() -> anyhow::Result<()> {
    let mut budget = Budget::Time(Duration::from_secs(60));
    let mut seed: u64 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let mut names = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let mut value = || {
            args.next()
                .context("missing value")
                .and_then(|v| v.parse::<u64>().context("not a number"))
        };
        match a.as_str() {
            "--seconds" => budget = Budget::Time(Duration::from_secs(value()?)),
            "--cases" => budget = Budget::Cases(u32::try_from(value()?)?),
            "--seed" => seed = value()?,
            "--write-corpus" => {
                let dir = std::path::PathBuf::from(args.next().context("missing directory")?);
                for t in TARGETS {
                    let d = dir.join(t.name);
                    std::fs::create_dir_all(&d)?;
                    for (i, seed) in (t.seeds)().iter().enumerate() {
                        std::fs::write(d.join(format!("seed-{i}")), seed)?;
                    }
                }
                return Ok(());
            }
            "--list" => {
                for t in TARGETS {
                    println!("{}", t.name);
                }
                return Ok(());
            }
            name => names.push(name.to_owned()),
        }
    }
    let chosen: Vec<_> =
        TARGETS.iter().filter(|t| names.is_empty() || names.iter().any(|n| n == t.name)).collect();
    if chosen.is_empty() {
        bail!("no such target: {names:?} (--list)");
    }
    // Targets panic on purpose when they find something; proptest reports the shrunk case.
    std::panic::set_hook(Box::new(|_| {}));
    let mut failed = 0;
    println!("kvmesh-fuzz: seed {seed}, budget {budget:?} per target");
    for t in chosen {
        let started = Instant::now();
        let out = run(t, budget, seed);
        let secs = started.elapsed().as_secs_f64();
        match &out.failure {
            None => println!(
                "{:<16} {:>10} executions in {secs:>6.1} s ({:.0}/s), no failure",
                t.name,
                out.executions,
                out.executions as f64 / secs.max(1e-9)
            ),
            Some((reason, input)) => {
                failed += 1;
                let dir = regressions_dir(t.name);
                std::fs::create_dir_all(&dir)?;
                let path = dir.join(format!("crash-{seed}-{:016x}", fnv(input)));
                std::fs::write(&path, input)?;
                println!("{:<16} FAILED after {} executions: {reason}\n  input ({} bytes) written to {}\n  {:?}", t.name, out.executions, input.len(), path.display(), String::from_utf8_lossy(input));
            }
        }
    }
    if failed > 0 {
        bail!("{failed} target(s) failed");
    }
    Ok(())
}

/// A short stable name for an input.
fn fnv(bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}
