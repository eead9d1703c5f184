//! Per-publisher sequence tracking: which live batches to apply, which are duplicates of a replay,
//! where a gap starts, and when the engine restarted.
//!
//! vLLM numbers every published batch from 0, per publisher (per dp rank and per process start).
//! A jump forward is a gap (messages lost: the SUB high-water mark, a reconnect); a jump backward is
//! either a live copy of something a replay already delivered, or a restarted engine whose counter
//! began again. Keeping this a pure state machine lets the tricky cases be tested without sockets.
//! Numbers come from the wire, so arithmetic saturates: `u64::MAX` from a publisher (it overflowed
//! `seq + 1`, a panic in debug builds; found writing the sequencer's fuzz target) is handled like
//! any number, never a panic (the counter then stays at the top: a degenerate stream, not a crash).
//! A replay is trusted only up to its first hole ([`contiguous_run`]).

/// How many leading batches of a replay may be applied: the run of consecutive numbers from the
/// first. A replay can arrive with holes — a ZMQ ROUTER drops, without an error, every reply its
/// queue to the requester cannot take (libzmq at the high-water mark; vLLM's replay socket and the
/// simulator's alike) — and applying what follows a hole as if nothing were missing loses the
/// hole's events for good: a lost `BlockRemoved` keeps its block in the index until the worker is
/// cleared (the soak's index growth, issue 15). The caller applies the run, records its last number
/// with [`Sequencer::replayed`], and the next live batch then shows the rest as a gap.
pub fn contiguous_run(seqs: &[u64]) -> usize {
    let mut expect: Option<u64> = None;
    for (i, &s) in seqs.iter().enumerate() {
        if expect.is_some_and(|e| s != e) {
            return i;
        }
        expect = Some(s.saturating_add(1));
    }
    seqs.len()
}

/// Most rounds one replay may take: the first request plus re-requests from the first missing
/// number ([`plan_round`]). A ROUTER at libzmq's default send HWM delivers about 1,000 replies a
/// round, so a full vLLM ring (10,000 batches) takes about 11; a round that delivers nothing new
/// ends the replay early. Each round ends at the end marker, 250 ms after the last reply, or at
/// `routing.replay_timeout_ms`, so a replay stalls its listener at most this many deadlines.
pub const MAX_REPLAY_ROUNDS: u32 = 16;

/// What one round of a replay allows: apply its first `apply` batches, then `next`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Round {
    /// Leading batches of the round to apply (a run of consecutive numbers from the ask).
    pub apply: usize,
    /// What follows.
    pub next: RoundNext,
}

/// After a round of a replay.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoundNext {
    /// Everything from the ask up to the end marker arrived: the replay is whole.
    Done,
    /// A hole, or no end marker (dropped like any reply): ask again from `from`, the first
    /// number not applied (the round delivered at least one batch: each round makes progress).
    AskAgain { from: u64 },
    /// Out of rounds, a round that brought nothing new, or one that does not start at the ask (the
    /// engine's ring moved past it): the replay ends short; the next live batch shows what is
    /// missing as a gap.
    GiveUp,
}

/// Plans round `round` (from 0) of a replay asked from `ask`, given the numbers that arrived (those
/// `>= ask`, in arrival order) and whether the end marker came. vLLM's replay ROUTER keeps
/// libzmq's default send high-water mark (1,000) and drops, without an error, replies beyond it —
/// batches and the end marker alike — so a long replay can arrive with holes or unterminated; it
/// is asked again from the first missing number instead of clearing the worker. A first round
/// that starts later than asked (the ring no longer holds the start) is the caller's to judge: it
/// passes the first number that arrived as `ask`.
pub fn plan_round(ask: u64, seqs: &[u64], ended: bool, round: u32, max_rounds: u32) -> Round {
    if seqs.first().is_some_and(|&f| f != ask) {
        return Round { apply: 0, next: RoundNext::GiveUp };
    }
    let apply = contiguous_run(seqs);
    if ended && apply == seqs.len() {
        return Round { apply, next: RoundNext::Done };
    }
    if apply == 0 || round.saturating_add(1) >= max_rounds {
        return Round { apply, next: RoundNext::GiveUp };
    }
    let from = seqs[..apply].last().map_or(ask, |l| l.saturating_add(1));
    Round { apply, next: RoundNext::AskAgain { from } }
}

/// What to do with a live batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Next in order: apply it.
    Apply,
    /// Already delivered by a replay: skip it.
    Duplicate,
    /// Batches `from..to` are missing (`to` is this batch's number): replay from `from`.
    Gap { from: u64, to: u64 },
    /// The counter went backwards without a replay explaining it: the engine restarted. Clear the
    /// worker; then batches `0..seq` of the new run are missing if `seq > 0` (replay from 0).
    Restart { seq: u64 },
}

/// Sequence state of one publisher.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Sequencer {
    /// The next number expected; None before anything was seen.
    next: Option<u64>,
    /// Highest number delivered by the last replay: live copies up to it are duplicates.
    replayed_through: Option<u64>,
    /// The position is unknown (the connection was lost with the worker cleared): the next live
    /// batch is taken as is, whatever its number.
    take_next: bool,
}

impl Sequencer {
    /// A sequencer expecting batch 0 first.
    pub fn new() -> Self {
        Self::default()
    }

    /// The next number expected.
    pub fn next(&self) -> u64 {
        self.next.unwrap_or(0)
    }

    /// The last number applied, if any.
    pub fn last(&self) -> Option<u64> {
        self.next.and_then(|n| n.checked_sub(1))
    }

    /// Classifies live batch `seq`. `Apply` and `Restart` advance the state as if it was applied.
    pub fn on_live(&mut self, seq: u64) -> Verdict {
        if std::mem::take(&mut self.take_next) {
            self.skip_to(seq);
            return Verdict::Apply;
        }
        let next = self.next();
        if seq == next {
            self.next = Some(seq.saturating_add(1));
            // Live batches caught up past the replay: from now on an older number is a restart.
            if self.replayed_through.is_some_and(|r| seq > r) {
                self.replayed_through = None;
            }
            return Verdict::Apply;
        }
        if seq > next {
            return Verdict::Gap { from: next, to: seq };
        }
        if self.replayed_through.is_some_and(|r| seq <= r) {
            return Verdict::Duplicate;
        }
        self.replayed_through = None;
        self.next = Some(seq.saturating_add(1));
        Verdict::Restart { seq }
    }

    /// Records a replay that delivered batches up to `last` (inclusive); None = it delivered nothing.
    pub fn replayed(&mut self, last: Option<u64>) {
        if let Some(last) = last {
            if last.saturating_add(1) > self.next() {
                self.next = Some(last.saturating_add(1));
            }
            self.replayed_through = Some(last);
        }
    }

    /// Forgets the position: the worker was cleared and the batches since the last one seen are
    /// lost without a way to replay them (libzmq refused a frame and closed the connection: the
    /// refused batch would be in any replay too), so the next live batch applies whatever its
    /// number — no gap, no replay.
    pub fn resume_at_next_live(&mut self) {
        self.take_next = true;
        self.replayed_through = None;
    }

    /// Gives up on a gap that could not be replayed: continue after `seq` (the caller cleared the worker).
    pub fn skip_to(&mut self, seq: u64) {
        self.next = Some(seq.saturating_add(1));
        self.replayed_through = None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn in_order_batches_apply() {
        let mut s = Sequencer::new();
        for i in 0..5 {
            assert_eq!(s.on_live(i), Verdict::Apply);
        }
        assert_eq!(s.last(), Some(4));
    }

    #[test]
    fn a_jump_is_a_gap_until_replayed() {
        let mut s = Sequencer::new();
        assert_eq!(s.on_live(0), Verdict::Apply);
        assert_eq!(s.on_live(4), Verdict::Gap { from: 1, to: 4 });
        // The replay delivered 1..=6 (it reaches past the live batch that revealed the gap).
        s.replayed(Some(6));
        assert_eq!(s.on_live(4), Verdict::Duplicate);
        assert_eq!(s.on_live(6), Verdict::Duplicate);
        assert_eq!(s.on_live(7), Verdict::Apply);
    }

    #[test]
    fn after_resume_at_next_live_any_number_applies_and_order_resumes_from_it() {
        let mut s = Sequencer::new();
        for i in 0..5 {
            s.on_live(i);
        }
        s.resume_at_next_live();
        assert_eq!(s.on_live(9), Verdict::Apply, "forward, no gap");
        assert_eq!(s.on_live(10), Verdict::Apply);
        assert_eq!(s.on_live(12), Verdict::Gap { from: 11, to: 12 }, "then in order again");
        s.resume_at_next_live();
        assert_eq!(s.on_live(3), Verdict::Apply, "backward, no restart");
        assert_eq!(s.last(), Some(3));
    }

    #[test]
    fn first_batch_after_start_late_is_a_gap_from_zero() {
        let mut s = Sequencer::new();
        assert_eq!(s.on_live(10), Verdict::Gap { from: 0, to: 10 });
    }

    #[test]
    fn backwards_without_replay_is_a_restart() {
        let mut s = Sequencer::new();
        for i in 0..10 {
            s.on_live(i);
        }
        assert_eq!(s.on_live(0), Verdict::Restart { seq: 0 });
        assert_eq!(s.on_live(1), Verdict::Apply);
        // A restart noticed late: the new run's first batches were missed.
        for i in 2..20 {
            s.on_live(i);
        }
        assert_eq!(s.on_live(3), Verdict::Restart { seq: 3 });
    }

    #[test]
    fn restart_after_a_replay_is_still_detected_below_the_replay() {
        let mut s = Sequencer::new();
        s.replayed(Some(100));
        assert_eq!(s.on_live(50), Verdict::Duplicate);
        s.on_live(101);
        s.skip_to(200);
        assert_eq!(s.on_live(5), Verdict::Restart { seq: 5 });
    }

    #[test]
    fn a_restart_after_the_start_up_replay_caught_up_is_detected() {
        // Seen on a real vLLM killed and restarted: the start-up replay delivered 0..=25, live
        // batches went on from 26; the new engine's 0, 1, … are a restart, not replay copies.
        let mut s = Sequencer::new();
        s.replayed(Some(25));
        assert_eq!(s.on_live(25), Verdict::Duplicate);
        assert_eq!(s.on_live(26), Verdict::Apply);
        assert_eq!(s.on_live(0), Verdict::Restart { seq: 0 });
        assert_eq!(s.on_live(1), Verdict::Apply);
    }

    #[test]
    fn the_largest_sequence_number_does_not_overflow() {
        let mut s = Sequencer::new();
        assert_eq!(s.on_live(u64::MAX), Verdict::Gap { from: 0, to: u64::MAX });
        s.skip_to(u64::MAX); // the expected number saturates at the top: the counter stays there
        assert_eq!(s.on_live(u64::MAX), Verdict::Apply);
        s.replayed(Some(u64::MAX));
        assert_eq!(s.on_live(0), Verdict::Duplicate);
        let mut s = Sequencer::new();
        s.skip_to(u64::MAX - 1);
        assert_eq!(s.on_live(u64::MAX), Verdict::Apply);
    }

    #[test]
    fn a_replay_is_usable_up_to_its_first_hole() {
        let cases: [(&[u64], usize); 9] = [
            (&[], 0),
            (&[7], 1),
            (&[0, 1, 2], 3),
            (&[0, 2, 3], 1),
            (&[3, 4, 6, 7], 2),
            (&[0, 1, 1, 2], 2),
            (&[2, 1], 1),
            (&[5, 6, 7, 9], 3),
            (&[u64::MAX - 1, u64::MAX], 2),
        ];
        for (seqs, want) in cases {
            assert_eq!(contiguous_run(seqs), want, "{seqs:?}");
        }
    }

    #[test]
    fn after_a_replay_with_a_hole_the_next_live_batch_is_a_gap_from_the_hole() {
        // The start-up replay delivered 0, 1, 3: 0 and 1 are applied, 2 is still missing.
        let mut s = Sequencer::new();
        let replayed = [0, 1, 3];
        let run = contiguous_run(&replayed);
        s.replayed(replayed[..run].last().copied());
        assert_eq!(s.on_live(1), Verdict::Duplicate);
        assert_eq!(s.on_live(4), Verdict::Gap { from: 2, to: 4 });
    }

    #[test]
    fn an_empty_replay_changes_nothing() {
        let mut s = Sequencer::new();
        s.replayed(None);
        assert_eq!(s.on_live(0), Verdict::Apply);
    }

    #[test]
    fn a_replay_round_is_asked_again_from_its_first_missing_number() {
        use RoundNext::*;
        // (ask, arrived, end marker, round, max rounds) → (apply, next)
        type Case<'a> = (u64, &'a [u64], bool, u32, u32, usize, RoundNext);
        let cases: [Case; 10] = [
            (0, &[0, 1, 2], true, 0, 4, 3, Done),
            (5, &[], true, 0, 4, 0, Done),
            (0, &[0, 1, 3, 4], true, 0, 4, 2, AskAgain { from: 2 }),
            (0, &[0, 1, 2], false, 0, 4, 3, AskAgain { from: 3 }), // the end marker was dropped
            (7, &[], false, 1, 4, 0, GiveUp), // nothing new: no progress, no more rounds
            (2, &[2, 3, 5], false, 1, 4, 2, AskAgain { from: 4 }),
            (2, &[2, 4], true, 3, 4, 1, GiveUp), // out of rounds
            (2, &[2, 3], false, 3, 4, 2, GiveUp),
            (2, &[3, 4], true, 1, 4, 0, GiveUp), // the ring moved past the ask
            (u64::MAX - 1, &[u64::MAX - 1, u64::MAX], false, 0, 4, 2, AskAgain { from: u64::MAX }),
        ];
        for (ask, seqs, ended, round, max, apply, next) in cases {
            assert_eq!(
                plan_round(ask, seqs, ended, round, max),
                Round { apply, next },
                "{ask} {seqs:?} {ended} {round}"
            );
        }
    }
}
