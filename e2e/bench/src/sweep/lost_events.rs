//! Lost events (issue 47, point 2), the pure part: one gateway replica's indexer loses part of its
//! event stream mid-point — stalled past the ZMQ high-water mark ([`Fault::Stall`]), or restarted
//! ([`Fault::Restart`]) — and [`recovery`] says, from the point's records, when that replica's
//! hit rate was back and how many hits it lost meanwhile.
//!
//! **The comparison.** Every other replica is the control: it saw the same engines and, under
//! either spread, statistically the same traffic, in the same seconds. A request's hit is the
//! engine's own `cached_tokens` ÷ `prompt_tokens` (usage), token-weighted over a bin of
//! `bin_ms` by send time. **Recovered**: from the fault's end, bins aligned there, the first bin
//! whose faulted-replica hit rate is at least [`RECOVERED_SHARE`] × the control's in the same bin,
//! and the next bin's too (one lucky bin is not a recovery); the recovery time is that bin's start
//! − the fault's end, so 0 means "within the first bin". **Hits lost**: from the fault's start to
//! the recovery (or the window's end, flagged), per bin aligned at the fault's start, the faulted
//! replica's prompt tokens × the control's hit rate − its cached tokens, summed (signed: a bin
//! where it did better gives back).

use crate::record::RequestRecord;
use serde::{Deserialize, Serialize};

/// A bin counts as recovered when the faulted replica's hit rate is at least this share of the
/// control's in the same bin.
pub const RECOVERED_SHARE: f64 = 0.9;

/// What happens to the faulted replica's indexer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Fault {
    /// SIGSTOP for a while, then SIGCONT: its sockets stay open and nothing reads them, so the
    /// engines' PUB sockets queue to their high-water mark and drop the rest for it (a gap the
    /// indexer replays when it runs again).
    Stall,
    /// SIGKILL, then a new process on the same port: its index starts empty and is rebuilt by the
    /// start-up replay (what the engines' replay rings still hold) and orphan recovery.
    Restart,
}

impl Fault {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            Self::Stall => "stall",
            Self::Restart => "restart",
        }
    }

    /// One fault by name.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s.trim() {
            "stall" => Ok(Self::Stall),
            "restart" => Ok(Self::Restart),
            other => Err(format!("unknown --lose-events {other:?} (stall, restart)")),
        }
    }
}

/// When the fault happened, ms on the point's run clock (the records' `sent_ms` clock).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct FaultTimes {
    /// SIGSTOP sent / indexer killed.
    pub start_ms: f64,
    /// SIGCONT sent / the new indexer ready (its start-up replay done).
    pub end_ms: f64,
}

/// One bin's hit rates.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct HitBin {
    /// Bin start, ms on the run clock.
    pub start_ms: f64,
    /// The faulted replica's token-weighted hit rate (`None`: it sent nothing with usage).
    pub faulted: Option<f64>,
    /// The other replicas'.
    pub control: Option<f64>,
    /// The faulted replica's answered requests with usage in the bin.
    pub faulted_requests: usize,
}

/// What a lost-events point measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LostEvents {
    /// `stall` or `restart`.
    pub fault: String,
    /// The faulted replica (0-based).
    pub replica: usize,
    /// When.
    pub times: FaultTimes,
    /// Bin width, ms.
    pub bin_ms: f64,
    /// Before the fault, from the window's start: the faulted replica's and the control's hit
    /// rates (the two should agree; if not, the comparison after is skewed by as much).
    pub before_faulted: Option<f64>,
    pub before_control: Option<f64>,
    /// The first recovered bin's start − the fault's end, s; `None`: not recovered in the window.
    pub recovery_s: Option<f64>,
    /// Hits lost, tokens, from the fault's start to the recovery (or the window's end).
    pub hits_lost_tokens: f64,
    /// The faulted replica's prompt tokens over the same span (what the lost hits are a share of).
    pub span_prompt_tokens: f64,
    /// The faulted replica's requests over the same span.
    pub span_requests: usize,
    /// Bins aligned at the fault's end, up to the window's end (the recovery's evidence).
    pub bins: Vec<HitBin>,
    /// The faulted indexer's own counters over the point (gaps, replays, resyncs, orphan stores
    /// and recoveries; after a restart, since the restart), filled by the caller.
    #[serde(default)]
    pub indexer: Vec<(String, f64)>,
}

impl LostEvents {
    /// Hits lost ÷ the span's prompt tokens.
    pub fn lost_share(&self) -> Option<f64> {
        (self.span_prompt_tokens > 0.0).then(|| self.hits_lost_tokens / self.span_prompt_tokens)
    }
}

/// Token sums of one side of a bin.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    cached: f64,
    prompt: f64,
    requests: usize,
}

impl Sums {
    fn rate(&self) -> Option<f64> {
        (self.prompt > 0.0).then(|| self.cached / self.prompt)
    }
}

/// The `(faulted, control)` sums of the answered requests with usage sent in `[from, to)`.
fn sums(
    records: &[RequestRecord],
    replica_of: &[usize],
    faulted: usize,
    from: f64,
    to: f64,
) -> (Sums, Sums) {
    let (mut f, mut c) = (Sums::default(), Sums::default());
    for (r, &rep) in records.iter().zip(replica_of) {
        let (Some(cached), Some(prompt)) = (r.cached_tokens, r.prompt_tokens) else { continue };
        if !r.ok() || r.sent_ms < from || r.sent_ms >= to {
            continue;
        }
        let side = if rep == faulted { &mut f } else { &mut c };
        side.cached += cached as f64;
        side.prompt += prompt as f64;
        side.requests += 1;
    }
    (f, c)
}

fn recovered(b: &HitBin) -> bool {
    match (b.faulted, b.control) {
        (Some(f), Some(c)) => f >= RECOVERED_SHARE * c,
        _ => false,
    }
}

/// The recovery of replica `faulted` after `times`, from the point's records (`replica_of[i]`:
/// the replica record `i` was sent to), counted over `[window_from_ms, window_to_ms)`.
#[allow(clippy::too_many_arguments)]
pub fn recovery(
    fault: Fault,
    records: &[RequestRecord],
    replica_of: &[usize],
    faulted: usize,
    times: FaultTimes,
    window_from_ms: f64,
    window_to_ms: f64,
    bin_ms: f64,
) -> LostEvents {
    let bin_ms = bin_ms.max(1.0);
    let (bf, bc) = sums(records, replica_of, faulted, window_from_ms, times.start_ms);
    let mut bins = Vec::new();
    let mut start = times.end_ms;
    while start < window_to_ms {
        let (f, c) = sums(records, replica_of, faulted, start, start + bin_ms);
        bins.push(HitBin {
            start_ms: start,
            faulted: f.rate(),
            control: c.rate(),
            faulted_requests: f.requests,
        });
        start += bin_ms;
    }
    // The first recovered bin whose successor (when there is one) is recovered too.
    let at = (0..bins.len())
        .find(|&k| recovered(&bins[k]) && bins.get(k + 1).is_none_or(recovered))
        .map(|k| bins[k].start_ms);
    let span_end = at.unwrap_or(window_to_ms);
    let (mut lost, mut prompt, mut requests) = (0.0, 0.0, 0);
    let mut s = times.start_ms;
    while s < span_end {
        let e = (s + bin_ms).min(span_end);
        let (f, c) = sums(records, replica_of, faulted, s, e);
        // A bin without control requests has no expectation: its requests count, no loss.
        if let Some(expected) = c.rate() {
            lost += f.prompt * expected - f.cached;
        }
        prompt += f.prompt;
        requests += f.requests;
        s = e;
    }
    LostEvents {
        fault: fault.name().into(),
        replica: faulted,
        times,
        bin_ms,
        before_faulted: bf.rate(),
        before_control: bc.rate(),
        recovery_s: at.map(|a| (a - times.end_ms) / 1000.0),
        hits_lost_tokens: lost,
        span_prompt_tokens: prompt,
        span_requests: requests,
        bins,
        indexer: Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(sent_ms: f64, prompt: u64, cached: u64) -> RequestRecord {
        RequestRecord {
            sent_ms,
            status: Some(200),
            prompt_tokens: Some(prompt),
            cached_tokens: Some(cached),
            ..Default::default()
        }
    }

    /// Replica 0 is the control (always 80 % hits); replica 1 hits 80 % before 10 s, nothing
    /// during the fault (10–12 s) and until `back_ms`, 80 % after.
    fn run(back_ms: f64) -> (Vec<RequestRecord>, Vec<usize>) {
        let (mut records, mut replicas) = (Vec::new(), Vec::new());
        let mut t = 0.0;
        while t < 30_000.0 {
            records.push(rec(t, 100, 80));
            replicas.push(0);
            let blind = (10_000.0..back_ms).contains(&t);
            records.push(rec(t + 1.0, 100, if blind { 0 } else { 80 }));
            replicas.push(1);
            t += 250.0;
        }
        (records, replicas)
    }

    #[test]
    fn recovery_is_the_first_bin_back_after_the_fault_and_losses_count_until_then() {
        let (records, replicas) = run(16_000.0);
        let times = FaultTimes { start_ms: 10_000.0, end_ms: 12_000.0 };
        let l = recovery(Fault::Stall, &records, &replicas, 1, times, 0.0, 30_000.0, 2_000.0);
        assert_eq!((l.before_faulted, l.before_control), (Some(0.8), Some(0.8)));
        // Bins from 12 s: 12–14 blind, 14–16 blind, 16–18 back.
        assert_eq!(l.recovery_s, Some(4.0));
        assert_eq!(l.bins[0].faulted, Some(0.0));
        assert_eq!(l.bins[2].faulted, Some(0.8));
        // 10–16 s: 24 requests of 100 tokens, each 80 expected, 0 got.
        assert_eq!(l.span_requests, 24);
        assert!((l.hits_lost_tokens - 24.0 * 80.0).abs() < 1e-9, "{}", l.hits_lost_tokens);
        assert!((l.lost_share().unwrap() - 0.8).abs() < 1e-12);
        assert_eq!(l.fault, "stall");
    }

    #[test]
    fn a_replica_never_back_is_not_recovered_and_loses_until_the_window_ends() {
        let (records, replicas) = run(f64::INFINITY);
        let times = FaultTimes { start_ms: 10_000.0, end_ms: 12_000.0 };
        let l = recovery(Fault::Restart, &records, &replicas, 1, times, 0.0, 30_000.0, 2_000.0);
        assert_eq!(l.recovery_s, None);
        assert_eq!(l.span_requests, 80, "10–30 s");
        assert!((l.hits_lost_tokens - 80.0 * 80.0).abs() < 1e-9);
    }

    #[test]
    fn one_lucky_bin_is_not_a_recovery_and_an_unharmed_replica_recovers_at_once() {
        let (mut records, replicas) = run(20_000.0);
        // 13.00–13.75 s: the faulted replica hits as the control does, for one bin only.
        for (r, rep) in records.iter_mut().zip(&replicas) {
            if *rep == 1 && (13_000.0..14_000.0).contains(&r.sent_ms) {
                r.cached_tokens = Some(80);
            }
        }
        let times = FaultTimes { start_ms: 10_000.0, end_ms: 12_000.0 };
        let l = recovery(Fault::Stall, &records, &replicas, 1, times, 0.0, 30_000.0, 1_000.0);
        assert_eq!(l.recovery_s, Some(8.0), "back at 20 s, not at the lucky 13 s");
        let (fine, replicas) = run(0.0);
        let l = recovery(Fault::Stall, &fine, &replicas, 1, times, 0.0, 30_000.0, 1_000.0);
        assert_eq!(l.recovery_s, Some(0.0));
        assert!(l.hits_lost_tokens.abs() < 1e-9);
        assert!(Fault::parse("pause").is_err());
        assert_eq!(Fault::parse(" restart").unwrap(), Fault::Restart);
    }
}
