//! Generators of the synthetic workloads (pure, SplitMix64 from the seed).
//!
//! Each takes the point's rate and duration and returns a [`Schedule`] whose sessions start in
//! `[0, duration)`: Poisson arrivals (exponential gaps) of conversations, bursts or requests.
//! Think times are modelled time, divided by `think_divisor` (the simulators' speed-up) so that
//! load and engine time keep their ratio at any speed-up. Session `i`'s content depends only on
//! `(seed, i)`, so the same session is byte-identical at every rate and under every policy.
//!
//! | workload | sessions | turns | prompt |
//! |---|---|---|---|
//! | agentic | conversations/s | 5–30, 60 % tool-call turns (1–6 KB tool output), 40 % user turns; think 0.3–3 s (tool) / 2–8 s (user) | one of 3 system prompts of 16–32 KB + a 100–300-word task |
//! | siblings | bursts/s, 4–8 identical requests each | 1 | new 2–8k random token ids |
//! | paced | sessions/s | 3–8, think 10–60 s | one of 4 system prompts of ~2 KB + a 200–600-word first message |
//! | cold | requests/s | 1 | distinct 4–16k random token ids |
//!
//! The multi-model workload (agentic turns over two models and their adapters) is in `models`.

use super::{sessions_ceiling, ChatMsg, Content, Schedule, Session, Turn, WorkloadKind};
use crate::chat::text;
use crate::rng::{mix, SplitMix64};

/// Shared settings of the generators.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenConfig {
    /// Seed of everything random.
    pub seed: u64,
    /// Sessions start in `[0, duration_s)`.
    pub duration_s: f64,
    /// Think times are divided by this (the simulators' `--speedup`).
    pub think_divisor: f64,
    /// Engine block size (the ceiling of token prompts counts engine blocks).
    pub block_size: usize,
}

impl Default for GenConfig {
    fn default() -> Self {
        Self { seed: 0, duration_s: 60.0, think_divisor: 1.0, block_size: 16 }
    }
}

/// Fewer bytes than a word of `chat::text` takes on average (~7), so the cut always has enough.
const BYTES_PER_WORD: usize = 5;
/// Agentic chat: shared system prompts.
pub const AGENTIC_SYSTEM_PROMPTS: usize = 3;
/// Paced sessions: shared system prompts.
pub const PACED_SYSTEM_PROMPTS: usize = 4;
/// Random token ids stay clear of DeepSeek's special tokens (0..2, ≥ 128000), like the trace.
const TOKEN_LO: u64 = 1000;
const TOKEN_HI: u64 = 100_000;
const TOOLS: &[&str] = &["search_code", "read_file", "run_tests", "query_db", "fetch_url"];

/// Poisson arrival times in `[0, duration)` at `rate` per second, ms.
pub fn arrivals(rng: &mut SplitMix64, rate: f64, duration_s: f64) -> Vec<f64> {
    let mut out = Vec::new();
    if !(rate > 0.0 && rate.is_finite() && duration_s > 0.0) {
        return out;
    }
    let mut t = rng.exp(1000.0 / rate);
    while t < duration_s * 1000.0 {
        out.push(t);
        t += rng.exp(1000.0 / rate);
    }
    out
}

/// About `bytes` bytes of text: enough words, cut to exactly `bytes` (the text is ASCII).
fn text_bytes(rng: &mut SplitMix64, bytes: usize) -> String {
    let mut t = text(rng, (bytes / BYTES_PER_WORD).max(1));
    t.truncate(bytes.min(t.len()));
    t
}

fn uniform(rng: &mut SplitMix64, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.next_f64()
}

fn tokens(rng: &mut SplitMix64, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.range_u64(TOKEN_LO, TOKEN_HI) as u32).collect()
}

pub(super) fn system_prompt(seed: u64, kind: u64, i: usize, bytes: usize) -> String {
    let mut rng = SplitMix64::new(mix(seed, kind ^ (0x5157 << 16) ^ i as u64));
    format!(
        "You are agent #{i}. Follow the operating manual below.\n\n{}",
        text_bytes(&mut rng, bytes)
    )
}

/// The agentic chat's shared system prompts (16–32 KB each).
pub fn agentic_system_prompts(seed: u64) -> Vec<String> {
    (0..AGENTIC_SYSTEM_PROMPTS)
        .map(|i| {
            let mut r = SplitMix64::new(mix(seed, 0xA6E0 + i as u64));
            let bytes = r.range_u64(16 * 1024, 32 * 1024 + 1) as usize;
            system_prompt(seed, 0xA6, i, bytes)
        })
        .collect()
}

pub(super) fn finish(
    kind: WorkloadKind,
    rate: f64,
    sessions: Vec<Session>,
    cfg: &GenConfig,
    unit: &'static str,
) -> Schedule {
    let ceiling = sessions_ceiling(&sessions, cfg.block_size);
    Schedule { kind, rate, sessions, ceiling, ceiling_unit: unit }
}

/// Agentic chat at `rate` new conversations per second.
pub fn agentic(cfg: &GenConfig, rate: f64) -> Schedule {
    let prompts = agentic_system_prompts(cfg.seed);
    let mut arr = SplitMix64::new(mix(cfg.seed, 0xA6A6));
    let sessions = arrivals(&mut arr, rate, cfg.duration_s)
        .into_iter()
        .enumerate()
        .map(|(i, start_ms)| {
            let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0xA6), i as u64));
            let sys = rng.range_u64(0, prompts.len() as u64) as usize;
            let words = rng.range_u64(100, 301) as usize;
            let mut msgs = vec![
                ChatMsg::new("system", prompts[sys].clone()),
                ChatMsg::new("user", format!("Task {}-{i}: {}", cfg.seed, text(&mut rng, words))),
            ];
            let turns = agentic_turns(&mut rng, i, cfg, &mut msgs);
            Session {
                id: format!("agent-{}-{i}", cfg.seed),
                start_ms,
                content: Content::Chat(msgs),
                turns,
                model: None,
            }
        })
        .collect();
    finish(WorkloadKind::Agentic, rate, sessions, cfg, "content bytes")
}

/// An agentic conversation's turns after its first message(s) `msgs` (grown in place): 5–30
/// turns, 60 % tool calls with 1–6 KB outputs, the rest a reply and a user message.
pub(super) fn agentic_turns(
    rng: &mut SplitMix64,
    i: usize,
    cfg: &GenConfig,
    msgs: &mut Vec<ChatMsg>,
) -> Vec<Turn> {
    let n_turns = rng.range_u64(5, 31) as usize;
    let mut turns = vec![Turn { upto: msgs.len(), think_ms: 0.0, max_tokens: 128 }];
    for k in 1..n_turns {
        let think_s;
        if rng.next_f64() < 0.6 {
            let id = format!("call_{i}_{k}");
            let tool = TOOLS[rng.range_u64(0, TOOLS.len() as u64) as usize];
            let mut call = ChatMsg::new("assistant", format!("I will use {tool} for step {k}."));
            call.tool_call =
                Some((id.clone(), tool.to_string(), format!("{{\"step\":{k},\"session\":{i}}}")));
            msgs.push(call);
            let bytes = rng.range_u64(1024, 6 * 1024 + 1) as usize;
            let mut out = ChatMsg::new("tool", text_bytes(rng, bytes));
            out.tool_call_id = Some(id);
            msgs.push(out);
            think_s = uniform(rng, 0.3, 3.0);
        } else {
            let reply_words = rng.range_u64(30, 90) as usize;
            msgs.push(ChatMsg::new("assistant", text(rng, reply_words)));
            let user_words = rng.range_u64(15, 80) as usize;
            msgs.push(ChatMsg::new("user", text(rng, user_words)));
            think_s = uniform(rng, 2.0, 8.0);
        }
        turns.push(Turn {
            upto: msgs.len(),
            think_ms: think_s * 1000.0 / cfg.think_divisor.max(1e-9),
            max_tokens: 128,
        });
    }
    turns
}

/// Sibling bursts at `rate` bursts per second: 4–8 identical single-turn requests each.
pub fn siblings(cfg: &GenConfig, rate: f64) -> Schedule {
    let mut arr = SplitMix64::new(mix(cfg.seed, 0x51B5));
    let mut sessions = Vec::new();
    for (b, start_ms) in arrivals(&mut arr, rate, cfg.duration_s).into_iter().enumerate() {
        let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0x51), b as u64));
        let n = rng.range_u64(4, 9) as usize;
        let len = rng.range_u64(2048, 8193) as usize;
        let ids = tokens(&mut rng, len);
        for k in 0..n {
            sessions.push(Session {
                id: format!("burst-{}-{b}-{k}", cfg.seed),
                start_ms,
                content: Content::Tokens(ids.clone()),
                turns: vec![Turn { upto: len, think_ms: 0.0, max_tokens: 64 }],
                model: None,
            });
        }
    }
    finish(WorkloadKind::Siblings, rate, sessions, cfg, "tokens")
}

/// Paced sessions at `rate` new sessions per second.
pub fn paced(cfg: &GenConfig, rate: f64) -> Schedule {
    let prompts: Vec<String> =
        (0..PACED_SYSTEM_PROMPTS).map(|i| system_prompt(cfg.seed, 0x9A, i, 2048)).collect();
    let mut arr = SplitMix64::new(mix(cfg.seed, 0x9A9A));
    let sessions = arrivals(&mut arr, rate, cfg.duration_s)
        .into_iter()
        .enumerate()
        .map(|(i, start_ms)| {
            let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0x9A), i as u64));
            let sys = rng.range_u64(0, prompts.len() as u64) as usize;
            let words = rng.range_u64(200, 601) as usize;
            let mut msgs = vec![
                ChatMsg::new("system", prompts[sys].clone()),
                ChatMsg::new(
                    "user",
                    format!("Session {}-{i}: {}", cfg.seed, text(&mut rng, words)),
                ),
            ];
            let n_turns = rng.range_u64(3, 9) as usize;
            let mut turns = vec![Turn { upto: msgs.len(), think_ms: 0.0, max_tokens: 128 }];
            for _ in 1..n_turns {
                let reply_words = rng.range_u64(40, 120) as usize;
                msgs.push(ChatMsg::new("assistant", text(&mut rng, reply_words)));
                let user_words = rng.range_u64(20, 100) as usize;
                msgs.push(ChatMsg::new("user", text(&mut rng, user_words)));
                let think_ms = uniform(&mut rng, 10.0, 60.0) * 1000.0 / cfg.think_divisor.max(1e-9);
                turns.push(Turn { upto: msgs.len(), think_ms, max_tokens: 128 });
            }
            Session {
                id: format!("paced-{}-{i}", cfg.seed),
                start_ms,
                content: Content::Chat(msgs),
                turns,
                model: None,
            }
        })
        .collect();
    finish(WorkloadKind::Paced, rate, sessions, cfg, "content bytes")
}

/// Cold single-turn requests at `rate` per second: distinct 4–16k-token prompts.
pub fn cold(cfg: &GenConfig, rate: f64) -> Schedule {
    let mut arr = SplitMix64::new(mix(cfg.seed, 0xC01D));
    let sessions = arrivals(&mut arr, rate, cfg.duration_s)
        .into_iter()
        .enumerate()
        .map(|(i, start_ms)| {
            let mut rng = SplitMix64::new(mix(mix(cfg.seed, 0xC0), i as u64));
            let len = rng.range_u64(4096, 16_385) as usize;
            Session {
                id: format!("cold-{}-{i}", cfg.seed),
                start_ms,
                content: Content::Tokens(tokens(&mut rng, len)),
                turns: vec![Turn { upto: len, think_ms: 0.0, max_tokens: 64 }],
                model: None,
            }
        })
        .collect();
    finish(WorkloadKind::Cold, rate, sessions, cfg, "tokens")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> GenConfig {
        GenConfig { seed: 7, duration_s: 60.0, think_divisor: 4.0, block_size: 16 }
    }

    #[test]
    fn arrivals_are_bounded_and_near_the_rate() {
        let mut r = SplitMix64::new(1);
        let a = arrivals(&mut r, 10.0, 100.0);
        assert!((800..1200).contains(&a.len()), "{}", a.len());
        assert!(
            a.windows(2).all(|w| w[0] <= w[1]) && a.iter().all(|&t| (0.0..100_000.0).contains(&t))
        );
        assert!(arrivals(&mut r, 0.0, 10.0).is_empty());
        assert!(arrivals(&mut r, f64::NAN, 10.0).is_empty());
    }

    #[test]
    fn agentic_shape_and_ceiling() {
        let p = agentic(&cfg(), 1.0);
        assert!(!p.sessions.is_empty());
        let prompts = agentic_system_prompts(7);
        assert!(
            prompts.iter().all(|s| (16 * 1024..=32 * 1024 + 100).contains(&s.len())),
            "{:?}",
            prompts.iter().map(String::len).collect::<Vec<_>>()
        );
        let mut tool_turns = 0;
        for s in &p.sessions {
            assert!((5..=30).contains(&s.turns.len()));
            let Content::Chat(m) = &s.content else { panic!("chat") };
            assert!(prompts.contains(&m[0].content));
            assert!(s.turns.windows(2).all(|w| w[0].upto < w[1].upto));
            tool_turns += m.iter().filter(|x| x.role == "tool").count();
            assert!(m.iter().filter(|x| x.role == "tool").all(|x| x.content.len() >= 1000));
        }
        assert!(tool_turns > 0);
        // Shared system prompts and growing histories: most bytes are reusable, not all.
        let c = p.ceiling_rate();
        assert!((0.80..0.99).contains(&c), "agentic ceiling {c}");
        assert_eq!(p, agentic(&cfg(), 1.0), "deterministic");
        // Conversations sharing a system prompt differ from their first user message on.
        let firsts: std::collections::HashSet<String> = p
            .sessions
            .iter()
            .map(|s| match &s.content {
                Content::Chat(m) => m[1].content.clone(),
                _ => String::new(),
            })
            .collect();
        assert_eq!(firsts.len(), p.sessions.len());
    }

    #[test]
    fn siblings_ceiling_is_all_but_the_first_of_each_burst() {
        let p = siblings(&cfg(), 0.5);
        let mut want_reused = 0u64;
        let mut total = 0u64;
        let mut i = 0;
        while i < p.sessions.len() {
            let Content::Tokens(ids) = &p.sessions[i].content else { panic!("tokens") };
            let n =
                p.sessions[i..].iter().take_while(|s| s.content == p.sessions[i].content).count();
            assert!((4..=8).contains(&n));
            assert!((2048..=8192).contains(&ids.len()));
            want_reused += (n as u64 - 1) * ids.len() as u64;
            total += n as u64 * ids.len() as u64;
            i += n;
        }
        assert_eq!((p.ceiling.tokens_reused, p.ceiling.tokens_total), (want_reused, total));
    }

    #[test]
    fn paced_think_times_scale_with_the_divisor() {
        let p = paced(&cfg(), 0.5);
        for s in &p.sessions {
            assert!((3..=8).contains(&s.turns.len()));
            assert!(
                s.turns[1..].iter().all(|t| (2_500.0..=15_000.0).contains(&t.think_ms)),
                "10–60 s ÷ 4"
            );
        }
        let c = p.ceiling_rate();
        assert!(c > 0.3 && c < 0.95, "paced ceiling {c}");
    }

    #[test]
    fn cold_has_nothing_to_reuse() {
        let p = cold(&cfg(), 2.0);
        assert!(p.sessions.iter().all(
            |s| matches!(&s.content, Content::Tokens(t) if (4096..=16384).contains(&t.len()))
        ));
        assert_eq!(p.ceiling.tokens_reused, 0);
        assert_eq!(p.ceiling_rate(), 0.0);
        assert!(p.requests() > 60);
    }
}
