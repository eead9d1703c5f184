//! Steps 2 and 3: warming every path up, priming the continuation bases and shared prefixes
//! through kvmesh, and the request of sample `n` of a case.

use super::*;

pub(super) fn body(h: &History, model: &str) -> Vec<u8> {
    h.body(model, 1, true).to_string().into_bytes()
}

pub(super) struct Urls {
    pub(super) kvmesh: String,
    pub(super) plain: String,
    /// The ext_proc listener's, when it is measured.
    pub(super) ext_proc: Option<String>,
}

impl Urls {
    pub(super) fn of(&self, way: Way) -> &str {
        match way {
            Way::Kvmesh => &self.kvmesh,
            Way::Plain => &self.plain,
            // Not measured: no URL, so a request sent there fails instead of measuring another path.
            Way::ExtProc => self.ext_proc.as_deref().unwrap_or_default(),
        }
    }

    /// The paths measured, in the order of sample 0 (kvmesh paths first, plain last).
    pub(super) fn ways(&self) -> Vec<Way> {
        let mut w = vec![Way::Kvmesh];
        if self.ext_proc.is_some() {
            w.push(Way::ExtProc);
        }
        w.push(Way::Plain);
        w
    }
}

/// Whether a warm-up response shows its path routing through the indexer: a decision (or, for
/// bodies the filter routes locally with `local_route_max_body_bytes`, a worker named) and no
/// fallback.
fn routed(way: Way, o: &kvmesh_bench::client::Outcome) -> bool {
    o.error.is_none()
        && !routed_without_indexer(way, o.fallback.is_some(), o.decision_mode.is_some())
        && (o.decision_mode.is_some() || o.decision_worker.is_some())
}

/// Warm every path (connections, the filter's and the picker's fleet); fails when the filter or
/// the picker never routes through the indexer (or, for bodies the filter routes locally, never
/// names a worker).
pub(super) async fn warm_up(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    template: &History,
    seed: u64,
) -> Result<()> {
    let deadline = Instant::now() + kvmesh_e2e::poll::patience();
    let ways = urls.ways();
    // The kvmesh paths not yet seen routing through the indexer.
    let mut waiting: Vec<Way> = ways.iter().copied().filter(|w| *w != Way::Plain).collect();
    let mut n = 0u64;
    while n < WARMUP as u64 || !waiting.is_empty() {
        if Instant::now() > deadline {
            let names: Vec<&str> = waiting.iter().map(|w| w.tag()).collect();
            bail!(
                "warm-up: path(s) {names:?} (k = the filter, e = the picker) did not route through the indexer in time"
            );
        }
        let h = cold_request(template, cold_seed(seed, 9, 0, n));
        for &way in &ways {
            let o = tagged(
                client,
                urls.of(way),
                body(&h, model),
                &format!("warm-{n}-{}", way.tag()),
                SAMPLE_TIMEOUT,
            )
            .await;
            if let Some(e) = &o.error {
                tracing::warn!(path = way.tag(), error = %e, "warm-up request failed");
            } else if routed(way, &o) {
                waiting.retain(|w| *w != way);
            }
        }
        n += 1;
    }
    Ok(())
}

/// Sends one base's priming requests through kvmesh; returns how many were routed without the
/// indexer.
pub(super) async fn prime_one(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    base: &kvmesh_bench::overhead::cases::Base,
    what: &str,
) -> u64 {
    let mut fallbacks = 0;
    for (i, h) in base.primes.iter().enumerate() {
        let o = tagged(
            client,
            &urls.kvmesh,
            body(h, model),
            &format!("prime-{what}-{i}"),
            SAMPLE_TIMEOUT,
        )
        .await;
        fallbacks += u64::from(o.fallback.is_some());
        if let Some(e) = o.error {
            tracing::warn!(base = what, step = i, error = %e, "priming request failed");
        }
    }
    fallbacks
}

/// Primes every continuation base and every shared prefix through kvmesh; returns the bases per
/// size, the shared prefixes, and how many priming requests were routed without the indexer.
pub(super) async fn prime(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadSettings,
    shape: &Shape,
) -> (Vec<Vec<History>>, Vec<History>, u64) {
    let mut all = Vec::new();
    let mut fallbacks = 0;
    for (si, size) in args.sizes.iter().enumerate() {
        let mut bases = Vec::new();
        for b in 0..args.bases.max(1) {
            let base = base_conversation(base_seed(args.seed, si, b), size.tokens, shape);
            fallbacks +=
                prime_one(client, urls, model, &base, &format!("{}-{b}", size.label)).await;
            bases.push(base.base);
        }
        all.push(bases);
    }
    let mut shared = Vec::new();
    for (si, size) in args.shared_prefixes.iter().enumerate() {
        let base = base_conversation(shared_prefix_seed(args.seed, si), size.tokens, shape);
        fallbacks += prime_one(client, urls, model, &base, &format!("shared-{}", size.label)).await;
        shared.push(base.base);
    }
    (all, shared, fallbacks)
}

/// The conversations requests are made from, per size: cold templates and continuation bases;
/// per shared-prefix size: the prefix.
pub(super) struct Texts {
    pub(super) cold: Vec<History>,
    pub(super) bases: Vec<Vec<History>>,
    pub(super) shared: Vec<History>,
}

pub(super) fn request_for(
    case: &Case,
    size_index: usize,
    texts: &Texts,
    n: u64,
    way: Way,
    args: &OverheadSettings,
    shape: &Shape,
) -> History {
    let bases = &texts.bases;
    // Distinct content per request and path: no path's request warms another's.
    let lane = 3 * n + way.index();
    match case.kind {
        Kind::Cold => {
            cold_request(&texts.cold[size_index], cold_seed(args.seed, 0, size_index, lane))
        }
        Kind::Continuation => {
            let list = &bases[size_index];
            next_turn(&list[(n as usize) % list.len()], lane, shape)
        }
        Kind::SharedPrefix => {
            shared_prefix_request(&texts.shared[size_index], args.bases, n, way.index(), shape).0
        }
    }
}

/// Steps 2 and 3: warms both paths up, primes the bases and shared prefixes; the texts and the
/// priming requests routed without the indexer.
pub(super) async fn prime_texts(
    client: &reqwest::Client,
    urls: &Urls,
    model: &str,
    args: &OverheadSettings,
    shape: &Shape,
) -> Result<(Arc<Texts>, u64)> {
    let cold: Vec<History> = args.sizes.iter().map(|s| cold_template(s.tokens, shape)).collect();
    warm_up(client, urls, model, &cold_template(512, shape), args.seed).await?;
    let started = Instant::now();
    let (bases, shared, prime_fallbacks) = prime(client, urls, model, args, shape).await;
    let texts = Arc::new(Texts { cold, bases, shared });
    tracing::info!(
        prime_s = started.elapsed().as_secs_f64(),
        prime_fallbacks,
        "overhead: bases primed"
    );
    Ok((texts, prime_fallbacks))
}
