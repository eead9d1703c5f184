//! The router-overhead workload (pure): which cases, and the chat requests each one sends.
//!
//! A case is a prompt size (about 1k, 8k, 32k, 100k tokens) × cold or continuation, plus
//! shared-prefix sizes (about 8k, 48k tokens):
//! - **cold**: a new conversation in which every message starts with the request's own seed, so
//!   neither the indexer's tokenization cache (keyed by message pieces) nor any engine's prefix
//!   cache has seen any of it. The text behind the seeds is one template per size: making a cold
//!   request copies strings instead of generating text, so the requests/s client keeps up;
//! - **continuation**: an existing conversation (a *base*, ending with a user message) that was
//!   routed through kvmesh before, plus the assistant's reply and a new user message — the next
//!   turn. Bases are primed the way conversations grow: prefixes ending with a user message, each
//!   adding at most [`Shape::prime_step_tokens`], so no priming request is a giant cold one;
//! - **shared prefix**: one long prefix (a base, primed the same way) shared by many conversations,
//!   each growing turn by turn on top of it (a reply and a short new user message per turn, every
//!   turn's prompt extending the previous one's) for [`Shape::shared_turns`] turns — the multi-turn
//!   case Dynamo's tokenizer prefix cache is measured on. The new text per request is one turn, so
//!   the router's cost should follow the turn, not the prefix.
//!
//! Sizes are reached by estimating tokens from words ([`Shape::tokens_per_word`], measured for
//! the DeepSeek tokenizer on `chat::text`); the report shows the engines' real
//! `usage.prompt_tokens`. Everything random comes from SplitMix64 seeds, so a case's requests do
//! not depend on timing.

use crate::chat::{text, History};
use crate::rng::{mix, SplitMix64};

/// Header that tags a request so its line in Envoy's access log can be found.
pub const BENCH_ID_HEADER: &str = "x-kvmesh-bench-id";
/// Header that selects the canned-response route (nothing forwarded), used for requests/s.
pub const UPSTREAM_HEADER: &str = "x-kvmesh-bench-upstream";
/// [`UPSTREAM_HEADER`] value of the canned-response route.
pub const UPSTREAM_NONE: &str = "none";

/// Cold or continuation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A new conversation, nothing seen.
    Cold,
    /// The next turn of a conversation whose earlier turns were routed.
    Continuation,
    /// A turn of one of many conversations growing on a long shared prefix.
    SharedPrefix,
}

impl Kind {
    /// Name used in case names.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Cold => "cold",
            Self::Continuation => "continuation",
            Self::SharedPrefix => "shared_prefix",
        }
    }
}

/// A prompt size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Size {
    /// As written on the command line (`8k`).
    pub label: String,
    /// Target prompt tokens (`k` = 1,024).
    pub tokens: usize,
}

/// Largest size accepted (the simulators' default context is 128k tokens).
pub const MAX_TOKENS: usize = 128 * 1024;

/// Parses `1k,8k,32k` (or plain token counts such as `1000`).
pub fn parse_sizes(s: &str) -> Result<Vec<Size>, String> {
    let mut out: Vec<Size> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let lower = part.to_ascii_lowercase();
        let (digits, mult) = match lower.strip_suffix('k') {
            Some(d) => (d, 1024),
            None => (lower.as_str(), 1),
        };
        let n: usize =
            digits.parse().map_err(|_| format!("bad size {part:?} (e.g. 1k, 8k, 32k, 1000)"))?;
        let tokens = n.saturating_mul(mult);
        if !(256..=MAX_TOKENS).contains(&tokens) {
            return Err(format!("size {part:?} must be within 256..={MAX_TOKENS} tokens"));
        }
        if out.iter().any(|x| x.label == lower) {
            return Err(format!("size {part:?} given twice"));
        }
        out.push(Size { label: lower, tokens });
    }
    if out.is_empty() {
        return Err("no overhead size given".into());
    }
    Ok(out)
}

/// Like [`parse_sizes`], but `""` or `none` is no size at all (the shared-prefix cases are optional).
pub fn parse_optional_sizes(s: &str) -> Result<Vec<Size>, String> {
    match s.trim() {
        "" | "none" => Ok(Vec::new()),
        t => parse_sizes(t),
    }
}

/// One measured case.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Case {
    /// The prompt size.
    pub size: Size,
    /// Cold or continuation.
    pub kind: Kind,
}

impl Case {
    /// `chat_<size>_<kind>`, e.g. `chat_8k_continuation` (the name the target reads).
    pub fn name(&self) -> String {
        format!("chat_{}_{}", self.size.label, self.kind.as_str())
    }
}

/// Every size cold, then as a continuation; then every shared-prefix size.
pub fn cases(sizes: &[Size], shared: &[Size]) -> Vec<Case> {
    let mut out: Vec<Case> = sizes
        .iter()
        .flat_map(|s| [Kind::Cold, Kind::Continuation].map(|kind| Case { size: s.clone(), kind }))
        .collect();
    out.extend(shared.iter().map(|s| Case { size: s.clone(), kind: Kind::SharedPrefix }));
    out
}

/// How conversations are shaped.
#[derive(Debug, Clone, PartialEq)]
pub struct Shape {
    /// Prompt tokens per word of `chat::text` (DeepSeek tokenizer, template included).
    pub tokens_per_word: f64,
    /// Template tokens each message adds (role and end markers).
    pub tokens_per_message: f64,
    /// Words of the system prompt.
    pub system_words: usize,
    /// Words of a user message in the history.
    pub user_words: usize,
    /// Words of an assistant reply in the history.
    pub assistant_words: usize,
    /// Words of the reply appended by the measured turn.
    pub tail_assistant_words: usize,
    /// Words of the new user message of the measured turn.
    pub tail_user_words: usize,
    /// Most new tokens one priming request adds to a base.
    pub prime_step_tokens: usize,
    /// Tokens the cold request's per-message tag (`<8 letters>: `) adds to each message.
    pub cold_tag_tokens: f64,
    /// Turns a shared-prefix conversation grows before a new one starts from the prefix (bounds
    /// the prompt's growth to this many turns of the measured turn's size).
    pub shared_turns: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Self {
            tokens_per_word: 1.1,
            tokens_per_message: 2.0,
            system_words: 250,
            user_words: 120,
            assistant_words: 200,
            tail_assistant_words: 60,
            tail_user_words: 40,
            prime_step_tokens: 4096,
            cold_tag_tokens: 6.0,
            shared_turns: 8,
        }
    }
}

impl Shape {
    fn tokens(&self, words: usize) -> f64 {
        words as f64 * self.tokens_per_word + self.tokens_per_message
    }

    /// Estimated tokens the measured turn adds to its base.
    pub fn tail_tokens(&self) -> f64 {
        self.tokens(self.tail_assistant_words) + self.tokens(self.tail_user_words)
    }
}

/// A base conversation and the requests that prime it.
#[derive(Debug, Clone, PartialEq)]
pub struct Base {
    /// Prefixes to send in order before measuring; the last one is the base itself.
    pub primes: Vec<History>,
    /// The conversation so far, ending with a user message.
    pub base: History,
}

/// A conversation of about `tokens − tail` tokens that ends with a user message, unique from its
/// first word (the seed is written into the system prompt's opening).
pub fn base_conversation(seed: u64, tokens: usize, shape: &Shape) -> Base {
    let mut rng = SplitMix64::new(mix(seed, 0xBA5E));
    let system = format!("Session {seed:016x}. {}", text(&mut rng, shape.system_words));
    let mut h = History::new(&system);
    let target = (tokens as f64 - shape.tail_tokens())
        .max(shape.tokens(shape.system_words) + shape.tokens(8));
    let mut est = shape.tokens(shape.system_words);
    let mut primed_at = 0.0;
    let mut primes = Vec::new();
    let turn = shape.tokens(shape.user_words) + shape.tokens(shape.assistant_words);
    loop {
        let remaining = target - est;
        if remaining <= turn {
            // The last user message takes what is left, so the base lands near the target.
            let words =
                ((remaining - shape.tokens_per_message) / shape.tokens_per_word).max(8.0) as usize;
            h.push_user(&text(&mut rng, words));
            break;
        }
        h.push_user(&text(&mut rng, shape.user_words));
        est += shape.tokens(shape.user_words);
        // Two turns of look-ahead: the next user message may be the last, which can take up to
        // a whole turn, and no step may exceed `prime_step_tokens`.
        if est - primed_at + 2.0 * turn > shape.prime_step_tokens as f64 {
            primes.push(h.clone());
            primed_at = est;
        }
        h.push_assistant(&text(&mut rng, shape.assistant_words));
        est += shape.tokens(shape.assistant_words);
    }
    primes.push(h.clone());
    Base { primes, base: h }
}

/// The measured turn: `base` + an assistant reply + a new user message, unique per `seed`.
pub fn next_turn(base: &History, seed: u64, shape: &Shape) -> History {
    let mut rng = SplitMix64::new(mix(seed, 0x7A11));
    let mut h = base.clone();
    h.push_assistant(&text(&mut rng, shape.tail_assistant_words));
    h.push_user(&format!("Follow-up {seed:x}: {}", text(&mut rng, shape.tail_user_words)));
    h
}

/// Request `n` of a shared-prefix case: `prefix` (ending with a user message) plus the turns of
/// conversation `(salt, id)` up to and including turn `t`, where `conversations` conversations
/// are interleaved (`n % conversations`, so consecutive requests belong to different ones) and
/// each runs [`Shape::shared_turns`] turns before the next generation of conversations starts.
/// Turn `t`'s prompt extends turn `t − 1`'s by one reply and one new user message, as a
/// conversation grows; every request's last turn is new. Returns the history and its turn.
pub fn shared_prefix_request(
    prefix: &History,
    conversations: usize,
    n: u64,
    salt: u64,
    shape: &Shape,
) -> (History, u64) {
    let k = conversations.max(1) as u64;
    let turns = shape.shared_turns.max(1) as u64;
    let t = (n / k) % turns;
    let id = (n / (k * turns)) * k + n % k;
    let mut h = prefix.clone();
    for i in 0..=t {
        let mut rng = SplitMix64::new(mix(mix(mix(salt, 0x5AED), id), i));
        h.push_assistant(&text(&mut rng, shape.tail_assistant_words));
        h.push_user(&format!("Turn {id:x}.{i}: {}", text(&mut rng, shape.tail_user_words)));
    }
    (h, t)
}

/// Seed of the shared prefix of shared-prefix size `size_index` (distinct from bases and cold seeds).
pub fn shared_prefix_seed(run_seed: u64, size_index: usize) -> u64 {
    mix(mix(run_seed, 0x5000), size_index as u64)
}

/// Seed of the cold templates' text.
const COLD_TEMPLATE_SEED: u64 = 0xC01D;

/// The conversation cold requests of about `tokens` tokens are made from: a base plus one turn,
/// the same shape as a continuation of the same size, shortened by what the tags add.
pub fn cold_template(tokens: usize, shape: &Shape) -> History {
    let make = |t: usize| {
        next_turn(&base_conversation(COLD_TEMPLATE_SEED, t, shape).base, COLD_TEMPLATE_SEED, shape)
    };
    let tags = make(tokens).len() as f64 * shape.cold_tag_tokens;
    make((tokens as f64 - tags).max(256.0) as usize)
}

/// Eight lowercase letters naming `seed` (letters tokenize into fewer tokens than hex digits).
pub fn tag(seed: u64) -> String {
    let mut x = seed;
    (0..8)
        .map(|_| {
            let c = char::from(b'a' + (x % 26) as u8);
            x /= 26;
            c
        })
        .collect()
}

/// Cold request `seed`: `template` with [`tag`]`(seed)` written at the start of every message,
/// so every message — and the prompt's first block — is new.
pub fn cold_request(template: &History, seed: u64) -> History {
    let t = tag(seed);
    History::from_messages(
        template.messages().iter().map(|(r, c)| (r.clone(), format!("{t}: {c}"))).collect(),
    )
}

/// Seed of base `b` of size `size_index` (distinct from every cold seed).
pub fn base_seed(run_seed: u64, size_index: usize, b: usize) -> u64 {
    mix(mix(run_seed, 0xB000 + size_index as u64), b as u64)
}

/// Seed of the `n`-th cold conversation of a phase (latency or requests/s) of size `size_index`.
pub fn cold_seed(run_seed: u64, phase: u64, size_index: usize, n: u64) -> u64 {
    mix(mix(mix(run_seed, 0xC000 + phase), size_index as u64), n)
}

/// Estimated prompt tokens of a history (for tests and sanity checks; the engines report the truth).
pub fn estimate_tokens(h: &History, shape: &Shape) -> f64 {
    h.messages().iter().map(|(_, c)| shape.tokens(c.split_whitespace().count())).sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse() {
        let s = parse_sizes("1k, 8K,32k,100k").unwrap();
        assert_eq!(s.iter().map(|x| x.tokens).collect::<Vec<_>>(), [1024, 8192, 32768, 102_400]);
        assert_eq!(s[1].label, "8k");
        assert_eq!(parse_sizes("1000").unwrap()[0].tokens, 1000);
        for bad in ["", "x", "8k,8k", "100", "1024k"] {
            assert!(parse_sizes(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn case_names_match_the_target() {
        let names = |sizes: &str, shared: &str| -> Vec<String> {
            cases(&parse_sizes(sizes).unwrap(), &parse_optional_sizes(shared).unwrap())
                .iter()
                .map(Case::name)
                .collect()
        };
        let plain = names("1k,8k", "none");
        assert_eq!(
            plain,
            ["chat_1k_cold", "chat_1k_continuation", "chat_8k_cold", "chat_8k_continuation"]
        );
        assert!(plain.contains(&crate::report::targets::OVERHEAD_TARGET_CASE.to_string()));
        let shared = names("1k", "8k,48k");
        assert_eq!(
            shared,
            [
                "chat_1k_cold",
                "chat_1k_continuation",
                "chat_8k_shared_prefix",
                "chat_48k_shared_prefix"
            ]
        );
        assert_eq!(parse_optional_sizes(" none ").unwrap(), []);
        assert_eq!(parse_optional_sizes("").unwrap(), []);
        assert!(parse_optional_sizes("48k,48k").is_err());
    }

    #[test]
    fn shared_prefix_turns_grow_one_turn_at_a_time_on_the_prefix() {
        let shape = Shape::default();
        let prefix = base_conversation(shared_prefix_seed(0, 1), 48 * 1024, &shape).base;
        let est = estimate_tokens(&prefix, &shape);
        assert!((est - 48.0 * 1024.0).abs() < 0.05 * 48.0 * 1024.0, "prefix estimated {est}");
        let k = 4usize;
        let turns = shape.shared_turns as u64;
        let req = |n: u64| shared_prefix_request(&prefix, k, n, 9, &shape);
        for n in 0..3 * k as u64 * turns {
            let (h, t) = req(n);
            assert_eq!(
                h.messages()[..prefix.len()],
                *prefix.messages(),
                "{n}: starts with the prefix"
            );
            assert_eq!(h.len(), prefix.len() + 2 * (t as usize + 1), "{n}: turn {t}");
            assert_eq!(t, (n / k as u64) % turns);
            // The same conversation's previous turn is a prefix of this one (the conversation grows).
            if t > 0 {
                let (prev, pt) = req(n - k as u64);
                assert_eq!(pt, t - 1);
                assert_eq!(h.messages()[..prev.len()], *prev.messages(), "{n}: extends turn {pt}");
            }
            // The new text per request is one turn, the size of a continuation's.
            let added = estimate_tokens(&h, &shape) - estimate_tokens(&prefix, &shape);
            assert!(
                added <= (t + 1) as f64 * (shape.tail_tokens() + 12.0),
                "{n}: {added} tokens on the prefix"
            );
        }
        // Every request is distinct: a new generation of conversations starts after `turns` turns.
        let all: std::collections::HashSet<Vec<(String, String)>> =
            (0..3 * k as u64 * turns).map(|n| req(n).0.messages().to_vec()).collect();
        assert_eq!(all.len(), 3 * k * turns as usize);
        assert_ne!(
            shared_prefix_request(&prefix, k, 0, 1, &shape).0,
            req(0).0,
            "the salt separates phases and paths"
        );
        assert_ne!(shared_prefix_seed(0, 0), base_seed(0, 0, 0));
    }

    #[test]
    fn conversations_reach_their_size_and_prime_in_steps() {
        let shape = Shape::default();
        for tokens in [1024usize, 8192, 32768, 102_400] {
            let b = base_conversation(7, tokens, &shape);
            let full = next_turn(&b.base, 1, &shape);
            let est = estimate_tokens(&full, &shape);
            assert!(
                (est - tokens as f64).abs() < 0.05 * tokens as f64 + 40.0,
                "{tokens}: estimated {est}"
            );
            assert_eq!(b.primes.last(), Some(&b.base));
            // Each priming request adds at most one step (plus one turn of slack).
            let mut prev = 0.0;
            for p in &b.primes {
                let t = estimate_tokens(p, &shape);
                assert!(
                    t - prev <= shape.prime_step_tokens as f64 + 1.0,
                    "{tokens}: step {prev} -> {t}"
                );
                prev = t;
            }
            assert_eq!(b.base.messages().last().unwrap().0, "user");
        }
    }

    #[test]
    fn requests_are_deterministic_and_unique() {
        let shape = Shape::default();
        let template = cold_template(2048, &shape);
        let a = cold_request(&template, 1);
        assert_eq!(a, cold_request(&template, 1));
        let b = cold_request(&template, 2);
        assert_eq!(a.len(), template.len());
        for ((ma, mb), mt) in a.messages().iter().zip(b.messages()).zip(template.messages()) {
            assert_eq!(ma.0, mt.0);
            assert!(
                ma.1 != mb.1 && ma.1 != mt.1 && ma.1[..8] != mb.1[..8],
                "every message is new from its first word"
            );
        }
        let base = base_conversation(3, 2048, &shape).base;
        let t1 = next_turn(&base, 1, &shape);
        let t2 = next_turn(&base, 2, &shape);
        assert_ne!(t1, t2);
        assert_eq!(t1.len(), base.len() + 2);
        assert_ne!(base_seed(0, 0, 1), cold_seed(0, 0, 0, 1));
        assert_eq!(tag(0), "aaaaaaaa");
        assert_eq!(tag(27), "bbaaaaaa");
        assert_ne!(tag(cold_seed(0, 0, 0, 1)), tag(cold_seed(0, 0, 0, 2)));
    }
}
