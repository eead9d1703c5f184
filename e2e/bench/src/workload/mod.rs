//! The load-sweep workloads: one schedule type for all seven, and each schedule's intrinsic ceiling (pure).
//!
//! A [`Schedule`] is a list of [`Session`]s. A session starts at `start_ms` (open loop: Poisson or
//! trace arrivals at the point's rate) and runs its turns in order, closed loop: turn `k + 1` is
//! sent `think_ms` after turn `k` completed, as a client that waits for the answer does. A
//! single-turn session is an open-loop request. Every turn's prompt is a prefix of its
//! session's content (`upto` messages or tokens), so a conversation is stored once however many
//! turns it has.
//!
//! Assistant replies in a chat history are **planned text**, not the engine's reply: the prompt
//! of every turn is then known before the run, so the ceiling below is exact and every policy
//! gets byte-identical requests. (The engine also caches the blocks it generated; with planned
//! replies those are never reused, as with a client that edits the reply.)
//!
//! **Ceiling.** Infinite cache, perfect routing, caches empty at the start: a prompt segment hits
//! iff the same prefix (chain of segments up to and including it) was in an earlier prompt. For
//! chat prompts a segment is one message weighted by its content bytes; for token prompts it is
//! one engine block (`block_size` tokens, the last one partial) weighted by its tokens — the
//! trace too (the engines count tokens in their blocks, not the trace's 512-token blocks). Prompts
//! are ordered by their planned send time (start + think times, engine time not known in
//! advance), which is exact within a session and for the first use of a shared prefix; the
//! steady-state points count their window against the prompts actually sent before it
//! ([`ceiling_with_history`]).
//!
//! **Fleet-LRU reference.** The ceiling's cache is infinite; the engines' is not. For token
//! prompts [`fleet_lru`] replays the same prompts in the same order through one LRU cache of the
//! whole fleet's capacity — every worker's blocks pooled, nothing duplicated, every prompt routed
//! to it. Under memory pressure that is what placement alone can be expected to reach: a router
//! whose hits are near it is limited by the cache, not by where it sends requests. A reference,
//! not a bound (LRU is not the optimal eviction, and per-worker caches evict differently).
//!
//! **TTFT floor.** [`per_prompt_ceiling`] gives each prompt's uncached tokens on an engine that
//! holds everything the ceiling counts as reused; at the engines' prefill throughput, with no
//! queue, that is the least time to first token any router can give it
//! (`sweep::point_ttft_floor_p90_ms`).
//!
//! Generators live in `gen` (agentic chat, sibling bursts, paced sessions, cold single-turn) and
//! `trace` (the Mooncake conversation trace), `models` (several models and their adapters),
//! `tiers` (shared documents beyond the GPU cache, within GPU + CPU); all randomness is SplitMix64
//! from a seed.

pub mod gen;
pub mod models;
pub mod tiers;
pub mod trace;

use crate::ceiling::Ceiling;
use kvmesh_core::hashing::xxh3;
use serde_json::{json, Value};
use std::collections::HashSet;

/// The seven workloads of the sweep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WorkloadKind {
    /// The Mooncake conversation trace, a window compressed into the point and thinned by
    /// conversation to the point's request rate.
    Trace,
    /// Agentic chat: a few 16–32 KB system prompts shared by many conversations, 5–30 turns,
    /// tool-call turns carrying long tool outputs.
    Agentic,
    /// Sibling bursts: 4–8 parallel requests of the same new prompt (best-of-n).
    Siblings,
    /// Paced sessions: 10–60 s think time between turns (divided by the sim speed-up).
    Paced,
    /// Cold single-turn: distinct 4–16k-token prompts, nothing to reuse.
    Cold,
    /// Several models (issue 44): agentic chats over two base models and their Zipf-popular
    /// LoRA adapters, system prompts shared by a base model's adapters (`models`).
    Models,
    /// Offload tiers (issue 46): shared documents whose working set exceeds the fleet's GPU KV
    /// cache and fits GPU + CPU, on a fleet with a CPU tier (`tiers`).
    Tiers,
}

impl WorkloadKind {
    /// Every workload, in report order.
    pub const ALL: [WorkloadKind; 7] = [
        Self::Trace,
        Self::Agentic,
        Self::Siblings,
        Self::Paced,
        Self::Cold,
        Self::Models,
        Self::Tiers,
    ];

    /// Name in files, flags and the report.
    pub fn name(self) -> &'static str {
        match self {
            Self::Trace => "trace",
            Self::Agentic => "agentic",
            Self::Siblings => "siblings",
            Self::Paced => "paced",
            Self::Cold => "cold",
            Self::Models => "models",
            Self::Tiers => "tiers",
        }
    }

    /// Parses a name.
    pub fn parse(s: &str) -> Result<Self, String> {
        Self::ALL.into_iter().find(|k| k.name() == s.trim()).ok_or_else(|| {
            format!("unknown workload {s:?}; known: {}", Self::ALL.map(Self::name).join(", "))
        })
    }

    /// Parses a comma-separated list (order kept, duplicates refused).
    pub fn parse_list(s: &str) -> Result<Vec<Self>, String> {
        let mut out = Vec::new();
        for part in s.split(',').filter(|p| !p.trim().is_empty()) {
            let k = Self::parse(part)?;
            if out.contains(&k) {
                return Err(format!("workload {} listed twice", k.name()));
            }
            out.push(k);
        }
        if out.is_empty() {
            return Err("no workload given".into());
        }
        Ok(out)
    }

    /// Whether requests carry a conversation id a session header can send.
    pub fn has_sessions(self) -> bool {
        matches!(self, Self::Trace | Self::Agentic | Self::Paced | Self::Models)
    }

    /// Whether a point measures steady state after a warm-up (`crate::sweep::MeasureWindow`):
    /// the multi-turn workloads whose sessions outlive a point's window.
    pub fn steady_state(self) -> bool {
        matches!(self, Self::Agentic | Self::Paced | Self::Models)
    }

    /// What the rate of a sweep point counts.
    pub fn rate_unit(self) -> &'static str {
        match self {
            Self::Trace | Self::Cold | Self::Tiers => "requests/s",
            Self::Agentic | Self::Paced | Self::Models => "sessions/s",
            Self::Siblings => "bursts/s",
        }
    }

    /// One line for the report.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Trace => "Mooncake conversation trace: its first minutes compressed into the point, thinned by whole conversations to the rate (token-id prompts)",
            Self::Agentic => "agentic chat: 3 shared system prompts of 16–32 KB, 5–30 turns, 60% tool-call turns with 1–6 KB tool outputs",
            Self::Siblings => "sibling bursts: 4–8 parallel identical requests of a new 2–8k-token prompt (best-of-n), Poisson bursts",
            Self::Paced => "paced sessions: 3–8 turns, 10–60 s think time between turns (÷ sim speed-up), 2 KB shared system prompts",
            Self::Cold => "cold single-turn: distinct 4–16k-token prompts, Poisson arrivals, nothing to reuse",
            Self::Models => "several models: agentic chats, 60% deepseek-v4 (+3 adapters) / 40% deepseek-v4-mini (+2 adapters), the base or an adapter Zipf(1.1)-popular, 2 system prompts of 16–32 KB per base model shared by its adapters",
            Self::Tiers => "offload tiers: 64 shared documents of 3–5k tokens (~256k tokens: twice the fleet's GPU KV, within GPU + CPU) drawn uniformly, each request one plus a 32–160-token question, Poisson arrivals; workers with 2,048 GPU and 4,096 CPU-tier blocks",
        }
    }
}

/// One chat message (OpenAI shape; `tool_calls` on an assistant turn, `tool_call_id` on a tool output).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatMsg {
    /// `system`, `user`, `assistant`, `tool`.
    pub role: &'static str,
    /// The text.
    pub content: String,
    /// Assistant tool call `(id, function name, JSON arguments)`.
    pub tool_call: Option<(String, String, String)>,
    /// Tool output: the call it answers.
    pub tool_call_id: Option<String>,
}

impl ChatMsg {
    /// A plain message.
    pub fn new(role: &'static str, content: String) -> Self {
        Self { role, content, tool_call: None, tool_call_id: None }
    }

    fn to_json(&self) -> Value {
        let mut m = json!({"role": self.role, "content": self.content});
        if let Some((id, name, args)) = &self.tool_call {
            m["tool_calls"] = json!([{"id": id, "type": "function", "function": {"name": name, "arguments": args}}]);
        }
        if let Some(id) = &self.tool_call_id {
            m["tool_call_id"] = json!(id);
        }
        m
    }
}

/// A session's content; each turn sends a prefix of it.
#[derive(Debug, Clone, PartialEq)]
pub enum Content {
    /// Token ids through `/v1/completions`.
    Tokens(Vec<u32>),
    /// Chat messages through `/v1/chat/completions`.
    Chat(Vec<ChatMsg>),
}

/// One turn of a session.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// The prompt is the content's first `upto` messages / tokens.
    pub upto: usize,
    /// Wait after the previous turn completed, ms (ignored for the first turn).
    pub think_ms: f64,
    /// `max_tokens`.
    pub max_tokens: u32,
}

/// One session (a single-turn session is one open-loop request).
#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// Conversation id (sent in the session header by the policies that use one).
    pub id: String,
    /// When the first turn is due, ms from the start of the point.
    pub start_ms: f64,
    /// The content every turn sends a prefix of.
    pub content: Content,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// The `model` its requests name (a base model or a LoRA adapter, [`WorkloadKind::Models`]);
    /// `None`: the sweep's one model.
    pub model: Option<String>,
}

impl Session {
    /// The request path for this session's turns.
    pub fn path(&self) -> &'static str {
        match self.content {
            Content::Tokens(_) => "/v1/completions",
            Content::Chat(_) => "/v1/chat/completions",
        }
    }

    /// Request body of turn `t` (streaming, usage, `ignore_eos`), naming the session's own model,
    /// else `model`. `None` past the last turn.
    pub fn body(&self, t: usize, model: &str) -> Option<Value> {
        let turn = self.turns.get(t)?;
        let model = self.model.as_deref().unwrap_or(model);
        let mut body = match &self.content {
            Content::Tokens(ids) => {
                json!({"model": model, "prompt": &ids[..turn.upto.min(ids.len())]})
            }
            Content::Chat(msgs) => {
                let m: Vec<Value> =
                    msgs[..turn.upto.min(msgs.len())].iter().map(ChatMsg::to_json).collect();
                json!({"model": model, "messages": m})
            }
        };
        body["max_tokens"] = json!(turn.max_tokens.max(1));
        body["stream"] = json!(true);
        body["stream_options"] = json!({"include_usage": true});
        body["ignore_eos"] = json!(true);
        Some(body)
    }

    /// Planned send times of the turns: start + think times (engine time unknown in advance).
    pub fn scheduled_times_ms(&self) -> Vec<f64> {
        let mut t = self.start_ms;
        self.turns
            .iter()
            .enumerate()
            .map(|(i, turn)| {
                if i > 0 {
                    t += turn.think_ms;
                }
                t
            })
            .collect()
    }
}

/// One sweep point's workload: every session it sends, each with its start time and turns, at
/// the point's rate (what `schedule_run` sends).
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// Which workload.
    pub kind: WorkloadKind,
    /// The point's rate, in `kind.rate_unit()`.
    pub rate: f64,
    /// The sessions, by start time.
    pub sessions: Vec<Session>,
    /// The intrinsic ceiling of exactly these prompts.
    pub ceiling: Ceiling,
    /// What the ceiling's units are (`tokens`, `content bytes`, `tokens in engine blocks`).
    pub ceiling_unit: &'static str,
}

impl Schedule {
    /// Requests in the schedule.
    pub fn requests(&self) -> usize {
        self.sessions.iter().map(|s| s.turns.len()).sum()
    }

    /// The ceiling the report compares engine hit rates with: weighted like the engines count
    /// (tokens; content bytes for chat prompts, whose tokens the client does not know).
    pub fn ceiling_rate(&self) -> f64 {
        self.ceiling.token_rate()
    }
}

/// Seed of a model name's chain root (any constant: it only keeps models apart).
const MODEL_CHAIN_SEED: u64 = 0x6d6f_6465_6c73;

/// One prompt's segments: `(chain id, weight)`; the chain id covers the segment and every one
/// before it in the same prompt.
pub type Segments = Vec<(u64, u64)>;

/// Segments of turn `t` of `s`: chat messages weighted by content bytes, or engine blocks of
/// `block_size` tokens weighted by their tokens. A session naming its own model seeds its chain
/// with that name: distinct models and adapters never share a prefix, as in the engines (whose
/// block hashes are keyed by the adapter); sessions of the sweep's one model keep seed 0.
pub fn segments(s: &Session, t: usize, block_size: usize) -> Segments {
    let Some(turn) = s.turns.get(t) else { return Vec::new() };
    let mut out = Vec::new();
    let mut parent = s.model.as_deref().map_or(0, |m| xxh3(m.as_bytes(), MODEL_CHAIN_SEED));
    match &s.content {
        Content::Tokens(ids) => {
            for block in ids[..turn.upto.min(ids.len())].chunks(block_size.max(1)) {
                let bytes: Vec<u8> = block.iter().flat_map(|x| x.to_le_bytes()).collect();
                parent = xxh3(&bytes, parent);
                out.push((parent, block.len() as u64));
            }
        }
        Content::Chat(msgs) => {
            for m in &msgs[..turn.upto.min(msgs.len())] {
                let key = format!(
                    "{}\u{0}{}\u{0}{:?}\u{0}{:?}",
                    m.role, m.content, m.tool_call, m.tool_call_id
                );
                parent = xxh3(key.as_bytes(), parent);
                out.push((parent, m.content.len() as u64));
            }
        }
    }
    out
}

/// The intrinsic ceiling of prompts given as segment lists, in the order they are sent:
/// `blocks_*` count segments, `tokens_*` their weights.
pub fn ceiling_of<'a, I>(prompts: I) -> Ceiling
where
    I: IntoIterator<Item = &'a Segments>,
{
    counted_ceiling(prompts.into_iter().map(|p| (p, true)))
}

/// [`ceiling_of`] over `(prompt, counted)`: every prompt is history for the ones after it, only
/// the counted ones are counted.
fn counted_ceiling<'a, I>(prompts: I) -> Ceiling
where
    I: IntoIterator<Item = (&'a Segments, bool)>,
{
    let mut c = Ceiling::default();
    for p in per_prompt_ceiling(prompts) {
        c += p;
    }
    c
}

/// One prompt's counts, segment `i` (chain id `id`) reused iff `reused(i, id)`.
fn prompt_counts(p: &Segments, reused: impl Fn(usize, u64) -> bool) -> Ceiling {
    let mut c = Ceiling { requests: 1, ..Ceiling::default() };
    for (i, &(id, w)) in p.iter().enumerate() {
        c.blocks_total += 1;
        c.tokens_total += w;
        if reused(i, id) {
            c.blocks_reused += 1;
            c.tokens_reused += w;
        }
    }
    c
}

/// The ceiling's counts of each counted prompt on its own, in order (every prompt is history for
/// the ones after it): what an engine holding every earlier prompt would reuse of it.
pub fn per_prompt_ceiling<'a, I>(prompts: I) -> Vec<Ceiling>
where
    I: IntoIterator<Item = (&'a Segments, bool)>,
{
    let mut seen: HashSet<u64> = HashSet::new();
    let mut out = Vec::new();
    for (p, counted) in prompts {
        if counted {
            // A chain id seen before means the whole prefix up to it was sent before.
            out.push(prompt_counts(p, |_, id| seen.contains(&id)));
        }
        seen.extend(p.iter().map(|&(id, _)| id));
    }
    out
}

/// The ceiling of a set of sessions, prompts ordered by planned send time (ties: session order).
pub fn sessions_ceiling(sessions: &[Session], block_size: usize) -> Ceiling {
    ceiling_of(&scheduled_prompts(sessions, block_size))
}

/// Every planned prompt's segments, ordered by planned send time (ties: session order, turn).
pub fn scheduled_prompts(sessions: &[Session], block_size: usize) -> Vec<Segments> {
    let mut order: Vec<(f64, usize, usize)> = Vec::new();
    for (i, s) in sessions.iter().enumerate() {
        for (t, at) in s.scheduled_times_ms().into_iter().enumerate() {
            order.push((at, i, t));
        }
    }
    order.sort_by(|a, b| a.0.total_cmp(&b.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    order.iter().map(|&(_, i, t)| segments(&sessions[i], t, block_size)).collect()
}

/// One prompt that was sent: its session id, turn, send time and whether it is measured (scheduled
/// inside the point's window) or history (warm-up).
#[derive(Debug, Clone, PartialEq)]
pub struct SentPrompt<'a> {
    /// `Session::id`.
    pub session: &'a str,
    /// Turn index within the session.
    pub turn: usize,
    /// When it was sent, ms from the start of the point.
    pub sent_ms: f64,
    /// Counted in the ceiling (inside the window) or history only.
    pub counted: bool,
}

/// The ceiling of the prompts actually sent, in send order: every sent prompt (warm-up included)
/// is history, only `counted` ones are counted — what a perfect router could have reused of the
/// window's requests given everything sent before them. Prompts naming an unknown session or turn
/// are skipped; the second value counts them.
pub fn ceiling_with_history(
    sessions: &[Session],
    sent: &[SentPrompt<'_>],
    block_size: usize,
) -> (Ceiling, usize) {
    let (prompts, unknown) = sent_prompts(sessions, sent, block_size);
    (counted_ceiling(prompts.iter().map(|(segs, counted)| (segs, *counted))), unknown)
}

/// The segments of the prompts actually sent, in send order, each with whether it is counted;
/// the second value counts prompts naming an unknown session or turn (left out).
pub fn sent_prompts(
    sessions: &[Session],
    sent: &[SentPrompt<'_>],
    block_size: usize,
) -> (Vec<(Segments, bool)>, usize) {
    let by_id: std::collections::HashMap<&str, &Session> =
        sessions.iter().map(|s| (s.id.as_str(), s)).collect();
    let mut order: Vec<&SentPrompt<'_>> = sent.iter().collect();
    order.sort_by(|a, b| {
        a.sent_ms.total_cmp(&b.sent_ms).then(a.session.cmp(b.session)).then(a.turn.cmp(&b.turn))
    });
    let mut unknown = 0;
    let mut prompts: Vec<(Segments, bool)> = Vec::with_capacity(order.len());
    for p in order {
        match by_id.get(p.session).filter(|s| p.turn < s.turns.len()) {
            Some(s) => prompts.push((segments(s, p.turn, block_size), p.counted)),
            None => unknown += 1,
        }
    }
    (prompts, unknown)
}

/// The fleet-LRU reference (module doc) of token prompts in send order, counted like the ceiling:
/// each counted prompt hits its leading segments still cached (weights are tokens, so
/// `capacity_tokens` is the fleet's blocks × block size). Then all its segments are used, its
/// first one last — vLLM frees a finished request's blocks tail first, so a prefix's head outlives
/// its tail — and the least recently used are evicted until the cache fits. Memory: one entry per
/// cached segment, at most `capacity_tokens` entries plus one prompt's.
pub fn fleet_lru<'a, I>(prompts: I, capacity_tokens: u64) -> Ceiling
where
    I: IntoIterator<Item = (&'a Segments, bool)>,
{
    let mut lru = Lru::default();
    let mut c = Ceiling::default();
    for (p, counted) in prompts {
        if counted {
            let leading = p.iter().take_while(|(id, _)| lru.contains(*id)).count();
            c += prompt_counts(p, |i, _| i < leading);
        }
        for &(id, w) in p.iter().rev() {
            lru.touch(id, w);
        }
        lru.evict_to(capacity_tokens);
    }
    c
}

/// Segments by last use, weighted; [`fleet_lru`]'s cache.
#[derive(Default)]
struct Lru {
    /// Segment id → (its last use, its weight).
    entries: std::collections::HashMap<u64, (u64, u64)>,
    /// Last use → segment id, oldest first.
    by_use: std::collections::BTreeMap<u64, u64>,
    clock: u64,
    weight: u64,
}

impl Lru {
    fn contains(&self, id: u64) -> bool {
        self.entries.contains_key(&id)
    }

    fn touch(&mut self, id: u64, w: u64) {
        self.clock += 1;
        match self.entries.insert(id, (self.clock, w)) {
            Some((used, old)) => {
                self.by_use.remove(&used);
                self.weight = self.weight - old + w;
            }
            None => self.weight += w,
        }
        self.by_use.insert(self.clock, id);
    }

    fn evict_to(&mut self, capacity: u64) {
        while self.weight > capacity {
            let Some((_, id)) = self.by_use.pop_first() else { break };
            if let Some((_, w)) = self.entries.remove(&id) {
                self.weight -= w;
            }
        }
    }
}

/// A session's planned length in time, ms: its think times plus `ms_per_output_token` × each
/// turn's `max_tokens` (the decode; queueing and prefill left out).
pub fn session_span_ms(s: &Session, ms_per_output_token: f64) -> f64 {
    s.turns
        .iter()
        .enumerate()
        .map(|(i, t)| if i > 0 { t.think_ms.max(0.0) } else { 0.0 } + f64::from(t.max_tokens) * ms_per_output_token)
        .sum()
}

/// Mean [`session_span_ms`] over `sessions` (0 for none).
pub fn mean_session_span_ms(sessions: &[Session], ms_per_output_token: f64) -> f64 {
    if sessions.is_empty() {
        return 0.0;
    }
    sessions.iter().map(|s| session_span_ms(s, ms_per_output_token)).sum::<f64>()
        / sessions.len() as f64
}

/// With sessions arriving at a constant rate from time 0, the share of the steady-state
/// population of live sessions present at `t_ms`: Σ min(span, t) / Σ span (1 for no sessions).
pub fn population_share_at(sessions: &[Session], ms_per_output_token: f64, t_ms: f64) -> f64 {
    let spans: Vec<f64> =
        sessions.iter().map(|s| session_span_ms(s, ms_per_output_token)).collect();
    let total: f64 = spans.iter().sum();
    if total <= 0.0 {
        return 1.0;
    }
    spans.iter().map(|&l| l.min(t_ms.max(0.0))).sum::<f64>() / total
}

#[cfg(test)]
mod tests;
