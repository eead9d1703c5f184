//! Step 3 of a route call: the prompt's tokens and block chains — on the calling task when the
//! work is short ([`inline_budget`]), else on the blocking pool (cancellable) — tokenized only as
//! far as some worker holds it; and, after the answer, the rest of a partly tokenized prompt on the
//! background pool ([`complete_later`]).

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvmesh_core::hashing::{LocalBlockHash, SequenceHash};
use kvmesh_core::openai::OpenAiRequest;

use super::admission::{Cancel, Permit};
use super::background::{
    self, BACKGROUND_MAX_WAIT, BACKGROUND_WAIT_STEP, MAX_BACKGROUND_COMPLETIONS,
};
use super::record::{self, Cancelled, RouteMetrics};
use super::ApiError;
use crate::catalog::RouteModel;
use crate::config::{Config, IndexMode};
use crate::decide::Plan;
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
    /// rest off the request path and credits its blocks to the chosen workers speculatively
    /// ([`complete_later`]).
    pub partial: Option<OpenAiRequest>,
    /// [`OpenAiRequest::opens_conversation`].
    pub opens_conversation: bool,
}

/// Tokenizes the rest of a partly tokenized prompt on a background thread, after the decision was
/// answered, and records all its blocks as speculative holdings of the plan's workers: siblings
/// and the conversation's next turn, arriving before the engine's events, see the whole prompt
/// there (not only the part the decision needed), and the tokenization cache holds it. The
/// threads run at the lowest priority ([`background::BACKGROUND_NICE`]) and encode only while no route call is
/// in flight, giving up after [`BACKGROUND_MAX_WAIT`] of waiting; at most
/// [`MAX_BACKGROUND_COMPLETIONS`] are queued or running at once; beyond, the completion is
/// skipped (the engine's events bring the same blocks a little later).
pub fn complete_later(
    state: &Arc<AppState>,
    model: &RouteModel,
    request: OpenAiRequest,
    plan: &Plan,
) {
    let mut holders = vec![plan.worker.clone()];
    if let Some(crate::decide::Leg::PrefillOn { worker, .. }) = &plan.leg {
        holders.push(worker.clone());
    }
    let (shared, block_size) = (state.clone(), model.block_size() as usize);
    let tokenizer = model.runtime.tokenizer.clone();
    let seed = model.seed(request.cache_salt.as_deref());
    let media_from = first_media_message(&request);
    // The record's stamp comes from the indexer's clock (`clock::now`, tokio's): inside the
    // caller's runtime context, as on the blocking pool, so a paused test clock stamps it too.
    let runtime = tokio::runtime::Handle::try_current().ok();
    let queued = state.background.run(move || {
        let _runtime = runtime.as_ref().map(tokio::runtime::Handle::enter);
        let state = shared;
        let mut waited = Duration::ZERO;
        let mut go_on = || {
            background::give_way(
                &state.route_inflight,
                &mut waited,
                BACKGROUND_MAX_WAIT,
                BACKGROUND_WAIT_STEP,
            )
        };
        let whole = match tokenizer.tokens_until(
            &request.input,
            &mut Reach::whole_blocks(block_size, seed).media_from(media_from).yielding(&mut go_on),
            &mut CacheStats::default(),
        ) {
            Ok(t) => t,
            Err(TokenizeError::GaveWay) => {
                RouteMetrics(&state.metrics).background(record::Background::GaveWay);
                tracing::debug!(
                    waited_ms = BACKGROUND_MAX_WAIT.as_millis() as u64,
                    "background tokenization gave way to route calls"
                );
                return;
            }
            Err(e) => {
                RouteMetrics(&state.metrics).background(record::Background::Failed);
                tracing::debug!(error = %e, "background tokenization failed");
                return;
            }
        };
        RouteMetrics(&state.metrics).background(record::Background::Done);
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
        RouteMetrics(&state.metrics).background(record::Background::Skipped);
        tracing::debug!(
            "background tokenization skipped: {MAX_BACKGROUND_COMPLETIONS} queued or running"
        );
    }
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
    model: RouteModel,
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
        let (state, metrics) = (&self.state, RouteMetrics(&self.state.metrics));
        let tokenizer = &self.model.runtime.tokenizer;
        let t0 = Instant::now();
        let mut stats = CacheStats::default();
        let seed = self.model.seed(self.request.cache_salt.as_deref());
        let (whole, base) = (self.whole, self.model.base());
        let mut held = |chains: &[SequenceHash]| {
            if whole {
                chains.len()
            } else {
                held_prefix(state, base, chains, crate::clock::now())
            }
        };
        let mut reach = Reach::new(self.block_size, seed, self.exact_past_held, &mut held)
            .within(budget)
            .media_from(first_media_message(&self.request));
        let tokens = match tokenizer.tokens_until(&self.request.input, &mut reach, &mut stats) {
            Err(e @ TokenizeError::OverBudget { .. }) => {
                metrics.moved_to_pool();
                return Err(e);
            }
            done => done,
        };
        metrics.tokenized(t0.elapsed(), &stats, tokens.as_ref().ok());
        tokens
    }

    /// The prompt `t` tokenized, with the request kept for [`complete_later`] when only part was.
    fn finish(self, t: PromptTokens) -> Prompt {
        if t.cut_at_media {
            let model = crate::metrics::model_label(self.model.base());
            self.state.metrics.route_media_cut.with_label_values(&[&model]).inc();
        }
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
    model: &RouteModel,
    request: OpenAiRequest,
    permit: Permit,
    cancel: Cancel,
    inline: Option<usize>,
) -> Result<Prompt, ApiError> {
    let job = Tokenizing {
        state: state.clone(),
        model: model.clone(),
        request,
        block_size: model.block_size() as usize,
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
            RouteMetrics(&metrics).cancelled(Cancelled::Queued);
            return None;
        }
        let done = job.run(usize::MAX);
        if cancel.is_cancelled() {
            RouteMetrics(&metrics).cancelled(Cancelled::Tokenizing);
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

/// The index of the request's first message holding media parts: where its chains stop
/// (`crate::tokenize` "Media").
fn first_media_message(request: &OpenAiRequest) -> Option<usize> {
    request.media.first().map(|m| m.message as usize)
}

/// Leading blocks of `chains` some worker of base model `model` holds, in the index or
/// speculatively: how far tokenizing must go (another model's workers may hold the same chains —
/// same tokenizer and block size — and are not counted: `crate::catalog`). Locks the index, then
/// the fleet and placement (the order [`super::plan`] uses).
fn held_prefix(state: &AppState, model: &str, chains: &[SequenceHash], now: Instant) -> usize {
    let matches = state.index.read().find_matches(chains);
    let fleet = state.fleet.read();
    let indexed = fleet.overlaps_in(&matches, model).into_iter().max().unwrap_or(0) as usize;
    if indexed >= chains.len() {
        return indexed;
    }
    let placement = state.placement.lock();
    let speculative = fleet
        .workers
        .iter()
        .filter(|w| w.model == model)
        .filter_map(|w| w.ranks.first())
        .map(|r| placement.speculative.overlap(r.slot, chains, now))
        .max()
        .unwrap_or(0) as usize;
    indexed.max(speculative)
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
