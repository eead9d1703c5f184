//! The multi-turn chat workload, as text, so the tokenizer and chat-template path is exercised.
//!
//! Shape (after production-stack's multi-round QA and SGLang's generated-shared-prefix
//! benchmarks): a few long **shared system prompts**; many sessions, each picking one of them;
//! every session runs several turns, each turn appends a fresh user message to the history,
//! the **assistant's actual reply text** is appended after the turn, and the next turn waits an
//! exponentially distributed **think time**. Everything random comes from SplitMix64 seeded by
//! `(seed, session)`, so a session's script does not depend on timing or on other sessions.
//!
//! Text is pseudo-English built from a fixed word list: cheap, deterministic, and tokenized by
//! a real BPE into a realistic ~1.3 tokens per word. This module is pure: scripts and request
//! bodies; the driver that sends them lives in `chat_run`.

use crate::rng::{mix, SplitMix64};
use serde_json::{json, Value};

/// Parameters of the chat workload (validated by [`ChatConfig::validate`]).
#[derive(Debug, Clone, PartialEq)]
pub struct ChatConfig {
    /// Seed of everything random.
    pub seed: u64,
    /// Total sessions to run.
    pub sessions: usize,
    /// Sessions active at once (bounded concurrency).
    pub concurrent_sessions: usize,
    /// Fewest turns per session.
    pub turns_min: u32,
    /// Most turns per session (inclusive).
    pub turns_max: u32,
    /// Number of distinct shared system prompts.
    pub system_prompts: usize,
    /// Words per system prompt.
    pub system_prompt_words: usize,
    /// Words per user message.
    pub user_words: usize,
    /// Mean think time between turns, ms (exponential).
    pub think_time_ms: f64,
    /// Mean delay before a session's first turn, ms (exponential; staggers the start).
    pub start_stagger_ms: f64,
    /// `max_tokens` per turn.
    pub max_tokens: u32,
}

impl Default for ChatConfig {
    fn default() -> Self {
        Self {
            seed: 0,
            sessions: 64,
            concurrent_sessions: 16,
            turns_min: 3,
            turns_max: 8,
            system_prompts: 4,
            system_prompt_words: 1500,
            user_words: 60,
            think_time_ms: 500.0,
            start_stagger_ms: 200.0,
            max_tokens: 128,
        }
    }
}

impl ChatConfig {
    /// Checks the bounds; the message names the offending flag.
    pub fn validate(&self) -> Result<(), String> {
        if self.sessions == 0 || self.concurrent_sessions == 0 {
            return Err("--sessions and --concurrent-sessions must be > 0".into());
        }
        if self.turns_min == 0 || self.turns_max < self.turns_min {
            return Err("need 0 < --turns-min <= --turns-max".into());
        }
        if self.system_prompts == 0 {
            return Err("--system-prompts must be > 0".into());
        }
        if !(self.think_time_ms >= 0.0 && self.start_stagger_ms >= 0.0) {
            return Err("--think-time-ms and --start-stagger-ms must be >= 0".into());
        }
        Ok(())
    }

    /// One-line description for the report header.
    pub fn describe(&self) -> String {
        format!(
            "chat workload: seed {}, {} sessions ({} concurrent), {}..={} turns, {} system prompts × {} words, \
             user {} words, think {} ms mean, max_tokens {}",
            self.seed,
            self.sessions,
            self.concurrent_sessions,
            self.turns_min,
            self.turns_max,
            self.system_prompts,
            self.system_prompt_words,
            self.user_words,
            self.think_time_ms,
            self.max_tokens
        )
    }
}

const WORDS: &[&str] = &[
    "the",
    "of",
    "and",
    "to",
    "in",
    "system",
    "data",
    "model",
    "cache",
    "request",
    "router",
    "engine",
    "token",
    "block",
    "prefix",
    "worker",
    "latency",
    "memory",
    "network",
    "service",
    "policy",
    "answer",
    "question",
    "history",
    "context",
    "session",
    "balance",
    "load",
    "queue",
    "batch",
    "stream",
    "reply",
    "user",
    "assistant",
    "document",
    "chapter",
    "section",
    "figure",
    "table",
    "result",
    "method",
    "design",
    "test",
    "value",
    "number",
    "small",
    "large",
    "fast",
    "slow",
    "early",
    "late",
    "first",
    "second",
    "third",
    "last",
    "next",
    "previous",
    "green",
    "blue",
    "river",
    "mountain",
    "forest",
    "city",
    "market",
    "harbor",
    "bridge",
    "garden",
    "window",
    "letter",
    "story",
    "journey",
    "morning",
    "evening",
    "winter",
    "summer",
    "season",
    "weather",
    "signal",
    "careful",
    "simple",
    "complex",
    "quiet",
    "bright",
    "heavy",
    "light",
    "open",
    "closed",
    "ready",
    "steady",
    "explain",
    "describe",
    "compare",
    "measure",
    "compute",
    "predict",
    "observe",
    "record",
    "report",
    "review",
    "build",
    "write",
    "read",
    "send",
    "receive",
    "store",
    "evict",
    "route",
    "score",
    "choose",
    "keep",
    "move",
    "because",
    "however",
    "therefore",
    "although",
    "while",
    "after",
    "before",
    "during",
    "between",
    "within",
    "every",
    "each",
    "some",
    "many",
    "few",
    "most",
    "other",
    "same",
    "different",
    "important",
    "useful",
    "is",
    "are",
    "was",
    "were",
    "has",
    "have",
    "will",
    "would",
    "could",
    "should",
    "may",
    "might",
    "can",
    "with",
    "without",
    "from",
    "into",
    "over",
    "under",
    "about",
    "around",
    "through",
    "across",
    "along",
];

/// `n` words of pseudo-English: sentences of 6–17 words, capitalised, ending with a period.
pub fn text(rng: &mut SplitMix64, n: usize) -> String {
    let mut out = String::with_capacity(n * 7);
    let mut left_in_sentence = 0u64;
    for i in 0..n {
        if left_in_sentence == 0 {
            left_in_sentence = rng.range_u64(6, 18);
            if i > 0 {
                out.push_str(". ");
            }
            let w = WORDS[rng.range_u64(0, WORDS.len() as u64) as usize];
            let mut cs = w.chars();
            if let Some(c) = cs.next() {
                out.extend(c.to_uppercase());
                out.push_str(cs.as_str());
            }
        } else {
            out.push(' ');
            out.push_str(WORDS[rng.range_u64(0, WORDS.len() as u64) as usize]);
        }
        left_in_sentence -= 1;
    }
    if n > 0 {
        out.push('.');
    }
    out
}

/// The shared system prompts, identical for every session that picks the same index.
pub fn system_prompts(cfg: &ChatConfig) -> Vec<String> {
    (0..cfg.system_prompts)
        .map(|i| {
            let mut rng = SplitMix64::new(mix(cfg.seed, 0x5157_0000 + i as u64));
            format!(
                "You are assistant #{i}. Use the reference text below.\n\n{}",
                text(&mut rng, cfg.system_prompt_words)
            )
        })
        .collect()
}

/// One scripted turn.
#[derive(Debug, Clone, PartialEq)]
pub struct TurnScript {
    /// The user's message.
    pub user: String,
    /// Think time before this turn is sent (after the previous reply; stagger for turn 0), ms.
    pub delay_ms: f64,
}

/// One scripted session: its system prompt and turns.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionScript {
    /// Session number, 0-based.
    pub id: usize,
    /// Session id sent in the session header: `chat-<seed>-<id>`.
    pub session_id: String,
    /// Which shared system prompt.
    pub system_prompt: usize,
    /// The turns.
    pub turns: Vec<TurnScript>,
}

/// Scripts session `id` (depends only on the config and `id`).
pub fn script_session(cfg: &ChatConfig, id: usize) -> SessionScript {
    let mut rng = SplitMix64::new(mix(cfg.seed, id as u64));
    let system_prompt = rng.range_u64(0, cfg.system_prompts.max(1) as u64) as usize;
    let n_turns = rng.range_u64(u64::from(cfg.turns_min), u64::from(cfg.turns_max) + 1) as u32;
    let turns = (0..n_turns)
        .map(|t| {
            let delay_ms =
                if t == 0 { rng.exp(cfg.start_stagger_ms) } else { rng.exp(cfg.think_time_ms) };
            TurnScript { user: text(&mut rng, cfg.user_words), delay_ms }
        })
        .collect();
    SessionScript { id, session_id: format!("chat-{}-{id}", cfg.seed), system_prompt, turns }
}

/// A conversation's history (OpenAI chat messages).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct History {
    messages: Vec<(String, String)>,
}

impl History {
    /// A history that starts with `system`.
    pub fn new(system: &str) -> Self {
        Self { messages: vec![("system".into(), system.into())] }
    }

    /// A history made of `(role, content)` messages as they are.
    pub fn from_messages(messages: Vec<(String, String)>) -> Self {
        Self { messages }
    }

    /// Appends a user turn.
    pub fn push_user(&mut self, text: &str) {
        self.messages.push(("user".into(), text.into()));
    }

    /// Appends the assistant's reply as it was streamed back.
    pub fn push_assistant(&mut self, text: &str) {
        self.messages.push(("assistant".into(), text.into()));
    }

    /// The messages, `(role, content)`, oldest first.
    pub fn messages(&self) -> &[(String, String)] {
        &self.messages
    }

    /// Number of messages.
    pub fn len(&self) -> usize {
        self.messages.len()
    }

    /// True when there are no messages.
    pub fn is_empty(&self) -> bool {
        self.messages.is_empty()
    }

    /// The `/v1/chat/completions` body for the current history.
    pub fn body(&self, model: &str, max_tokens: u32, ignore_eos: bool) -> Value {
        let messages: Vec<Value> =
            self.messages.iter().map(|(r, c)| json!({"role": r, "content": c})).collect();
        let mut body = json!({
            "model": model,
            "messages": messages,
            "max_tokens": max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        if ignore_eos {
            body["ignore_eos"] = Value::Bool(true);
        }
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_has_the_requested_word_count_and_is_deterministic() {
        for n in [0usize, 1, 5, 100] {
            let a = text(&mut SplitMix64::new(3), n);
            assert_eq!(a, text(&mut SplitMix64::new(3), n));
            assert_eq!(a.split_whitespace().count(), n, "{a}");
        }
        assert_ne!(text(&mut SplitMix64::new(3), 20), text(&mut SplitMix64::new(4), 20));
    }

    #[test]
    fn system_prompts_are_shared_and_distinct() {
        let cfg = ChatConfig { system_prompts: 3, system_prompt_words: 50, ..Default::default() };
        let p = system_prompts(&cfg);
        assert_eq!(p.len(), 3);
        assert_ne!(p[0], p[1]);
        assert_eq!(p, system_prompts(&cfg));
    }

    #[test]
    fn session_scripts_are_per_session_deterministic_and_bounded() {
        let cfg = ChatConfig { turns_min: 2, turns_max: 4, ..Default::default() };
        let mut used_prompts = std::collections::HashSet::new();
        for id in 0..50 {
            let a = script_session(&cfg, id);
            assert_eq!(a, script_session(&cfg, id));
            assert!((2..=4).contains(&a.turns.len()));
            assert!(a.turns.iter().all(|t| t.delay_ms >= 0.0 && !t.user.is_empty()));
            assert_eq!(a.session_id, format!("chat-0-{id}"));
            used_prompts.insert(a.system_prompt);
        }
        assert_eq!(used_prompts.len(), cfg.system_prompts, "all shared prompts get used");
    }

    #[test]
    fn history_body_grows_with_turns() {
        let mut h = History::new("sys");
        h.push_user("hi");
        h.push_assistant("hello there");
        h.push_user("more");
        let b = h.body("m", 16, true);
        assert_eq!(b["messages"].as_array().unwrap().len(), 4);
        assert_eq!(b["messages"][2], json!({"role": "assistant", "content": "hello there"}));
        assert_eq!(b["stream"], json!(true));
        assert_eq!(b["stream_options"]["include_usage"], json!(true));
        assert_eq!(b["ignore_eos"], json!(true));
        assert!(h.body("m", 16, false).get("ignore_eos").is_none());
    }

    #[test]
    fn validate_table() {
        let ok = ChatConfig::default();
        assert!(ok.validate().is_ok());
        let bad = [
            ChatConfig { sessions: 0, ..ok.clone() },
            ChatConfig { turns_min: 0, ..ok.clone() },
            ChatConfig { turns_min: 5, turns_max: 4, ..ok.clone() },
            ChatConfig { system_prompts: 0, ..ok.clone() },
            ChatConfig { think_time_ms: -1.0, ..ok.clone() },
        ];
        for c in bad {
            assert!(c.validate().is_err(), "{c:?}");
        }
    }
}
