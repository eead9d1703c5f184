//! kvmesh-fuzz: fuzz targets for every parser of outside bytes, and a proptest-driven runner.
//!
//! The targets ([`targets`]) are plain `fn(&[u8])`, so two engines drive them: proptest (stable
//! toolchain, in `make test` for a fixed number of cases and in `make fuzz` for a time budget), and
//! libFuzzer through cargo-fuzz (`fuzz_targets/`, coverage-guided, `make fuzz FUZZ_ENGINE=libfuzzer`
//! with `RUSTC_BOOTSTRAP=1` on the stable toolchain). The proptest inputs are the real fixtures and
//! shipped files ([`seeds`]) mutated by a few byte-level operators (flips, inserts, deletions,
//! duplications, interesting values, truncation, splicing two seeds), plus arbitrary bytes; a
//! failure is shrunk to a small input, printed, and (by the runner binary) written to
//! `fuzz/regressions/<target>/`, which every test run replays.

// Fuzz targets report a broken property by panicking (the engines catch it); the production
// lints against panics do not apply to this test tooling.
#![allow(clippy::panic, clippy::unwrap_used, clippy::expect_used)]

pub mod seeds;
pub mod targets;

use std::time::{Duration, Instant};

use proptest::prelude::*;
use proptest::test_runner::{Config, RngAlgorithm, TestCaseError, TestError, TestRng, TestRunner};

/// One fuzz target: its name (also the cargo-fuzz target's), the function, its seed corpus.
pub struct Target {
    pub name: &'static str,
    pub run: fn(&[u8]),
    pub seeds: fn() -> Vec<Vec<u8>>,
}

/// Every target.
pub const TARGETS: &[Target] = &[
    Target { name: "kv_batch", run: targets::kv_batch, seeds: seeds::kv_batches },
    Target { name: "kv_frames", run: targets::kv_frames, seeds: seeds::kv_frames },
    Target { name: "filter_request", run: targets::filter_request, seeds: seeds::filter_requests },
    Target { name: "filter_splice", run: targets::filter_splice, seeds: seeds::splice_bodies },
    Target { name: "route_request", run: targets::route_request, seeds: seeds::route_bodies },
    Target { name: "engine_metrics", run: targets::engine_metrics, seeds: seeds::engine_metrics },
    Target { name: "fleet_file", run: targets::fleet_file, seeds: seeds::fleet_files },
    Target { name: "filter_config", run: targets::filter_config, seeds: seeds::filter_configs },
];

/// Bytes that matter to msgpack, JSON, TOML/YAML and Prometheus text.
const INTERESTING: &[&[u8]] = &[
    &[0x00],
    &[0xff],
    &[0x7f],
    &[0x80],
    &[0xc0],
    &[0xc1],
    &[0xdd, 0xff, 0xff, 0xff, 0xff],
    &[0xdf, 0xff, 0xff, 0xff, 0xff],
    &[0xcf, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff],
    &[0xd3, 0x80, 0, 0, 0, 0, 0, 0, 0],
    &[0xc6, 0x7f, 0xff, 0xff, 0xff],
    &[0x91; 16],
    b"\"",
    b"\\",
    b"\\u0000",
    b"\\ud800",
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"1e999",
    b"-0",
    b"null",
    b"\n",
    b"=",
    b"#",
    b"NaN",
    b"+Inf",
    b"\xf0\x9f\x98\x80",
    b"\xed\xa0\x80",
];

/// One byte-level edit of an input.
#[derive(Debug, Clone)]
enum Mutation {
    Flip(usize, u8),
    Insert(usize, u8),
    Remove(usize, usize),
    Duplicate(usize, usize, usize),
    Interesting(usize, usize),
    Truncate(usize),
    Splice(usize, usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (any::<usize>(), any::<u8>()).prop_map(|(a, b)| Mutation::Flip(a, b)),
        (any::<usize>(), any::<u8>()).prop_map(|(a, b)| Mutation::Insert(a, b)),
        (any::<usize>(), 1usize..16).prop_map(|(a, n)| Mutation::Remove(a, n)),
        (any::<usize>(), 1usize..32, any::<usize>())
            .prop_map(|(a, n, at)| Mutation::Duplicate(a, n, at)),
        (any::<usize>(), any::<usize>()).prop_map(|(a, i)| Mutation::Interesting(a, i)),
        any::<usize>().prop_map(Mutation::Truncate),
        (any::<usize>(), any::<usize>(), any::<usize>())
            .prop_map(|(s, from, at)| Mutation::Splice(s, from, at)),
    ]
}

fn apply(mut v: Vec<u8>, m: &Mutation, seeds: &[Vec<u8>]) -> Vec<u8> {
    let at = |i: usize, len: usize| if len == 0 { 0 } else { i % (len + 1) };
    match *m {
        Mutation::Flip(i, b) if !v.is_empty() => {
            let n = v.len();
            v[i % n] ^= b | 1;
        }
        Mutation::Insert(i, b) => {
            let i = at(i, v.len());
            v.insert(i, b);
        }
        Mutation::Remove(i, n) if !v.is_empty() => {
            let i = i % v.len();
            let end = (i + n).min(v.len());
            v.drain(i..end);
        }
        Mutation::Duplicate(i, n, to) if !v.is_empty() => {
            let i = i % v.len();
            let piece: Vec<u8> = v[i..(i + n).min(v.len())].to_vec();
            let to = at(to, v.len());
            v.splice(to..to, piece);
        }
        Mutation::Interesting(i, which) => {
            let piece = INTERESTING[which % INTERESTING.len()];
            let i = at(i, v.len());
            v.splice(i..i, piece.iter().copied());
        }
        Mutation::Truncate(i) => {
            let i = at(i, v.len());
            v.truncate(i);
        }
        Mutation::Splice(s, from, to) if !seeds.is_empty() => {
            let other = &seeds[s % seeds.len()];
            let from = at(from, other.len()).min(other.len());
            let to = at(to, v.len()).min(v.len());
            v.truncate(to);
            v.extend_from_slice(&other[from..]);
        }
        _ => {}
    }
    v
}

/// Inputs for a target: mostly mutated seeds, some unmutated, some arbitrary bytes.
pub fn inputs(seeds: Vec<Vec<u8>>) -> BoxedStrategy<Vec<u8>> {
    let arbitrary = proptest::collection::vec(any::<u8>(), 0..512);
    if seeds.is_empty() {
        return arbitrary.boxed();
    }
    let n = seeds.len();
    let for_splice = seeds.clone();
    let mutated = (0..n, proptest::collection::vec(mutation(), 0..8)).prop_map(move |(i, ms)| {
        ms.iter().fold(for_splice[i].clone(), |v, m| apply(v, m, &for_splice))
    });
    prop_oneof![1 => arbitrary, 1 => proptest::sample::select(seeds), 8 => mutated].boxed()
}

/// How long a run lasts.
#[derive(Debug, Clone, Copy)]
pub enum Budget {
    Cases(u32),
    Time(Duration),
}

/// What a run did: executions, and the shrunk failing input if a case failed.
#[derive(Debug)]
pub struct Outcome {
    pub executions: u64,
    pub failure: Option<(String, Vec<u8>)>,
}

/// Runs `target` on generated inputs within `budget`, from RNG seed `seed` (runs are repeatable).
/// Panics in the target are failures (proptest catches them and shrinks the input).
pub fn run(target: &Target, budget: Budget, seed: u64) -> Outcome {
    let strategy = inputs((target.seeds)());
    let deadline = match budget {
        Budget::Time(d) => Some(Instant::now() + d),
        Budget::Cases(_) => None,
    };
    let mut executions = 0u64;
    let mut round = 0u64;
    loop {
        let cases = match budget {
            Budget::Cases(n) => n,
            Budget::Time(_) => 2000,
        };
        let config = Config {
            cases,
            failure_persistence: None,
            max_shrink_iters: 4096,
            ..Config::default()
        };
        let mut key = [0u8; 32];
        key[..8].copy_from_slice(&seed.to_le_bytes());
        key[8..16].copy_from_slice(&round.to_le_bytes());
        let mut runner =
            TestRunner::new_with_rng(config, TestRng::from_seed(RngAlgorithm::ChaCha, &key));
        let count = std::cell::Cell::new(0u64);
        let result = runner.run(&strategy, |input| {
            count.set(count.get() + 1);
            (target.run)(&input);
            Ok(())
        });
        executions += count.get();
        match result {
            Ok(()) => {}
            Err(TestError::Fail(reason, input)) => {
                return Outcome { executions, failure: Some((reason.to_string(), input)) }
            }
            Err(TestError::Abort(reason)) => {
                return Outcome {
                    executions,
                    failure: Some((format!("aborted: {reason}"), Vec::new())),
                }
            }
        }
        round += 1;
        match deadline {
            Some(d) if Instant::now() < d => {}
            _ => return Outcome { executions, failure: None },
        }
    }
}

/// Runs `target` once on `input` (a regression file), as a failure or not.
pub fn replay(target: &Target, input: &[u8]) -> Result<(), TestCaseError> {
    std::panic::catch_unwind(|| (target.run)(input)).map_err(|e| {
        let msg = e
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        TestCaseError::fail(msg)
    })
}

/// `fuzz/regressions/<target>/`: inputs that once failed, replayed by every test run.
pub fn regressions_dir(target: &str) -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("regressions").join(target)
}
