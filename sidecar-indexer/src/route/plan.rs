//! Step 2 of a route call: the prompt's tokens and block chains (blocking pool), its matches in the
//! index, and the decision — made and booked under one hold of the fleet and load locks, so
//! concurrent calls see each other's bookings. [`decide`] stays pure; this is the shell around it.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::hashing::{block_seed, LocalBlockHash, SequenceHash};
use kvmesh_core::openai::OpenAiRequest;

use super::admission::{Cancel, Permit};
use super::request::RouteRequest;
use super::settle::{BookingGuard, Record};
use super::ApiError;
use crate::config::{Config, IndexMode};
use crate::decide::{decide, DecideError, Plan, RouteInput};
use crate::state::AppState;
use crate::tokenize::{CacheStats, PromptTokens, Reach, TokenizeError};

/// A prompt as the index sees it: the blocks of its tokenized part (every block a worker may hold,
/// and what the disaggregation threshold needs exactly) and its length (estimated past them).
pub struct Prompt {
    pub tokens: usize,
    pub chains: Vec<SequenceHash>,
    /// Local block hashes (for orphan recovery, `crate::index` recovery).
    pub locals: Vec<LocalBlockHash>,
    /// The request, when only part of its prompt was tokenized: [`complete_later`] tokenizes the
    /// rest off the request path and credits its blocks to the chosen workers speculatively.
    pub partial: Option<OpenAiRequest>,
    /// [`OpenAiRequest::opens_conversation`].
    pub opens_conversation: bool,
}

/// Background completions ([`complete_later`]) queued or running at most at once; beyond, they are
/// skipped. Also the number of threads that run them.
pub const MAX_BACKGROUND_COMPLETIONS: usize = 2;

/// The nice value of the background completions' threads: the lowest priority, so a completion
/// (about one whole encode of a cold prompt, ~50 ms of CPU at 38k tokens) runs on CPU that route
/// calls leave idle instead of sharing a core with them. On the blocking pool, at the route's own
/// priority, two completions held both cores of a 2-core gateway and warm routes queued behind
/// them (the route benchmark's 64 concurrent callers: warm p99 no lower than cold).
pub const BACKGROUND_NICE: i32 = 19;

/// How long, in all, a background completion waits for route calls before it gives up: it
/// encodes only while no route call is in flight ([`give_way`]). Nice 19 (and `SCHED_IDLE`, tried)
/// did not keep it from slowing routes: in the route benchmark's 64 concurrent callers, warm routes'
/// p99 rose a median 1.82 × with cold callers beside them, 1.47 × with this wait (9 runs each).
pub const BACKGROUND_MAX_WAIT: Duration = Duration::from_secs(1);

/// How long a waiting completion sleeps before it looks at the route calls in flight again.
const BACKGROUND_WAIT_STEP: Duration = Duration::from_micros(200);

static BACKGROUND: AtomicUsize = AtomicUsize::new(0);

type Completion = Box<dyn FnOnce() + Send>;

/// The background threads' queue, started on first use; `None` when no thread could be started
/// (completions are then skipped: the engine's events bring the same blocks a little later).
fn background_queue() -> Option<&'static std::sync::mpsc::SyncSender<Completion>> {
    static QUEUE: std::sync::OnceLock<Option<std::sync::mpsc::SyncSender<Completion>>> =
        std::sync::OnceLock::new();
    QUEUE
        .get_or_init(|| {
            let (tx, rx) = std::sync::mpsc::sync_channel::<Completion>(MAX_BACKGROUND_COMPLETIONS);
            let rx = Arc::new(std::sync::Mutex::new(rx));
            let mut started = 0;
            for i in 0..MAX_BACKGROUND_COMPLETIONS {
                let rx = rx.clone();
                let spawned = std::thread::Builder::new().name(format!("kvmesh-complete-{i}")).spawn(move || {
                    // Per thread on Linux: only this thread's priority drops.
                    if let Err(e) = rustix::process::setpriority_process(None, BACKGROUND_NICE) {
                        tracing::warn!(error = %e, "background tokenization thread keeps its priority: setpriority failed");
                    }
                    loop {
                        // One thread waits in recv while holding the lock; the others wait for the lock.
                        let next = rx.lock().unwrap_or_else(|poisoned| poisoned.into_inner()).recv();
                        match next {
                            Ok(job) => job(),
                            Err(_) => return,
                        }
                    }
                });
                match spawned {
                    Ok(_) => started += 1,
                    Err(e) => tracing::warn!(error = %e, "cannot start a background tokenization thread"),
                }
            }
            (started > 0).then_some(tx)
        })
        .as_ref()
}

/// Background completions queued or running now (the route bench waits for none before a case
/// that needs its own prompt completed, so an earlier case's cannot make it skip).
pub fn background_completions_in_flight() -> usize {
    BACKGROUND.load(Ordering::Acquire)
}

/// Runs `job` on a background completion thread (nice [`BACKGROUND_NICE`]) unless
/// [`MAX_BACKGROUND_COMPLETIONS`] are already queued or running; `false` when it was skipped.
fn run_in_background(job: impl FnOnce() + Send + 'static) -> bool {
    struct InFlight;
    impl Drop for InFlight {
        fn drop(&mut self) {
            BACKGROUND.fetch_sub(1, Ordering::AcqRel);
        }
    }
    if BACKGROUND.fetch_add(1, Ordering::AcqRel) >= MAX_BACKGROUND_COMPLETIONS {
        BACKGROUND.fetch_sub(1, Ordering::AcqRel);
        return false;
    }
    let in_flight = InFlight;
    let job: Completion = Box::new(move || {
        let _in_flight = in_flight;
        job();
    });
    // A full queue cannot happen while the counter holds (at most as many jobs as threads); a
    // failed send drops the job and its counter guard with it.
    background_queue().is_some_and(|q| q.try_send(job).is_ok())
}

/// Tokenizes the rest of a partly tokenized prompt on a background thread, after the decision was
/// answered, and records all its blocks as speculative holdings of the plan's workers: siblings
/// and the conversation's next turn, arriving before the engine's events, see the whole prompt
/// there (not only the part the decision needed), and the tokenization cache holds it. The
/// threads run at the lowest priority ([`BACKGROUND_NICE`]) and encode only while no route call is
/// in flight, giving up after [`BACKGROUND_MAX_WAIT`] of waiting; at most
/// [`MAX_BACKGROUND_COMPLETIONS`] are queued or running at once; beyond, the completion is
/// skipped (the engine's events bring the same blocks a little later).
pub fn complete_later(state: &Arc<AppState>, cfg: &Config, request: OpenAiRequest, plan: &Plan) {
    let mut holders = vec![plan.worker.clone()];
    if let Some(crate::decide::Leg::PrefillOn { worker, .. }) = &plan.leg {
        holders.push(worker.clone());
    }
    let (shared, block_size) = (state.clone(), cfg.model.block_size as usize);
    // The record's stamp comes from the indexer's clock (`clock::now`, tokio's): inside the
    // caller's runtime context, as on the blocking pool, so a paused test clock stamps it too.
    let runtime = tokio::runtime::Handle::try_current().ok();
    let queued = run_in_background(move || {
        let _runtime = runtime.as_ref().map(tokio::runtime::Handle::enter);
        let state = shared;
        let tokenizer = state.tokenizer.read().clone();
        let seed = block_seed(None, request.cache_salt.as_deref());
        let mut waited = Duration::ZERO;
        let mut go_on = || {
            give_way(&state.route_inflight, &mut waited, BACKGROUND_MAX_WAIT, BACKGROUND_WAIT_STEP)
        };
        let whole = match tokenizer.tokens_until(
            &request.input,
            &mut Reach::whole_blocks(block_size, seed).yielding(&mut go_on),
            &mut CacheStats::default(),
        ) {
            Ok(t) => t,
            Err(TokenizeError::GaveWay) => {
                state.metrics.tokenize_background.with_label_values(&["gave_way"]).inc();
                tracing::debug!(
                    waited_ms = BACKGROUND_MAX_WAIT.as_millis() as u64,
                    "background tokenization gave way to route calls"
                );
                return;
            }
            Err(e) => {
                state.metrics.tokenize_background.with_label_values(&["failed"]).inc();
                tracing::debug!(error = %e, "background tokenization failed");
                return;
            }
        };
        state.metrics.tokenize_background.with_label_values(&["done"]).inc();
        let fleet = state.fleet.read();
        let slots: Vec<_> = fleet
            .workers
            .iter()
            .filter(|w| holders.contains(&w.cfg.id))
            .filter_map(|w| w.ranks.first())
            .map(|r| r.slot)
            .collect();
        let mut placement = state.placement.lock();
        for slot in slots {
            placement.speculative.record(slot, &whole.chains, crate::clock::now());
        }
    });
    if !queued {
        state.metrics.tokenize_background.with_label_values(&["skipped"]).inc();
        tracing::debug!(
            "background tokenization skipped: {MAX_BACKGROUND_COMPLETIONS} queued or running"
        );
    }
}

/// Lets a background completion's next chunk wait while route calls are in flight (`inflight`):
/// sleeps `step` at a time, adding what it slept to `waited`; `false` once `waited` reaches `max`.
fn give_way(inflight: &AtomicUsize, waited: &mut Duration, max: Duration, step: Duration) -> bool {
    while inflight.load(Ordering::Acquire) > 0 {
        if *waited >= max {
            return false;
        }
        let slept = Instant::now();
        std::thread::sleep(step);
        *waited += slept.elapsed();
    }
    true
}

/// Largest `/v1/route` body whose prompt is tokenized on the calling task instead of the blocking
/// pool. Most routes are short work (a continuation resumes from the memo, a cold prompt stops
/// after its first unheld block), and the hop to the pool and back — waking a pool thread, then the
/// caller's worker — cost more than the work: in the overhead bench's A/B the indexer's own p50 fell
/// from 0.35–0.37 to 0.24–0.25 ms at 1k and its routes per CPU-second rose ~30 % (1k, 8k). The worst
/// inline case, a 64 KiB prompt held by a worker but not in the memo, tokenizes ~16k tokens on the
/// async worker; longer prompts keep the pool, so an async worker is never held longer.
pub const INLINE_TOKENIZE_MAX_BODY_BYTES: usize = 64 * 1024;

/// Largest body tried on the calling task when its read continued the conversation's last body
/// (the body memo) and at most [`INLINE_TOKENIZE_MAX_BODY_BYTES`] of it is new. Its tokenization
/// resumes from the prefix memo, which holds the last turn (twice the body memo's bound), and
/// encodes the new text; the try encodes at most [`INLINE_TOKENIZE_MAX_BODY_BYTES`] of text past
/// where the memo resumed it ([`Reach::within`]) and otherwise hands the prompt to the pool
/// untouched. What the try costs whatever the memo holds — rendering the template and splitting the
/// text's tail — is ~0.1 ms at 300 KB. The pool's hop cost a 300 KB conversation's turn
/// ~0.1–0.2 ms of its ~0.4 ms (the overhead bench's 48k shared prefix; README "Where it runs").
pub const INLINE_TOKENIZE_MAX_CONTINUED_BODY_BYTES: usize = 1024 * 1024;

/// Where a route's prompt is tokenized first: on the calling task with at most this many bytes of
/// text to encode past the prefix memo's resume point (`usize::MAX`: all of it) — a body of at most
/// [`INLINE_TOKENIZE_MAX_BODY_BYTES`], or one of at most [`INLINE_TOKENIZE_MAX_CONTINUED_BODY_BYTES`]
/// whose `fresh_bytes` (those past the prefix its read continued) are at most
/// [`INLINE_TOKENIZE_MAX_BODY_BYTES`] — else `None`: on the blocking pool.
pub fn inline_budget(body_bytes: usize, fresh_bytes: usize) -> Option<usize> {
    if body_bytes <= INLINE_TOKENIZE_MAX_BODY_BYTES {
        Some(usize::MAX)
    } else if body_bytes <= INLINE_TOKENIZE_MAX_CONTINUED_BODY_BYTES
        && fresh_bytes <= INLINE_TOKENIZE_MAX_BODY_BYTES
    {
        Some(INLINE_TOKENIZE_MAX_BODY_BYTES)
    } else {
        None
    }
}

/// One route's tokenization, runnable on the calling task or the blocking pool.
struct Tokenizing {
    state: Arc<AppState>,
    request: OpenAiRequest,
    block_size: usize,
    exact_past_held: usize,
    /// Approximate mode has no engine events: what a decision records is all the index will know,
    /// so its prompts are tokenized whole.
    whole: bool,
}

impl Tokenizing {
    /// Tokenizes and hashes as far as some worker holds the prompt (tokenize.rs "only what can
    /// match"), encoding at most `budget` bytes past the memo's resume point; counts what it did
    /// unless it refused for the budget (then nothing was done).
    fn run(&self, budget: usize) -> Result<PromptTokens, TokenizeError> {
        let (state, metrics) = (&self.state, &self.state.metrics);
        let tokenizer = state.tokenizer.read().clone();
        let t0 = Instant::now();
        let mut stats = CacheStats::default();
        let seed = block_seed(None, self.request.cache_salt.as_deref());
        let whole = self.whole;
        let mut held = |chains: &[SequenceHash]| {
            if whole {
                chains.len()
            } else {
                held_prefix(state, chains, crate::clock::now())
            }
        };
        let mut reach =
            Reach::new(self.block_size, seed, self.exact_past_held, &mut held).within(budget);
        let tokens = match tokenizer.tokens_until(&self.request.input, &mut reach, &mut stats) {
            Err(e @ TokenizeError::OverBudget { .. }) => {
                metrics.tokenize_moved_to_pool.inc();
                return Err(e);
            }
            done => done,
        };
        metrics.tokenize_duration.observe(t0.elapsed().as_secs_f64());
        metrics.tokenize_cache.with_label_values(&["hit"]).inc_by(stats.hits);
        metrics.tokenize_cache.with_label_values(&["miss"]).inc_by(stats.misses);
        metrics.tokenize_memo.with_label_values(&["hit"]).inc_by(stats.memo_hits);
        metrics.tokenize_memo.with_label_values(&["tail_hit"]).inc_by(stats.memo_tail_hits);
        metrics.tokenize_memo.with_label_values(&["miss"]).inc_by(stats.memo_misses);
        let t = tokens?;
        metrics.tokenize_tokens.with_label_values(&["exact"]).inc_by(t.ids.len() as u64);
        metrics.tokenize_tokens.with_label_values(&["estimated"]).inc_by(t.estimated_rest as u64);
        Ok(t)
    }

    /// The prompt `t` tokenized, with the request kept for [`complete_later`] when only part was.
    fn finish(self, t: PromptTokens) -> Prompt {
        let opens_conversation = self.request.opens_conversation();
        let partial = (!t.complete()).then_some(self.request);
        Prompt {
            tokens: t.tokens(),
            chains: t.chains,
            locals: t.locals,
            partial,
            opens_conversation,
        }
    }
}

/// Tokenizes and hashes: first on the calling task when [`inline_budget`] allows (handing over to
/// the pool, untouched, a prompt with more new text than the budget), else on the blocking pool.
/// The [`Permit`] is released when the work ends, not when the caller leaves; a pool task whose
/// caller left before it started skips the work.
pub async fn tokenize(
    state: &Arc<AppState>,
    cfg: &Config,
    request: OpenAiRequest,
    permit: Permit,
    cancel: Cancel,
    inline: Option<usize>,
) -> Result<Prompt, ApiError> {
    let job = Tokenizing {
        state: state.clone(),
        request,
        block_size: cfg.model.block_size as usize,
        exact_past_held: usize::try_from(cfg.routing.min_remote_prefill_tokens)
            .unwrap_or(usize::MAX),
        whole: cfg.routing.mode == IndexMode::Approximate,
    };
    let unavailable = |e: TokenizeError| ApiError::unavailable("tokenizer", e.to_string());
    if let Some(budget) = inline {
        match job.run(budget) {
            Err(TokenizeError::OverBudget { fresh, budget }) => tracing::debug!(fresh, budget, "route tokenization moved to the blocking pool: more new text than an async worker may encode"),
            done => return done.map(|t| job.finish(t)).map_err(unavailable),
        }
    }
    let metrics = state.metrics.clone();
    let work = move || {
        let _permit = permit;
        if cancel.is_cancelled() {
            metrics.route_cancelled.with_label_values(&["queued"]).inc();
            return None;
        }
        let done = job.run(usize::MAX);
        if cancel.is_cancelled() {
            metrics.route_cancelled.with_label_values(&["tokenizing"]).inc();
            tracing::debug!("route caller left during tokenization; result dropped");
            return None;
        }
        Some(done.map(|t| job.finish(t)))
    };
    match tokio::task::spawn_blocking(work).await {
        Ok(Some(r)) => r.map_err(unavailable),
        // Only reachable when the caller is gone: nobody reads this answer.
        Ok(None) => Err(ApiError::unavailable("cancelled", "the route call was cancelled")),
        Err(e) => Err(ApiError::unavailable("tokenizer", format!("tokenizer task failed: {e}"))),
    }
}

/// Leading blocks of `chains` some worker holds, in the index or speculatively: how far tokenizing
/// must go. Locks the index, then the fleet and placement (the order `decide_and_book` uses).
fn held_prefix(state: &AppState, chains: &[SequenceHash], now: Instant) -> usize {
    let indexed =
        state.index.read().find_matches(chains).iter().map(|&(_, n)| n).max().unwrap_or(0) as usize;
    if indexed >= chains.len() {
        return indexed;
    }
    let fleet = state.fleet.read();
    let placement = state.placement.lock();
    let speculative = fleet
        .workers
        .iter()
        .filter_map(|w| w.ranks.first())
        .map(|r| placement.speculative.overlap(r.slot, chains, now))
        .max()
        .unwrap_or(0) as usize;
    indexed.max(speculative)
}

/// Matches the prompt, decides and books the chosen worker; the booking is released if the call
/// is dropped before it settles.
pub fn decide_and_book<'a>(
    state: &'a AppState,
    cfg: &Config,
    req: &RouteRequest,
    prompt: Prompt,
) -> Result<(Plan, BookingGuard<'a>, Record), ApiError> {
    let t_match = Instant::now();
    let scores = state.index.read().find_matches(&prompt.chains);
    state.metrics.match_duration.observe(t_match.elapsed().as_secs_f64());

    let t_score = Instant::now();
    let session_key = req.session.map(|(k, _)| k.0);
    let now = crate::clock::now();
    let (continuation, kv_home) = match session_key {
        Some(k) => {
            let sessions = state.sessions.lock();
            (sessions.continuations.get(k, now).is_some(), sessions.kv_home.get(k, now).cloned())
        }
        None => (false, None),
    };
    let input = RouteInput {
        isl_tokens: prompt.tokens,
        block_size: cfg.model.block_size,
        session: req.session,
        override_worker: req.override_worker.as_deref(),
        override_mode: req.override_mode,
        continuation,
        kv_home: kv_home.as_deref(),
        opens_conversation: prompt.opens_conversation,
    };
    let fleet = state.fleet.read();
    let overlaps = fleet.overlaps(&scores);
    let mut load = state.load.lock();
    let views = state.views(&fleet, &overlaps, &load, &prompt.chains, cfg, now);
    let plan = {
        let mut rng = state.rng.lock();
        decide(&input, &views, &cfg.routing, &mut *rng)
    }
    .map_err(|e| match e {
        DecideError::UnknownOverrideWorker(_) => ApiError::bad_request(e.reason(), e.to_string()),
        _ => ApiError::unavailable(e.reason(), e.to_string()),
    })?;
    // A remote prefill leaves the decode worker only the KV pull; its prefill is booked on P.
    let prefill_tokens =
        if plan.mode == kvmesh_core::api::Mode::Disagg { 0 } else { plan.uncached_tokens };
    let booking = BookingGuard::book(
        state,
        &mut load,
        &plan.worker,
        u64::from(plan.request_blocks),
        prefill_tokens,
        req.request_id.as_deref(),
        true,
    );
    let approx_slot = (cfg.routing.mode == IndexMode::Approximate)
        .then(|| {
            fleet
                .workers
                .iter()
                .find(|w| w.cfg.id == plan.worker)
                .and_then(|w| w.ranks.first().map(|r| r.slot))
        })
        .flatten();
    // Precise mode, a prompt the index does not know whole: remember it for the workers that will
    // store its blocks, so their stores can be chained even if its prefix is unknown here.
    let recover_on: Vec<_> = if cfg.routing.mode == IndexMode::Precise
        && plan.overlap_blocks < plan.isl_blocks
    {
        let prefill = match &plan.leg {
            Some(crate::decide::Leg::PrefillOn { worker, .. }) => Some(worker.as_str()),
            _ => None,
        };
        let known = |slot| scores.iter().find(|&&(s, _)| s == slot).map_or(0, |&(_, n)| n as usize);
        fleet
            .workers
            .iter()
            .filter(|w| w.cfg.id == plan.worker || Some(w.cfg.id.as_str()) == prefill)
            .flat_map(|w| w.ranks.iter().map(|r| (r.slot, known(r.slot))))
            .collect()
    } else {
        Vec::new()
    };
    drop(load);
    drop(fleet);
    // Backlog and speculative holdings for the next decisions (siblings see these blocks at once).
    state.placed(&plan, &prompt.chains, cfg, now);
    state.metrics.score_duration.observe(t_score.elapsed().as_secs_f64());
    let record = Record {
        basis: plan.basis,
        local_continuation: plan.local_continuation,
        session_key,
        approx_slot,
        recover_on,
        chains: prompt.chains,
        locals: prompt.locals,
    };
    Ok((plan, booking, record))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn short_bodies_and_short_continuations_tokenize_inline() {
        let (small, continued_max) =
            (INLINE_TOKENIZE_MAX_BODY_BYTES, INLINE_TOKENIZE_MAX_CONTINUED_BODY_BYTES);
        // (body bytes, bytes past the continued prefix, the inline try's budget)
        for (body, fresh, budget) in [
            (small, small, Some(usize::MAX)),
            (small + 1, small + 1, None),
            (300_000, 600, Some(small)),
            (300_000, small + 1, None),
            (continued_max, small, Some(small)),
            (continued_max + 1, 600, None),
        ] {
            assert_eq!(inline_budget(body, fresh), budget, "{body} bytes, {fresh} new");
        }
    }

    #[test]
    fn a_background_completion_waits_while_routes_are_in_flight_and_gives_up_after_its_budget() {
        let step = Duration::from_micros(200);
        let max = Duration::from_millis(5);
        let inflight = Arc::new(AtomicUsize::new(0));
        let mut waited = Duration::ZERO;
        assert!(give_way(&inflight, &mut waited, max, step), "nothing in flight: go on");
        assert_eq!(waited, Duration::ZERO, "without sleeping");

        inflight.store(1, Ordering::Release);
        let release = {
            let inflight = inflight.clone();
            std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                inflight.store(0, Ordering::Release);
            })
        };
        assert!(
            give_way(&inflight, &mut waited, Duration::from_secs(30), step),
            "the route ended: go on"
        );
        assert!(waited >= Duration::from_millis(1), "it waited for the route ({waited:?})");
        release.join().expect("the releasing thread");

        inflight.store(1, Ordering::Release);
        let mut waited = Duration::ZERO;
        assert!(
            !give_way(&inflight, &mut waited, max, step),
            "routes in flight throughout: give up"
        );
        assert!(waited >= max, "after the whole budget ({waited:?})");
    }

    #[test]
    fn a_background_completion_runs_at_the_lowest_priority_off_the_callers_thread() {
        let callers = rustix::process::getpriority_process(None).expect("getpriority");
        let (tx, rx) = std::sync::mpsc::channel();
        // Other tests' route calls may hold both slots for a moment: retry until this job is queued.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let tx = tx.clone();
            let queued = run_in_background(move || {
                let _ = tx.send((
                    std::thread::current().name().map(str::to_owned),
                    rustix::process::getpriority_process(None),
                ));
            });
            if queued {
                break;
            }
            assert!(Instant::now() < deadline, "no background slot came free in 30 s");
            std::thread::sleep(Duration::from_millis(10));
        }
        let (thread, nice) = rx.recv_timeout(Duration::from_secs(30)).expect("the completion ran");
        assert!(
            thread.is_some_and(|n| n.starts_with("kvmesh-complete-")),
            "ran on a background thread"
        );
        assert_eq!(nice.expect("getpriority"), BACKGROUND_NICE);
        assert_eq!(
            rustix::process::getpriority_process(None).expect("getpriority"),
            callers,
            "only the background thread's priority dropped"
        );
    }
}
