//! Step 4 of a route call: the prompt's matches in the index, the workers' views, the pure
//! [`decide`], the booking and the placement record — under one hold of the fleet, load and
//! placement locks (taken in that order), so concurrent calls see each other's bookings and
//! placements. [`decide`] stays pure; this is the shell around it.

use std::sync::atomic::Ordering;
use std::time::Instant;

use kvmesh_core::api::{Mode, WorkerLoad};
use kvmesh_core::hashing::SequenceHash;

use super::bookings::Booking;
use super::front::Front;
use super::prompt::Prompt;
use super::record::RouteMetrics;
use super::request::RouteRequest;
use super::settle::Record;
use super::ApiError;
use crate::catalog::RouteModel;
use crate::config::{Config, IndexMode};
use crate::decide::{decide, DecideError, Leg, Plan, RouteInput, WorkerView};
use crate::index::{OverlapScores, TierBlocks, TierScores};
use crate::load::LoadTracker;
use crate::predict::{WorkerAdapters, WorkerTiming};
use crate::state::{AppState, Fleet, Placement};

/// Matches the prompt, decides and books the chosen worker; the booking is released if the call
/// is dropped before it settles.
pub fn decide_and_book<'a>(
    state: &'a AppState,
    cfg: &Config,
    req: &RouteRequest,
    model: &RouteModel,
    prompt: Prompt,
) -> Result<(Plan, Booking<'a>, Record), ApiError> {
    let metrics = RouteMetrics(&state.metrics);
    let t_match = Instant::now();
    let (scores, tiers) = {
        let index = state.index.read();
        let mut scores = index.find_matches(&prompt.chains);
        // Lower KV tiers continuing each GPU match (nothing to walk without tier events).
        let mut tiers = if cfg.routing.kv_tiers {
            index.find_lower_matches(&prompt.chains, &scores)
        } else {
            TierScores::new()
        };
        // Hybrid models: what every KV cache group can serve (one branch without any).
        let max_blocks = crate::predict::max_cached_blocks(prompt.tokens, model.block_size());
        index.cap_by_groups(&prompt.chains, max_blocks, &mut scores, &mut tiers);
        (scores, tiers)
    };
    metrics.matched(t_match.elapsed());

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
        block_size: model.block_size(),
        session: req.session,
        override_worker: req.override_worker.as_deref(),
        override_mode: req.override_mode,
        continuation,
        kv_home: kv_home.as_deref(),
        opens_conversation: prompt.opens_conversation,
        adapter: model.adapter.as_deref(),
    };
    let fleet = state.fleet.read();
    if let Some(other) = req
        .override_worker
        .as_deref()
        .and_then(|id| fleet.workers.iter().find(|w| w.cfg.id == id && w.model != model.base()))
    {
        return Err(ApiError::bad_request(
            OVERRIDE_OTHER_MODEL,
            format!(
                "override worker {} serves model {}, not {}",
                other.cfg.id,
                other.model,
                model.base()
            ),
        ));
    }
    let overlaps = fleet.overlaps_in(&scores, model.base());
    let mut load = state.load.lock();
    let mut placement = state.placement.lock();
    let request = ViewOf { model, chains: &prompt.chains, overlaps: &overlaps, front: &req.front };
    let mut views = views(&fleet, &request, &load, &placement, cfg, now);
    with_tiers(&mut views, &fleet, &scores, &tiers, &overlaps);
    let plan = decide(&input, &views, &cfg.routing, &mut placement.rng).map_err(|e| match e {
        DecideError::UnknownOverrideWorker(_) => ApiError::bad_request(e.reason(), e.to_string()),
        _ => ApiError::unavailable(e.reason(), e.to_string()),
    })?;
    // What the router saw of the prompt's cache, kept with the booking for `/v1/done`.
    let predicted = super::attribution::predicted(
        &views,
        plan.worker_index,
        input.max_cached_blocks(),
        model.block_size(),
    );
    drop(views);
    // A remote prefill leaves the decode worker only the KV pull; its prefill is booked on P.
    let prefill_tokens = if plan.mode == Mode::Disagg { 0 } else { plan.uncached_tokens };
    let booking = Booking::book(
        state,
        &mut load,
        &plan.worker,
        u64::from(plan.request_blocks),
        prefill_tokens,
        req.request_id.as_deref(),
        session_key,
    );
    drop(load);
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
            Some(Leg::PrefillOn { worker, .. }) => Some(worker.as_str()),
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
    // Backlog and speculative holdings for the next decisions (siblings see these blocks at once).
    let held = placed(&mut placement, &fleet, &plan, &prompt.chains, cfg, model, now);
    drop(placement);
    drop(fleet);
    // A burst of decisions between scrapes is placed on a stale view of the engines' queues
    // (other gateway replicas load them unseen): ask for an early scrape.
    let burst = cfg.routing.scrape_burst_decisions;
    if burst > 0 && state.decisions_since_scrape.fetch_add(1, Ordering::Relaxed) + 1 >= burst {
        state.scrape_soon.notify_one();
    }
    metrics.placed(&plan, t_score.elapsed(), held);
    state.metrics.adapter_placed(model.base(), plan.adapter);
    let record = Record {
        basis: plan.basis,
        local_continuation: plan.local_continuation,
        session_key,
        approx_slot,
        recover_on,
        chains: prompt.chains,
        locals: prompt.locals,
        model: model.clone(),
        predicted,
    };
    Ok((plan, booking, record))
}

/// The reason of a 400 for an override (`x-kvmesh-worker`) naming a worker of another model.
pub const OVERRIDE_OTHER_MODEL: &str = "override_other_model";

/// What [`views`] knows of the request: its resolved model (`model.adapter` is the adapter it
/// names), its prompt's block chains, and per worker (fleet order, [`Fleet::overlaps_in`]) the
/// leading blocks the index holds.
pub struct ViewOf<'r> {
    pub model: &'r RouteModel,
    pub chains: &'r [SequenceHash],
    pub overlaps: &'r [u32],
    /// The candidates the front door allows (a GIE gateway's subset hint).
    pub front: &'r Front,
}

/// The decision's view of every worker of the request's base model for one prompt, at `now`: the
/// only candidates of the decision, its prefill legs and migration sources, so no request is
/// placed on a worker that does not serve its model.
///
/// Timing per worker: throughput measured (else the default); prefill ahead = the booked
/// backlog still draining (at most the uncached tokens of its live bookings) plus what is left
/// of the requests the last scrape found waiting beyond this indexer's own not-yet-prefilled
/// ones ([`crate::predict::PrefillBacklog::reconcile`]); decode batch = the engine's running
/// requests, or the booked ones past prefill when that is more (the scrape lags).
pub fn views<'a>(
    fleet: &'a Fleet,
    request: &ViewOf<'_>,
    load: &LoadTracker,
    placement: &Placement,
    cfg: &Config,
    now: Instant,
) -> Vec<WorkerView<'a>> {
    let ViewOf { model, chains, overlaps, front } = *request;
    let r = &cfg.routing;
    // The request's model is a pool of its own: its arrivals are its own routes over its own
    // decoders. The fleet's rate over every decoder understated a busier model's (60 % of the
    // routes on half the workers: 1.2× the fleet mean) and overstated the other's.
    let decoders: Vec<&str> = fleet
        .workers
        .iter()
        .filter(|w| w.model == model.base() && w.cfg.role.decodes() && w.gets_traffic())
        .map(|w| w.cfg.id.as_str())
        .collect();
    let arrivals_per_s = placement.outlook.routes_per_s(decoders.iter().copied(), now)
        / decoders.len().max(1) as f64;
    fleet
        .workers
        .iter()
        .zip(overlaps)
        .filter(|(w, _)| w.model == model.base() && front.allows(&w.cfg.endpoint))
        .map(|(w, &overlap)| {
            let booked: WorkerLoad = load.worker(&w.cfg.id);
            let (running, waiting) = w
                .engine
                .as_ref()
                .map_or((0, 0), |e| (e.running.max(0.0) as u64, e.waiting.max(0.0) as u64));
            // Requests the engine runs that this indexer did not route (other gateways, direct
            // traffic) still load it: count them at the mean booked size, or a configured guess.
            let unseen = (running + waiting).saturating_sub(booked.active_requests);
            let per_request = booked
                .active_blocks
                .checked_div(booked.active_requests)
                .unwrap_or(r.unknown_request_blocks);
            let tps = fleet.prefill_tokens_per_s(w, r);
            let ahead = placement.backlog.ahead(&w.cfg.id, tps, now);
            let own_tokens = ahead.tokens.min(booked.prefill_tokens as f64);
            let speculative = w
                .ranks
                .first()
                .map_or(0, |rank| placement.speculative.overlap(rank.slot, chains, now));

            WorkerView {
                id: &w.cfg.id,
                endpoint: &w.cfg.endpoint,
                role: w.cfg.role,
                healthy: w.gets_traffic(),
                overlap_blocks: overlap,
                speculative_blocks: speculative,
                tier_blocks: TierBlocks::default(), // per prompt: `with_tiers`
                active_blocks: booked.active_blocks + unseen * per_request,
                active_requests: booked.active_requests,
                waiting_requests: waiting,
                timing: WorkerTiming {
                    queued_tokens: own_tokens + ahead.unseen_tokens,
                    decode_batch: running
                        .max(booked.active_requests.saturating_sub(ahead.requests)),
                    prefill_tokens_per_s: tps,
                    decode_step_s: w.decode_step_s(r),
                    arrivals_per_s,
                    utilization: placement.outlook.utilization(&w.cfg.id, tps, now),
                    adapter_delay_s: 0.0, // per request: the decision prices the adapter
                },
                recent_tokens_per_s: placement.outlook.tokens_per_s(&w.cfg.id, now),
                adapters: WorkerAdapters::of(
                    &w.cfg.id,
                    w.engine.as_ref(),
                    &w.meter,
                    &placement.adapters,
                    r.adapter_slot_wait_ms,
                    now,
                ),
            }
        })
        .collect()
}

/// Sets each view's lower-tier blocks: of the worker's rank whose GPU match is the worker's
/// overlap (`overlaps`, fleet order), its run continuing that match (`tiers`). The views are the
/// fleet's workers in fleet order, some left out.
fn with_tiers(
    views: &mut [WorkerView<'_>],
    fleet: &Fleet,
    scores: &OverlapScores,
    tiers: &TierScores,
    overlaps: &[u32],
) {
    if tiers.is_empty() {
        return;
    }
    let mut runs = vec![TierBlocks::default(); fleet.workers.len()];
    for &(slot, run) in tiers {
        let Some(&i) = fleet.slot_owner.get(&slot) else { continue };
        let gpu = scores.iter().find(|m| m.0 == slot).map_or(0, |m| m.1);
        if overlaps.get(i) == Some(&gpu) && run.total() > runs[i].total() {
            runs[i] = run;
        }
    }
    let mut views = views.iter_mut().peekable();
    for (w, run) in fleet.workers.iter().zip(runs) {
        if let Some(v) = views.next_if(|v| v.id == w.cfg.id) {
            v.tier_blocks = run;
        }
    }
}

/// Records a decision for the next ones: its prefill joins the backlog of the worker that
/// computes it (the prefill worker of a `disagg` plan, else the decode worker; not when it waits
/// for a LoRA slot there) and its blocks become speculative holdings of the workers that will
/// hold them, as its LoRA `adapter` becomes theirs for the next decisions' adapter cost. Returns
/// the speculative blocks held now.
fn placed(
    placement: &mut Placement,
    fleet: &Fleet,
    plan: &Plan,
    chains: &[SequenceHash],
    cfg: &Config,
    model: &RouteModel,
    now: Instant,
) -> usize {
    let worker = |id: &str| fleet.workers.iter().find(|w| w.cfg.id == id);
    let prefill_on = match (&plan.leg, plan.mode) {
        (Some(Leg::PrefillOn { worker, .. }), Mode::Disagg) => worker.as_str(),
        _ => plan.worker.as_str(),
    };
    let prompt_tokens = f64::from(plan.request_blocks) * f64::from(model.block_size());
    placement.outlook.routed(
        &plan.worker,
        prompt_tokens,
        prefill_on,
        plan.uncached_tokens as f64,
        now,
    );
    // A request that waits for a LoRA slot is not prefill ahead of the others: the engine
    // schedules the requests of the adapters holding the slots first, and when its slot frees is
    // not known (a slot frees when the last running request of an adapter finishes). Booked in
    // the FIFO it made the worker look busy with work it was not doing.
    let parked = prefill_on == plan.worker && plan.adapter.wait_slot;
    if let Some(w) = worker(prefill_on).filter(|_| !parked) {
        placement.backlog.add(
            prefill_on,
            plan.uncached_tokens as f64,
            fleet.prefill_tokens_per_s(w, &cfg.routing),
            now,
        );
    }
    let mut holders = vec![plan.worker.as_str()];
    if prefill_on != plan.worker {
        holders.push(prefill_on);
    }
    for id in holders {
        if let Some(adapter) = model.adapter.as_deref() {
            placement.adapters.routed(id, adapter, now);
        }
        if let Some(slot) = worker(id).and_then(|w| w.ranks.first()).map(|r| r.slot) {
            placement.speculative.record(slot, chains, now);
        }
    }
    placement.speculative.len()
}
