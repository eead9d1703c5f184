//! The pure parts of the soak: the churn schedule, the request tally, reading memory out of
//! `/proc` text, the least-squares slope and the verdict, and the text report.
//!
//! No I/O here (the driver in `main.rs` reads `/proc`, talks to the stack and passes text and
//! times in), so each rule is unit-tested on fixed inputs.
//!
//! Over 600 lines with its tests (the code is ~400): the rules and their fixed-input tests stay
//! in one file while the soak gains a feature in parallel work; the tests move to `plan/tests.rs`
//! once that lands.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// Bytes in a MiB.
pub const MIB: f64 = 1024.0 * 1024.0;
/// An inaccessible anonymous mapping at least this large in Envoy's address space is V8's
/// reservation for a wasm linear memory (its guard region, ~8 GiB per memory on 64-bit): the
/// memory itself is the read-write anonymous mapping right below it, as large as the memory has
/// grown. Envoy's own heap (tcmalloc) and thread stacks are never followed by such a reservation.
pub const V8_RESERVATION_MIN_BYTES: u64 = 1 << 30;

/// One thing the churn driver does at a time into the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Churn {
    /// Rewrite the fleet file without this worker (by index); the indexer reloads it.
    WorkerLeave(usize),
    /// Rewrite the fleet file with this worker back in.
    WorkerJoin(usize),
    /// SIGKILL the indexer and start it again (its index is rebuilt by replay).
    IndexerRestart,
}

/// The churn of a run of `duration_s`: every `period_s` a worker leaves or the one that left
/// comes back (cycling over `workers`, never more than one out), and the indexer restarts at
/// each of `restart_fractions` of the run. Sorted by time; nothing in the last period, so the
/// run ends with the whole fleet in.
pub fn schedule(
    duration_s: f64,
    period_s: f64,
    workers: usize,
    restart_fractions: &[f64],
) -> Vec<(f64, Churn)> {
    let mut out = Vec::new();
    if period_s > 0.0 && workers > 1 {
        let mut t = period_s;
        let mut k = 0usize;
        while t + period_s <= duration_s {
            let w = (k / 2) % workers;
            out.push((
                t,
                if k.is_multiple_of(2) { Churn::WorkerLeave(w) } else { Churn::WorkerJoin(w) },
            ));
            k += 1;
            t += period_s;
        }
        // A leave whose join fell past the end: drop it, the fleet ends whole.
        if let Some((_, Churn::WorkerLeave(_))) = out.last() {
            out.pop();
        }
    }
    for f in restart_fractions {
        if (0.0..1.0).contains(f) {
            out.push((duration_s * f, Churn::IndexerRestart));
        }
    }
    out.sort_by(|a, b| a.0.total_cmp(&b.0));
    out
}

/// When the samples fall: the first at 0, the rest every `sample_s` from half a churn period
/// in, so that with `sample_s` = `churn_s` (the default) each sample lands midway between two
/// churn steps rather than in the second a step runs (steps fall on multiples of `churn_s`).
pub fn sample_offset_s(sample_s: f64, churn_s: f64) -> f64 {
    if sample_s <= 0.0 || churn_s <= 0.0 {
        return 0.0;
    }
    (churn_s / 2.0) % sample_s
}

/// The time of sample `k` (see [`sample_offset_s`]).
pub fn sample_time_s(k: u64, sample_s: f64, offset_s: f64) -> f64 {
    match k {
        0 => 0.0,
        _ if offset_s > 0.0 => offset_s + (k - 1) as f64 * sample_s,
        _ => k as f64 * sample_s,
    }
}

/// Whether a sample can judge the index's size: every worker of the fleet was listed and the last
/// churn step ended at least `settle_s` before it (a join's replay or a leave's removal has
/// landed). The index's counts are the fleet's cache contents, so only samples taken over the
/// same fleet, settled, are comparable; a sample in the middle of churn sees a step half-applied.
pub fn index_settled(listed: usize, fleet: usize, since_churn_s: f64, settle_s: f64) -> bool {
    listed == fleet && since_churn_s >= settle_s
}

/// The points of `points` taken at one of `times` (the settled samples' times, as recorded).
pub fn at_times(points: &[(f64, f64)], times: &[f64]) -> Vec<(f64, f64)> {
    points.iter().copied().filter(|p| times.contains(&p.0)).collect()
}

/// How one request ended, as the load generator saw it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// An HTTP answer with this status, body read to the end.
    Status(u16),
    /// A stream we dropped on purpose after its first chunk (an aborted client).
    AbortedByUs,
    /// No HTTP answer: connect error, reset, timeout.
    Transport,
}

/// Every request of the run, by outcome.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Tally {
    /// Answers by status code.
    pub by_status: BTreeMap<u16, u64>,
    /// Streams aborted by the load generator (counted apart).
    pub aborted_by_us: u64,
    /// Requests without an HTTP answer.
    pub transport_errors: u64,
}

impl Tally {
    pub fn add(&mut self, o: Outcome) {
        match o {
            Outcome::Status(s) => *self.by_status.entry(s).or_default() += 1,
            Outcome::AbortedByUs => self.aborted_by_us += 1,
            Outcome::Transport => self.transport_errors += 1,
        }
    }
    /// All requests sent.
    pub fn total(&self) -> u64 {
        self.by_status.values().sum::<u64>() + self.aborted_by_us + self.transport_errors
    }
    /// Requests that were not aborted by us and got no 2xx answer.
    pub fn unanswered(&self) -> u64 {
        self.by_status.iter().filter(|(s, _)| !(200..300).contains(*s)).map(|(_, n)| n).sum::<u64>()
            + self.transport_errors
    }
}

/// `VmRSS` of a `/proc/<pid>/status` text, in bytes.
pub fn status_rss_bytes(status: &str) -> Option<u64> {
    kib_field_bytes(status, "VmRSS")
}

/// A `Key:   N kB` field of a `/proc` text (`status`, `smaps_rollup`), in bytes.
pub fn kib_field_bytes(text: &str, key: &str) -> Option<u64> {
    let line =
        text.lines().find(|l| l.strip_prefix(key).is_some_and(|rest| rest.starts_with(':')))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resident bytes of a `/proc/<pid>/smaps_rollup` text split into anonymous memory (the heap,
/// thread stacks: what an allocator holds) and the rest (file-backed: the binary's pages, shared
/// libraries): `(anon, file)`.
pub fn rollup_anon_file_bytes(rollup: &str) -> Option<(u64, u64)> {
    let rss = kib_field_bytes(rollup, "Rss")?;
    let anon = kib_field_bytes(rollup, "Anonymous")?;
    Some((anon, rss.saturating_sub(anon)))
}

/// The wasm linear memories in a `/proc/<pid>/smaps` text (see [`V8_RESERVATION_MIN_BYTES`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WasmMemories {
    /// Resident bytes of the memories.
    pub rss: u64,
    /// Their committed size (the linear memories' sizes).
    pub size: u64,
    /// How many (one per VM: main thread, each worker thread).
    pub count: usize,
}

/// Finds each anonymous `rw-p` mapping directly followed by an anonymous `---p` mapping of at
/// least `min_guard` bytes.
pub fn wasm_memories(smaps: &str, min_guard: u64) -> WasmMemories {
    // (lo, hi, perms, anonymous, rss bytes)
    let mut maps: Vec<(u64, u64, String, bool, u64)> = Vec::new();
    for line in smaps.lines() {
        let mut parts = line.split_whitespace();
        let Some(first) = parts.next() else { continue };
        if first == "Rss:" {
            if let (Some(m), Some(kb)) =
                (maps.last_mut(), parts.next().and_then(|v| v.parse::<u64>().ok()))
            {
                m.4 = kb * 1024;
            }
            continue;
        }
        let Some((lo, hi)) = first.split_once('-') else {
            continue;
        };
        let (Ok(lo), Ok(hi)) = (u64::from_str_radix(lo, 16), u64::from_str_radix(hi, 16)) else {
            continue;
        };
        let perms = parts.next().unwrap_or_default().to_owned();
        let anonymous = parts.nth(3).is_none();
        maps.push((lo, hi, perms, anonymous, 0));
    }
    let mut out = WasmMemories::default();
    for pair in maps.windows(2) {
        let (mem, guard) = (&pair[0], &pair[1]);
        if mem.3
            && guard.3
            && mem.2 == "rw-p"
            && guard.2 == "---p"
            && guard.0 == mem.1
            && guard.1.saturating_sub(guard.0) >= min_guard
        {
            out.rss += mem.4;
            out.size += mem.1 - mem.0;
            out.count += 1;
        }
    }
    out
}

/// Least-squares slope of `y` over `x`; `None` with fewer than two distinct `x`.
pub fn slope(points: &[(f64, f64)]) -> Option<f64> {
    let n = points.len() as f64;
    if points.len() < 2 {
        return None;
    }
    let mx = points.iter().map(|p| p.0).sum::<f64>() / n;
    let my = points.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = points.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if sxx <= 0.0 {
        return None;
    }
    let sxy: f64 = points.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    Some(sxy / sxx)
}

/// What the verdict holds a series' post-warm-up slope to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Bound {
    /// Bytes: at most this many MiB per 10 minutes.
    MibPer10Min(f64),
    /// A count: at most this fraction of the window's mean per 10 minutes (plus `floor` units).
    RelativePer10Min { fraction: f64, floor: f64 },
}

/// One sampled series (memory in bytes or a gauge), `(seconds into the run, value)`.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
    pub bound: Bound,
    /// Fit from this time on (after warm-up; for the indexer's series, after warm-up of its last
    /// lifetime).
    pub fit_from_s: f64,
}

/// A series' figures and verdict.
#[derive(Debug, Clone, PartialEq)]
pub struct Fit {
    pub name: String,
    pub start: f64,
    pub end: f64,
    pub max: f64,
    /// Slope per 10 minutes over the fitted window (`None`: too few samples).
    pub slope_per_10min: Option<f64>,
    pub samples_fitted: usize,
    /// The bound the slope was held to, in the series' unit per 10 min.
    pub allowed_per_10min: f64,
    pub pass: bool,
}

/// Fits `s` and judges it. A window with fewer than 3 samples passes nothing: it fails, so a run
/// too short to tell says so.
pub fn fit(s: &Series) -> Fit {
    let window: Vec<(f64, f64)> =
        s.points.iter().copied().filter(|p| p.0 >= s.fit_from_s).collect();
    let slope10 = if window.len() >= 3 { slope(&window).map(|v| v * 600.0) } else { None };
    let mean = if window.is_empty() {
        0.0
    } else {
        window.iter().map(|p| p.1).sum::<f64>() / window.len() as f64
    };
    let allowed = match s.bound {
        Bound::MibPer10Min(m) => m * MIB,
        Bound::RelativePer10Min { fraction, floor } => fraction * mean + floor,
    };
    Fit {
        name: s.name.clone(),
        start: s.points.first().map_or(0.0, |p| p.1),
        end: s.points.last().map_or(0.0, |p| p.1),
        max: s.points.iter().map(|p| p.1).fold(0.0, f64::max),
        slope_per_10min: slope10,
        samples_fitted: window.len(),
        allowed_per_10min: allowed,
        pass: slope10.is_some_and(|v| v <= allowed),
    }
}

/// The whole run's figures.
#[derive(Debug, Clone, PartialEq)]
pub struct Summary {
    pub minutes: f64,
    pub sample_s: f64,
    pub warmup_fraction: f64,
    pub fits: Vec<Fit>,
    pub tally: Tally,
    /// Processes found dead that we did not kill, and wasm VM reloads (traps).
    pub crashes: Vec<String>,
    pub churn_done: Vec<(f64, String)>,
    /// Churn steps that failed (e.g. a reload not seen in time).
    pub churn_failed: Vec<String>,
}

impl Summary {
    pub fn pass(&self) -> bool {
        self.fits.iter().all(|f| f.pass)
            && self.crashes.is_empty()
            && self.tally.unanswered() == 0
            && self.churn_failed.is_empty()
    }
}

fn show(v: f64, bytes: bool) -> String {
    if bytes {
        format!("{:.1} MiB", v / MIB)
    } else {
        format!("{v:.0}")
    }
}

/// The text report.
pub fn render(s: &Summary, is_bytes: impl Fn(&str) -> bool) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# kvmesh soak: {}", if s.pass() { "PASS" } else { "FAIL" });
    let _ = writeln!(
        o,
        "\n{:.1} min, a sample every {:.0} s; slopes are least squares over the samples after the first {:.0} % of the run (indexer series: of its last lifetime).",
        s.minutes,
        s.sample_s,
        s.warmup_fraction * 100.0
    );
    let _ = writeln!(o, "\n| series | start | end | max | slope / 10 min | bound / 10 min | samples | verdict |\n|---|---|---|---|---|---|---|---|");
    for f in &s.fits {
        let b = is_bytes(&f.name);
        let slope = f.slope_per_10min.map_or_else(
            || "n/a (too few samples)".to_owned(),
            |v| {
                if b {
                    format!("{:+.3} MiB", v / MIB)
                } else {
                    format!("{v:+.1}")
                }
            },
        );
        let _ = writeln!(
            o,
            "| {} | {} | {} | {} | {} | {} | {} | {} |",
            f.name,
            show(f.start, b),
            show(f.end, b),
            show(f.max, b),
            slope,
            if b {
                format!("{:.3} MiB", f.allowed_per_10min / MIB)
            } else {
                format!("{:.1}", f.allowed_per_10min)
            },
            f.samples_fitted,
            if f.pass { "flat" } else { "FAIL" }
        );
    }
    let t = &s.tally;
    let statuses: Vec<String> = t.by_status.iter().map(|(k, v)| format!("{k}: {v}")).collect();
    let _ = writeln!(
        o,
        "\nRequests: {} sent; answers by status {{{}}}; aborted by us (stream dropped after the first chunk): {}; transport errors: {}; unanswered (non-2xx or none, excluding ours): {}.",
        t.total(),
        statuses.join(", "),
        t.aborted_by_us,
        t.transport_errors,
        t.unanswered()
    );
    let _ = writeln!(
        o,
        "\nCrashes: {}{}",
        s.crashes.len(),
        if s.crashes.is_empty() { String::new() } else { format!(" ({})", s.crashes.join("; ")) }
    );
    let _ =
        writeln!(o, "\nChurn: {} steps done, {} failed.", s.churn_done.len(), s.churn_failed.len());
    for (t, what) in &s.churn_done {
        let _ = writeln!(o, "- {:>6.1} min {what}", t / 60.0);
    }
    for f in &s.churn_failed {
        let _ = writeln!(o, "- FAILED: {f}");
    }
    o
}

/// What the body bases did over a run (counters read at its end).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct BodyBases {
    /// The filter's route calls that sent the whole body, only the bytes after a base, or the
    /// whole body again after a `409`.
    pub whole: f64,
    pub delta: f64,
    pub resent: f64,
    /// The indexer's memo reads since its last restart: continued from a held body, read whole,
    /// a named base no longer held.
    pub memo_hit: f64,
    pub memo_miss: f64,
    pub base_unknown: f64,
}

/// The report's body-base section: the counters and the body memo's memory (last and peak of the
/// `body_memo_bytes` samples).
pub fn render_body_bases(b: &BodyBases, memo: Option<&Vec<(f64, f64)>>) -> String {
    let calls = b.whole + b.delta + b.resent;
    let share = if calls > 0.0 { 100.0 * b.delta / calls } else { 0.0 };
    let mut out = format!(
        "\nBody bases: {calls:.0} route calls, {:.0} sent only the bytes after a body base ({share:.1} %), {:.0} the whole body, {:.0} resent whole after a 409; the indexer's body memo (since its last restart): {:.0} continued, {:.0} read whole, {:.0} bases unknown.",
        b.delta, b.whole, b.resent, b.memo_hit, b.memo_miss, b.base_unknown
    );
    match memo.filter(|pts| !pts.is_empty()) {
        Some(pts) => {
            let last = pts.last().map_or(0.0, |p| p.1);
            let peak = pts.iter().map(|p| p.1).fold(0.0, f64::max);
            let _ = write!(
                out,
                " Body memo memory (`kvmesh_body_memo_bytes`): {:.2} MiB at the end, {:.2} MiB peak.",
                last / MIB,
                peak / MIB
            );
        }
        None => out.push_str(" Body memo memory: not sampled."),
    }
    out.push('\n');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_alternates_leave_and_join_and_ends_whole() {
        let s = schedule(300.0, 60.0, 3, &[0.5]);
        assert_eq!(
            s,
            vec![
                (60.0, Churn::WorkerLeave(0)),
                (120.0, Churn::WorkerJoin(0)),
                (150.0, Churn::IndexerRestart),
                (180.0, Churn::WorkerLeave(1)),
                (240.0, Churn::WorkerJoin(1)),
            ]
        );
        // An odd number of slots: the trailing leave is dropped.
        let s = schedule(240.0, 60.0, 3, &[]);
        assert_eq!(s, vec![(60.0, Churn::WorkerLeave(0)), (120.0, Churn::WorkerJoin(0))]);
        // Fractions outside [0, 1) and one worker only: no churn of that kind.
        assert_eq!(schedule(300.0, 60.0, 1, &[1.0, -0.1]), vec![]);
    }

    #[test]
    fn samples_fall_midway_between_churn_steps() {
        // (sample_s, churn_s, expected offset, expected times of samples 0..4)
        let cases: &[(f64, f64, f64, [f64; 4])] = &[
            (60.0, 60.0, 30.0, [0.0, 30.0, 90.0, 150.0]),
            (10.0, 60.0, 0.0, [0.0, 10.0, 20.0, 30.0]),
            (60.0, 40.0, 20.0, [0.0, 20.0, 80.0, 140.0]),
            (120.0, 60.0, 30.0, [0.0, 30.0, 150.0, 270.0]),
            (20.0, 0.0, 0.0, [0.0, 20.0, 40.0, 60.0]),
        ];
        for &(sample_s, churn_s, offset, times) in cases {
            let o = sample_offset_s(sample_s, churn_s);
            assert_eq!(o, offset, "{sample_s} {churn_s}");
            let got: Vec<f64> = (0..4).map(|k| sample_time_s(k, sample_s, o)).collect();
            assert_eq!(got, times, "{sample_s} {churn_s}");
            // Sampling every whole number of churn periods: no sample after the first
            // coincides with a churn step.
            if churn_s > 0.0 && sample_s % churn_s == 0.0 {
                assert!(got[1..].iter().all(|t| t % churn_s != 0.0), "{got:?}");
            }
        }
    }

    #[test]
    fn index_is_judged_on_whole_settled_fleets_only() {
        // (listed, fleet, seconds since the last churn step, settle, verdict)
        let cases = [
            (4, 4, 30.0, 20.0, true),
            (4, 4, 20.0, 20.0, true),
            (4, 4, 5.0, 20.0, false),
            (3, 4, 30.0, 20.0, false),
            (3, 4, 1e9, 20.0, false),
        ];
        for (listed, fleet, since, settle, want) in cases {
            assert_eq!(
                index_settled(listed, fleet, since, settle),
                want,
                "{listed}/{fleet} {since}"
            );
        }
        let pts = [(0.0, 1.0), (30.0, 2.0), (90.0, 3.0), (150.0, 4.0)];
        assert_eq!(at_times(&pts, &[30.0, 150.0]), vec![(30.0, 2.0), (150.0, 4.0)]);
        assert_eq!(at_times(&pts, &[]), vec![]);
    }

    #[test]
    fn tally_counts_aborted_apart() {
        let mut t = Tally::default();
        for o in [
            Outcome::Status(200),
            Outcome::Status(200),
            Outcome::Status(503),
            Outcome::AbortedByUs,
            Outcome::Transport,
        ] {
            t.add(o);
        }
        assert_eq!((t.total(), t.unanswered(), t.aborted_by_us), (5, 2, 1));
    }

    #[test]
    fn reads_vmrss_and_large_anonymous_mappings() {
        assert_eq!(status_rss_bytes("Name:\tenvoy\nVmRSS:\t  123456 kB\n"), Some(123456 * 1024));
        assert_eq!(status_rss_bytes("Name:\tenvoy\n"), None);
        // A thread stack (8 MiB), then a wasm memory (1 MiB) and its guard, a file mapping, a
        // second memory, and a large reservation with nothing committed below it.
        let smaps = "\
55d0-55e0 r-xp 00000000 08:01 42 /usr/bin/envoy
Size:                 64 kB
Rss:                  60 kB
7f0000000000-7f0000800000 rw-p 00000000 00:00 0
Size:               8192 kB
Rss:                  20 kB
7f0000800000-7f0000900000 rw-p 00000000 00:00 0
Size:               1024 kB
Rss:                  96 kB
7f0000900000-7f0200800000 ---p 00000000 00:00 0
Size:            8387584 kB
Rss:                   0 kB
7f0300000000-7f0300100000 rw-p 00000000 08:01 7 /tmp/file
Size:               1024 kB
Rss:                1000 kB
7f0300100000-7f0500100000 ---p 00000000 00:00 0
Size:            8388608 kB
Rss:                   0 kB
7f0600000000-7f0600200000 rw-p 00000000 00:00 0
Size:               2048 kB
Rss:                 512 kB
7f0600200000-7f0800200000 ---p 00000000 00:00 0
Size:            8388608 kB
Rss:                   0 kB
7f0900000000-7f0b00000000 ---p 00000000 00:00 0
Size:            8388608 kB
Rss:                   0 kB
";
        assert_eq!(
            wasm_memories(smaps, V8_RESERVATION_MIN_BYTES),
            WasmMemories { rss: (96 + 512) * 1024, size: 3 * 1024 * 1024, count: 2 }
        );
    }

    #[test]
    fn smaps_rollup_splits_anonymous_from_file_backed() {
        let rollup = "55d0c0a00000-7ffd1c1fe000 ---p 00000000 00:00 0    [rollup]\n\
                      Rss:              102400 kB\nPss:               90000 kB\n\
                      Pss_Anon:          70000 kB\nAnonymous:         71680 kB\nSwap: 0 kB\n";
        assert_eq!(rollup_anon_file_bytes(rollup), Some((71680 * 1024, 30720 * 1024)));
        // The key `Rss` does not match `RssAnon`; a missing field is None.
        assert_eq!(kib_field_bytes("RssAnon:\t 5 kB\nRss:\t 7 kB\n", "Rss"), Some(7 * 1024));
        assert_eq!(rollup_anon_file_bytes("Rss: 7 kB\n"), None);
    }

    #[test]
    fn slope_is_least_squares() {
        assert_eq!(slope(&[(0.0, 1.0), (1.0, 3.0), (2.0, 5.0)]), Some(2.0));
        assert_eq!(
            slope(&[(0.0, 0.0), (1.0, 1.0), (2.0, 0.0), (3.0, 1.0)]).map(|v| (v * 100.0).round()),
            Some(20.0)
        );
        assert_eq!(slope(&[(1.0, 1.0), (1.0, 2.0)]), None);
        assert_eq!(slope(&[(1.0, 1.0)]), None);
    }

    #[test]
    fn fit_judges_only_the_window_after_warmup() {
        // Grows 10 MiB/min during warm-up, then flat with jitter.
        let mut points: Vec<(f64, f64)> =
            (0..3).map(|i| (i as f64 * 60.0, i as f64 * 10.0 * MIB)).collect();
        points.extend(
            (3..10)
                .map(|i| (i as f64 * 60.0, 30.0 * MIB + if i % 2 == 0 { 0.1 * MIB } else { 0.0 })),
        );
        let flat = Series {
            name: "envoy_rss".into(),
            points: points.clone(),
            bound: Bound::MibPer10Min(1.0),
            fit_from_s: 180.0,
        };
        let f = fit(&flat);
        assert!(f.pass, "{f:?}");
        assert_eq!(f.samples_fitted, 7);
        let whole = Series { fit_from_s: 0.0, ..flat };
        assert!(!fit(&whole).pass);
        // A leak of 0.5 MiB/min after warm-up fails the 1 MiB/10 min bound.
        let leak: Vec<(f64, f64)> =
            (0..10).map(|i| (i as f64 * 60.0, 30.0 * MIB + i as f64 * 0.5 * MIB)).collect();
        assert!(
            !fit(&Series {
                name: "x".into(),
                points: leak,
                bound: Bound::MibPer10Min(1.0),
                fit_from_s: 120.0
            })
            .pass
        );
        // Too few samples: not a pass.
        let short = Series {
            name: "x".into(),
            points: vec![(0.0, 1.0), (60.0, 1.0)],
            bound: Bound::MibPer10Min(1.0),
            fit_from_s: 0.0,
        };
        assert!(!fit(&short).pass);
    }

    #[test]
    fn relative_bound_scales_with_the_mean() {
        let points: Vec<(f64, f64)> =
            (0..10).map(|i| (i as f64 * 60.0, 1000.0 + i as f64)).collect();
        // +10 per 10 min on a mean ~1005: within 5 % (+0 floor).
        let s = Series {
            name: "entries".into(),
            points,
            bound: Bound::RelativePer10Min { fraction: 0.05, floor: 0.0 },
            fit_from_s: 0.0,
        };
        assert!(fit(&s).pass);
        let s = Series { bound: Bound::RelativePer10Min { fraction: 0.005, floor: 0.0 }, ..s };
        assert!(!fit(&s).pass);
    }

    #[test]
    fn summary_fails_on_any_unanswered_request_or_crash() {
        let ok = Fit {
            name: "a".into(),
            start: 0.0,
            end: 0.0,
            max: 0.0,
            slope_per_10min: Some(0.0),
            samples_fitted: 5,
            allowed_per_10min: 1.0,
            pass: true,
        };
        let mut s = Summary {
            minutes: 1.0,
            sample_s: 10.0,
            warmup_fraction: 0.2,
            fits: vec![ok],
            tally: Tally::default(),
            crashes: vec![],
            churn_done: vec![],
            churn_failed: vec![],
        };
        s.tally.add(Outcome::Status(200));
        s.tally.add(Outcome::AbortedByUs);
        assert!(s.pass());
        let text = render(&s, |_| true);
        assert!(text.starts_with("# kvmesh soak: PASS"), "{text}");
        s.tally.add(Outcome::Status(502));
        assert!(!s.pass());
        s.tally = Tally::default();
        s.crashes.push("envoy exited".into());
        assert!(!s.pass());
        assert!(render(&s, |_| true).contains("Crashes: 1 (envoy exited)"));
    }

    #[test]
    fn the_body_base_section_gives_the_delta_share_and_the_memo_memory() {
        let b = BodyBases {
            whole: 30.0,
            delta: 60.0,
            resent: 10.0,
            memo_hit: 55.0,
            memo_miss: 40.0,
            base_unknown: 10.0,
        };
        let memo = vec![(0.0, 0.0), (60.0, 2.5 * MIB), (120.0, 2.0 * MIB)];
        let text = render_body_bases(&b, Some(&memo));
        assert!(
            text.contains("100 route calls, 60 sent only the bytes after a body base (60.0 %)"),
            "{text}"
        );
        assert!(text.contains("10 resent whole after a 409"), "{text}");
        assert!(text.contains("2.00 MiB at the end, 2.50 MiB peak"), "{text}");
        assert!(render_body_bases(&BodyBases::default(), None).contains("not sampled"));
    }
}
