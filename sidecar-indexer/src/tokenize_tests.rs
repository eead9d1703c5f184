use super::*;
use kvmesh_core::hashing::SequenceHash;
use kvmesh_core::openai::ChatMessage;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn load(cache_bytes: usize) -> PromptTokenizer {
    let path = kvmesh_tokens::default_tokenizer_path();
    PromptTokenizer::load(&path, None, "<｜begin▁of▁sentence｜>", cache_bytes)
        .unwrap_or_else(|e| panic!("{e} (run `make setup` for the DeepSeek tokenizer)"))
}

/// Without the prefix memo: for tests of the segment cache and of the stop rule (a memo hit
/// gives exact ids past where tokenizing from scratch would stop).
fn load_without_memo(cache_bytes: usize) -> PromptTokenizer {
    load(cache_bytes).with_memo_bytes(0)
}

/// Text with every kind of boundary a BPE pre-tokenizer cares about: words, digit runs, CJK and
/// kana runs, punctuation, whitespace runs, newlines, emoji, and added tokens written by users.
fn random_text(rng: &mut StdRng, words: usize) -> String {
    const PIECES: &[&str] = &[
        "hello",
        " world",
        "The",
        " quick",
        "brown",
        "fox",
        "12345",
        "3.14159",
        "2024-01-01",
        "你好",
        "世界",
        "こんにちは",
        "カタカナ",
        "!",
        "?",
        "...",
        ", ",
        "; ",
        "(",
        ")",
        "\"quoted\"",
        "'s",
        "don't",
        "\n",
        "\n\n",
        "  ",
        "\t",
        "   x",
        " ",
        "🙂",
        "é",
        "naïve",
        "<｜User｜>",
        "<｜Assistant｜>",
        "<think>",
        "</think>",
        "<｜end▁of▁sentence｜>",
        "<|EOT|>",
        "fn main() { x += 1; }",
        "a_b",
        "CamelCase",
        "URL: https://example.invalid/a?b=c",
        "—",
        "%",
        "$100",
        "#tag",
        "@user",
    ];
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(PIECES[rng.gen_range(0..PIECES.len())]);
        if rng.gen_bool(0.5) {
            s.push(' ');
        }
    }
    s
}

fn msg(role: &str, content: String) -> ChatMessage {
    ChatMessage { role: role.into(), content: content.into() }
}

#[test]
fn incremental_ids_equal_full_tokenization_over_many_conversations() {
    let tok = load(8 * 1024 * 1024);
    let mut rng = StdRng::seed_from_u64(7);
    let mut turns_checked = 0;
    for conversation in 0..40 {
        let mut history = Vec::new();
        if rng.gen_bool(0.7) {
            history.push(msg("system", random_text(&mut rng, 30)));
        }
        for _turn in 0..6 {
            let n = rng.gen_range(1..60);
            history.push(msg("user", random_text(&mut rng, n)));
            let input = RequestInput::Messages(history.clone());
            let mut stats = CacheStats::default();
            let incremental = tok.tokens(&input, &mut stats).unwrap();
            let rendered = tok.template.render(&history, true).unwrap();
            let full = tok.tokenizer().encode(&rendered).unwrap();
            assert_eq!(incremental, full, "conversation {conversation}: {rendered:?}");
            turns_checked += 1;
            let n = rng.gen_range(1..40);
            history.push(msg("assistant", random_text(&mut rng, n)));
        }
    }
    assert_eq!(turns_checked, 240);
}

#[test]
fn a_new_turn_only_tokenizes_its_new_segments() {
    for memo in [false, true] {
        let tok = if memo { load(8 * 1024 * 1024) } else { load_without_memo(8 * 1024 * 1024) };
        let mut rng = StdRng::seed_from_u64(11);
        let mut history =
            vec![msg("system", random_text(&mut rng, 200)), msg("user", "first question".into())];
        let mut stats = CacheStats::default();
        tok.tokens(&RequestInput::Messages(history.clone()), &mut stats).unwrap();
        history.push(msg("assistant", "an answer".into()));
        history.push(msg("user", "a follow-up".into()));
        let mut stats = CacheStats::default();
        tok.tokens(&RequestInput::Messages(history), &mut stats).unwrap();
        // New: the answer and the follow-up. Everything else comes from the memo (the whole
        // previous prompt, no segment looked up) or, without it, from the segment cache.
        assert_eq!(stats.misses, 2, "memo {memo}: {stats:?}");
        if memo {
            assert_eq!((stats.memo_hits, stats.hits), (1, 0), "{stats:?}");
        } else {
            assert!(stats.hits >= 2, "{stats:?}");
            assert_eq!(stats.memo_hits + stats.memo_misses, 0, "{stats:?}");
        }
    }
}

/// Ids, chains and locals of a full encode of `rendered`.
fn full_blocks(
    tok: &PromptTokenizer,
    rendered: &str,
    block: usize,
    seed: u64,
) -> (Vec<u32>, Vec<SequenceHash>, Vec<kvmesh_core::hashing::LocalBlockHash>) {
    let ids = tok.tokenizer().encode(rendered).unwrap();
    let chains = kvmesh_core::hashing::sequence_hashes(&ids, block, seed);
    let locals = kvmesh_core::hashing::local_block_hashes(&ids, block, seed);
    (ids, chains, locals)
}

#[test]
fn twenty_turns_resume_from_the_memo_with_the_ids_of_a_full_encode() {
    let tok = load(8 * 1024 * 1024);
    let mut rng = StdRng::seed_from_u64(16);
    let (mut turns, mut hits) = (0, 0);
    for conversation in 0..6 {
        let mut history = vec![msg("system", random_text(&mut rng, 40))];
        for turn in 0..20 {
            let n = rng.gen_range(1..50);
            history.push(msg("user", random_text(&mut rng, n)));
            let input = RequestInput::Messages(history.clone());
            let rendered = tok.template.render(&history, true).unwrap();
            // Mostly the route's block size; sometimes another one or a salt (hashed again from
            // the memo's ids), sometimes plain ids.
            let (block, seed) = match turn % 5 {
                3 => (32, 1337),
                4 => (16, 99),
                _ => (16, 1337),
            };
            let mut stats = CacheStats::default();
            let got = if turn % 7 == 6 {
                let ids = tok.tokens(&input, &mut stats).unwrap();
                assert_eq!(ids, tok.tokenizer().encode(&rendered).unwrap());
                None
            } else {
                Some(
                    tok.tokens_until(&input, &mut Reach::whole_blocks(block, seed), &mut stats)
                        .unwrap(),
                )
            };
            if let Some(got) = got {
                let (ids, chains, locals) = full_blocks(&tok, &rendered, block, seed);
                assert!(got.complete(), "conversation {conversation} turn {turn}");
                assert_eq!(
                    got.ids.to_vec(),
                    ids,
                    "conversation {conversation} turn {turn}: {rendered:?}"
                );
                assert_eq!(got.chains, chains, "conversation {conversation} turn {turn}");
                assert_eq!(got.locals, locals, "conversation {conversation} turn {turn}");
            }
            // Every turn after the first resumes from the previous one's prompt.
            let want = u64::from(turn > 0);
            assert_eq!(
                (stats.memo_hits, stats.memo_misses),
                (want, 1 - want),
                "conversation {conversation} turn {turn}: {stats:?}"
            );
            hits += stats.memo_hits;
            turns += 1;
            let n = rng.gen_range(1..40);
            history.push(msg("assistant", random_text(&mut rng, n)));
        }
    }
    assert_eq!((turns, hits), (120, 114));
}

/// `messages` tokenized whole (blocks of 16, seed 1337), their ids and chains checked against a
/// full encode's; the cache effect.
fn checked(tok: &PromptTokenizer, messages: &[ChatMessage], what: &str) -> CacheStats {
    let mut stats = CacheStats::default();
    let got = tok
        .tokens_until(
            &RequestInput::Messages(messages.to_vec()),
            &mut Reach::whole_blocks(16, 1337),
            &mut stats,
        )
        .unwrap();
    let rendered = tok.template.render(messages, true).unwrap();
    let (ids, chains, _) = full_blocks(tok, &rendered, 16, 1337);
    assert_eq!((got.ids.to_vec(), got.chains), (ids, chains), "{what}");
    stats
}

#[test]
fn siblings_and_edited_histories_resume_only_where_the_text_is_the_same() {
    let tok = load(8 * 1024 * 1024);
    let mut rng = StdRng::seed_from_u64(17);
    let mut history = vec![msg("system", random_text(&mut rng, 40))];
    for _ in 0..8 {
        history.push(msg("user", random_text(&mut rng, 30)));
        history.push(msg("assistant", random_text(&mut rng, 30)));
    }
    let check = |messages: &[ChatMessage], what: &str| checked(&tok, messages, what);
    check(&history, "the shared prefix");
    // Siblings: different new turns on the same prefix, each resuming from it.
    for i in 0..4 {
        let mut m = history.clone();
        m.push(msg("user", format!("sibling {i}: {}", random_text(&mut rng, 20))));
        assert_eq!(check(&m, "sibling").memo_hits, 1);
    }
    // An edited earlier message (one character, and one that writes an added token into it):
    // the memo may resume only before the edit, and the ids stay exact.
    for edit in ["X", "<｜User｜>", "<｜Assistant｜>"] {
        let mut m = history.clone();
        m[5].content = format!("{edit}{}", m[5].content).into();
        m.push(msg("user", "after an edit".into()));
        check(&m, edit);
    }
    // A prompt that ends exactly at a remembered boundary, and the same prompt again.
    check(&history, "the prefix again");
    check(&history, "the prefix again");
}

/// A [`long_chat`] of `words` tokenized whole (so the memo remembers it, in blocks of 16 with
/// seed 1337): its messages and its block count.
fn remembered_chat(
    tok: &PromptTokenizer,
    rng: &mut StdRng,
    words: usize,
) -> (Vec<ChatMessage>, usize) {
    let RequestInput::Messages(history) = long_chat(rng, words) else {
        unreachable!("long_chat is a chat")
    };
    let whole = tok
        .tokens_until(
            &RequestInput::Messages(history.clone()),
            &mut Reach::whole_blocks(16, 1337),
            &mut CacheStats::default(),
        )
        .unwrap();
    (history, whole.chains.len())
}

#[test]
fn a_memo_hit_then_the_stop_rule_keeps_the_ids_exact() {
    // The previous turn is remembered whole; the next one is held by nobody (the index lost it):
    // the prefix comes from the memo, the held probe sees all its blocks at once, and what is
    // tokenized past them stays a prefix of the full encode. A long new turn puts the remembered
    // boundary before the prompt's last quarter (found after a whole split); a short one in it
    // (found splitting only the tail, and the estimate samples the prefix split then).
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(19);
    for (prefix_words, turn_words, tail) in [(6_000, 3_000, false), (8_000, 1_500, true)] {
        let (mut history, _) = remembered_chat(&tok, &mut rng, prefix_words);
        history.push(msg("assistant", words_text(&mut rng, 50)));
        history.push(msg("user", words_text(&mut rng, turn_words)));
        let rendered = tok.template.render(&history, true).unwrap();
        let (ids, chains, _) = full_blocks(&tok, &rendered, 16, 1337);
        for held_blocks in [0usize, 100, usize::MAX] {
            let what = format!("prefix {prefix_words} words, held {held_blocks}");
            let mut probes = Vec::new();
            let mut held = |c: &[SequenceHash]| {
                probes.push(c.len());
                c.len().min(held_blocks)
            };
            let mut stats = CacheStats::default();
            let got = tok
                .tokens_until(
                    &RequestInput::Messages(history.clone()),
                    &mut Reach::new(16, 1337, 0, &mut held),
                    &mut stats,
                )
                .unwrap();
            let hits = if tail { (0, 1) } else { (1, 0) };
            assert_eq!((stats.memo_hits, stats.memo_tail_hits), hits, "{what}: {stats:?}");
            assert_eq!(&ids[..got.ids.len()], &got.ids.to_vec()[..], "{what}");
            assert_eq!(&chains[..got.chains.len()], &got.chains[..], "{what}");
            // The first probe already sees every remembered block.
            assert!(probes[0] >= prefix_words / 16, "{what}: probes {probes:?}");
            if held_blocks == usize::MAX {
                assert!(got.complete() && got.ids.to_vec() == ids);
            } else {
                assert!(!got.complete(), "{what}: the new turn is estimated");
                assert_estimate_within(&got, ids.len(), 0.05, &what);
            }
        }
    }
}

#[test]
fn completions_prompts_resume_from_the_memo_too() {
    let tok = load(1 << 20);
    let mut rng = StdRng::seed_from_u64(18);
    let mut text = String::new();
    for i in 0..10 {
        text.push_str(&random_text(&mut rng, 30));
        text.push_str("<｜end▁of▁sentence｜>");
        let mut stats = CacheStats::default();
        let ids =
            tok.tokens(&RequestInput::Prompt(Prompt::Text(text.clone())), &mut stats).unwrap();
        assert_eq!(ids, tok.tokenizer().encode(&text).unwrap(), "step {i}");
        // random_text writes added tokens itself: every step after the first resumes somewhere.
        if i > 0 {
            assert_eq!(stats.memo_hits, 1, "step {i}: {stats:?}");
        }
    }
    assert!(tok.memo_bytes() > 0 && tok.memo_bytes() <= DEFAULT_MEMO_BYTES);
}

#[test]
fn completions_text_and_token_prompts() {
    let tok = load(1024 * 1024);
    let mut stats = CacheStats::default();
    let text = "<｜begin▁of▁sentence｜>Hello, world! 12345 你好";
    let ids = tok.tokens(&RequestInput::Prompt(Prompt::Text(text.into())), &mut stats).unwrap();
    assert_eq!(ids, tok.tokenizer().encode(text).unwrap());
    let passthrough =
        tok.tokens(&RequestInput::Prompt(Prompt::Tokens(vec![5, 6, 7])), &mut stats).unwrap();
    assert_eq!(passthrough, vec![5, 6, 7]);
}

#[test]
fn the_cache_stays_within_its_byte_bound() {
    let tok = load(4096);
    let mut rng = StdRng::seed_from_u64(3);
    for _ in 0..200 {
        let text = format!("<｜User｜>{}<｜Assistant｜>", random_text(&mut rng, 5));
        let mut stats = CacheStats::default();
        let ids = tok.encode_text(&text, &mut stats).unwrap();
        assert_eq!(ids, tok.tokenizer().encode(&text).unwrap());
        assert!(tok.cache_bytes() <= 4096);
    }
}

#[test]
fn splitter_cuts_like_the_library() {
    let splitter =
        SegmentSplitter::from_tokenizer_json(&kvmesh_tokens::default_tokenizer_path()).unwrap();
    let mut out = Vec::new();
    splitter.split("a<｜User｜>b<｜User｜><｜Assistant｜>", &mut out);
    assert_eq!(
        out,
        vec![
            Segment::Text("a"),
            Segment::Added(128_803),
            Segment::Text("b"),
            Segment::Added(128_803),
            Segment::Added(128_804)
        ]
    );
    SegmentSplitter::none().split("a<｜User｜>", &mut out);
    assert_eq!(out, vec![Segment::Text("a<｜User｜>")]);
}

// === tokenize only what can match ===

/// Real text of several kinds: this repository's prose (READMEs) and code.
fn real_texts() -> Vec<(String, String)> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    [
        "README.md",
        "sidecar-indexer/README.md",
        "filter/README.md",
        "sidecar-indexer/src/decide/mod.rs",
        "core/src/openai.rs",
        "e2e/sim/README.md",
    ]
    .iter()
    .map(|p| {
        // A moved file fails here rather than silently shrinking the sample.
        let text = std::fs::read_to_string(root.join(p)).unwrap_or_else(|e| panic!("{p}: {e}"));
        (p.to_string(), text)
    })
    .collect()
}

/// Prose-like text from a word list (the route bench's kind of text).
fn words_text(rng: &mut StdRng, words: usize) -> String {
    const WORDS: &[&str] = &[
        "the", "model", "router", "cache", "block", "token", "request", "latency", "worker",
        "prefix", "12", "345", ",", ".", "?", "\n", "—", "你好", "数据",
    ];
    let mut s = String::new();
    for _ in 0..words {
        s.push_str(WORDS[rng.gen_range(0..WORDS.len())]);
        s.push(' ');
    }
    s
}

fn cjk_text(rng: &mut StdRng, chars: usize) -> String {
    const PIECES: &[&str] = &[
        "你好",
        "世界",
        "数据",
        "模型",
        "缓存",
        "，",
        "。",
        "\n",
        "こんにちは",
        "カタカナ",
        " ",
        "12",
        "GPU",
        "路由",
    ];
    (0..chars).map(|_| PIECES[rng.gen_range(0..PIECES.len())]).collect()
}

#[test]
fn the_cut_rule_is_proved_for_this_tokenizer() {
    let splitter =
        SegmentSplitter::from_tokenizer_json(&kvmesh_tokens::default_tokenizer_path()).unwrap();
    assert!(
        splitter.chunks(),
        "the DeepSeek-V4 tokenizer.json must match the pre-tokenizer the cut rule is proved for"
    );
    // Any other pre-tokenizer: pieces are never cut.
    let text = std::fs::read_to_string(kvmesh_tokens::default_tokenizer_path()).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
        serde_json::json!("\\p{N}{1,4}");
    let dir = std::env::temp_dir().join(format!("kvmesh-tok-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, json.to_string()).unwrap();
    let other = SegmentSplitter::from_tokenizer_json(&path).unwrap();
    std::fs::remove_dir_all(&dir).ok();
    assert!(!other.chunks());
}

#[test]
fn every_safe_cut_gives_the_ids_of_the_whole() {
    let tok = load(0);
    let plain = tok.tokenizer();
    let mut rng = StdRng::seed_from_u64(5);
    let mut texts: Vec<String> =
        (0..6).map(|_| random_text(&mut rng, 120).replace("<｜", "<|")).collect();
    texts.push(words_text(&mut rng, 300));
    texts.push(cjk_text(&mut rng, 300));
    for (_, t) in real_texts() {
        texts.push(t.chars().take(1500).collect());
    }
    let mut cuts = 0;
    for text in &texts {
        let whole = plain.encode(text).unwrap();
        let mut prev: Option<char> = None;
        for (p, c) in text.char_indices() {
            if prev.is_some_and(|b| safe_cut(b, c)) {
                let mut split = plain.encode(&text[..p]).unwrap();
                split.extend(plain.encode(&text[p..]).unwrap());
                assert_eq!(split, whole, "cut before byte {p} ({:?}|{:?}) of {text:?}", prev, c);
                cuts += 1;
            }
            prev = Some(c);
        }
    }
    assert!(cuts > 500, "only {cuts} cuts checked");
    // The rule is not vacuous: boundaries it refuses do change the ids.
    for (text, p) in
        [("a b", 2), ("x  \ny", 2), ("12345", 2), ("你好世界", 6), ("\n\n", 1), ("ab!", 2)]
    {
        let mut split = plain.encode(&text[..p]).unwrap();
        split.extend(plain.encode(&text[p..]).unwrap());
        let (b, a) = (text[..p].chars().next_back().unwrap(), text[p..].chars().next().unwrap());
        assert!(!safe_cut(b, a), "{text:?} at {p}");
        if split != plain.encode(text).unwrap() {
            cuts += 1;
        }
    }
    assert!(cuts > 500 + 3, "most refused cuts must differ");
}

#[test]
fn chunked_pieces_encode_like_the_whole() {
    for cache in [0, 8 << 20] {
        let tok = load(cache);
        let mut rng = StdRng::seed_from_u64(9);
        let mut texts: Vec<String> = (0..8).map(|_| random_text(&mut rng, 3000)).collect();
        texts.push(words_text(&mut rng, 20_000));
        texts.push(cjk_text(&mut rng, 5000));
        texts.extend(real_texts().into_iter().map(|(_, t)| t));
        for text in &texts {
            assert!(text.len() > 2 * CHUNK_BYTES);
            let ids = tok.encode_text(text, &mut CacheStats::default()).unwrap();
            assert_eq!(ids, tok.tokenizer().encode(text).unwrap(), "{}", &text[..200]);
        }
    }
}

/// The estimated length of `got` is within `bound` (relative) of the `full` token count.
fn assert_estimate_within(got: &PromptTokens, full: usize, bound: f64, what: &str) {
    let err = (got.tokens() as f64 - full as f64) / full as f64;
    assert!(err.abs() < bound, "{what}: estimated {} vs {full} tokens", got.tokens());
}

fn long_chat(rng: &mut StdRng, words: usize) -> RequestInput {
    RequestInput::Messages(vec![
        msg("system", "You answer from the document.".into()),
        msg("user", words_text(rng, words)),
        msg("assistant", "ok".into()),
        msg("user", "summarise".into()),
    ])
}

#[test]
fn a_cold_prompt_stops_after_its_first_unheld_block_and_its_sample() {
    let tok = load_without_memo(8 << 20);
    let mut rng = StdRng::seed_from_u64(21);
    let input = long_chat(&mut rng, 20_000);
    let full = tok.tokens(&input, &mut CacheStats::default()).unwrap();
    let block = 16;
    // (held blocks reported, exact tokens asked past them)
    for (held_blocks, past) in [(0usize, 0usize), (0, 1024), (40, 0), (40, 3000), (usize::MAX, 0)] {
        let mut calls = 0;
        let mut held = |c: &[SequenceHash]| {
            calls += 1;
            c.len().min(held_blocks)
        };
        let got = tok
            .tokens_until(
                &input,
                &mut Reach::new(block, 1337, past, &mut held),
                &mut CacheStats::default(),
            )
            .unwrap();
        assert_eq!(
            &full[..got.ids.len()],
            &got.ids.to_vec()[..],
            "held {held_blocks} past {past}: ids are a prefix of the full encode"
        );
        assert_eq!(
            got.chains,
            kvmesh_core::hashing::sequence_hashes(&got.ids.to_vec(), block, 1337)
        );
        if held_blocks == usize::MAX {
            assert!(got.complete() && got.ids.to_vec() == full);
            continue;
        }
        assert!(!got.complete());
        let h = held_blocks.min(got.chains.len());
        assert!(
            got.ids.len() >= h * block + past,
            "held {held_blocks} past {past}: {} ids",
            got.ids.len()
        );
        // At most one chunk (≈ CHUNK_BYTES / 2 tokens at worst) beyond what was needed.
        let needed = (held_blocks * block + past).max(MIN_SAMPLE_BYTES / 2);
        assert!(
            got.ids.len() <= needed + CHUNK_BYTES,
            "held {held_blocks} past {past}: {} ids for {needed} needed",
            got.ids.len()
        );
        assert_estimate_within(&got, full.len(), 0.05, &format!("held {held_blocks}"));
    }
}

#[test]
fn the_estimate_error_of_the_untokenized_rest() {
    // Measured on prompts whose beginning resembles the rest (one document) and on real files.
    let tok = load(0);
    let mut rng = StdRng::seed_from_u64(33);
    let mut cases: Vec<(String, String)> = vec![
        ("bench words".into(), words_text(&mut rng, 30_000)),
        ("random boundaries".into(), random_text(&mut rng, 20_000)),
        ("cjk".into(), cjk_text(&mut rng, 20_000)),
        // The sample (the first chunk) is English, most of the rest is not.
        ("words then cjk".into(), words_text(&mut rng, 300) + &cjk_text(&mut rng, 20_000)),
    ];
    cases.extend(real_texts());
    let mut worst: f64 = 0.0;
    for (name, text) in &cases {
        let full = tok.tokenizer().encode(text).unwrap().len();
        let mut cold = |_: &[SequenceHash]| 0;
        let got = tok
            .tokens_until(
                &RequestInput::Prompt(Prompt::Text(text.clone())),
                &mut Reach::new(16, 1337, 0, &mut cold),
                &mut CacheStats::default(),
            )
            .unwrap();
        let err = (got.tokens() as f64 - full as f64) / full as f64;
        eprintln!(
            "estimate {name}: {} tokenized of {full}, estimated {} ({:+.1} %)",
            got.ids.len(),
            got.tokens(),
            err * 100.0
        );
        worst = worst.max(err.abs());
    }
    eprintln!("worst estimate error {:.1} %", worst * 100.0);
    assert!(worst < 0.15, "worst estimate error {:.1} %", worst * 100.0);
}

#[test]
fn token_prompts_are_whole_and_hashed() {
    let tok = load(0);
    let ids: Vec<u32> = (0..100).collect();
    let mut cold = |_: &[SequenceHash]| 0;
    let got = tok
        .tokens_until(
            &RequestInput::Prompt(Prompt::Tokens(ids.clone())),
            &mut Reach::new(16, 1337, 0, &mut cold),
            &mut CacheStats::default(),
        )
        .unwrap();
    assert!(got.complete());
    assert_eq!((got.ids.to_vec(), got.chains.len(), got.locals.len()), (ids, 6, 6));
}

#[test]
fn a_tail_shorter_than_the_cold_work_is_tokenized_not_estimated() {
    // The disaggregation case: 1024 exact tokens needed of a ~1.7k-token cold prompt.
    let tok = load_without_memo(0);
    let mut rng = StdRng::seed_from_u64(44);
    let input = long_chat(&mut rng, 1400);
    let full = tok.tokens(&input, &mut CacheStats::default()).unwrap();
    assert!(full.len() > 1024 + 256, "{}", full.len());
    let mut cold = |_: &[SequenceHash]| 0;
    let got = tok
        .tokens_until(
            &input,
            &mut Reach::new(16, 1337, 1024, &mut cold),
            &mut CacheStats::default(),
        )
        .unwrap();
    assert!(got.complete(), "{} of {} tokenized", got.ids.len(), full.len());
    assert_eq!(got.ids.to_vec(), full);
    // Without the threshold, the same prompt stops early (its rest is longer than its cold part).
    let got = tok
        .tokens_until(&input, &mut Reach::new(16, 1337, 0, &mut cold), &mut CacheStats::default())
        .unwrap();
    assert!(
        !got.complete() && got.ids.len() < full.len() / 2,
        "{} of {}",
        got.ids.len(),
        full.len()
    );
}

#[test]
fn a_short_new_turn_past_the_held_prefix_is_tokenized_whole() {
    // A continuation: the history is held and remembered; its new turn (< MIN_ESTIMATED_BYTES,
    // but longer than the first chunk) is encoded exactly rather than estimated.
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(45);
    let (mut history, held_blocks) = remembered_chat(&tok, &mut rng, 4_000);
    history.push(msg("assistant", words_text(&mut rng, 80)));
    history.push(msg("user", words_text(&mut rng, 60)));
    let rendered = tok.template.render(&history, true).unwrap();
    let tail = rendered.len() - tok.template.render(&history[..4], true).unwrap().len();
    assert!((FIRST_CHUNK_BYTES..MIN_ESTIMATED_BYTES).contains(&tail), "{tail}");
    let (ids, _, _) = full_blocks(&tok, &rendered, 16, 1337);
    let mut held = |c: &[SequenceHash]| c.len().min(held_blocks);
    let got = tok
        .tokens_until(
            &RequestInput::Messages(history),
            &mut Reach::new(16, 1337, 0, &mut held),
            &mut CacheStats::default(),
        )
        .unwrap();
    assert!(got.complete(), "{} of {} ids", got.ids.len(), ids.len());
    assert_eq!(got.ids.to_vec(), ids);
}

#[test]
fn siblings_of_an_estimated_prompt_resume_at_the_held_edge() {
    // A prompt routed cold stops early (estimated), so the memo lacks its end; its siblings (the
    // same history, each with its own new turn) are held up to that end once an engine cached it.
    // The first sibling tokenizes the history again and leaves an entry at the held edge; the
    // others resume there and encode only their own turn.
    let tok = load(64 << 20);
    let mut rng = StdRng::seed_from_u64(46);
    let mut history = vec![msg("system", words_text(&mut rng, 250))];
    for _ in 0..12 {
        history.push(msg("user", words_text(&mut rng, 120)));
        history.push(msg("assistant", words_text(&mut rng, 200)));
    }
    history.push(msg("user", words_text(&mut rng, 120)));
    let mut cold = |_: &[SequenceHash]| 0;
    let routed = tok
        .tokens_until(
            &RequestInput::Messages(history.clone()),
            &mut Reach::new(16, 1337, 0, &mut cold),
            &mut CacheStats::default(),
        )
        .unwrap();
    assert!(!routed.complete(), "the cold prompt stops early");
    let history_ids = load_without_memo(0)
        .tokens(&RequestInput::Messages(history.clone()), &mut CacheStats::default())
        .unwrap();
    let held_blocks = history_ids.len() / 16;
    for sibling in 0..4 {
        let mut h = history.clone();
        h.push(msg("assistant", words_text(&mut rng, 60)));
        h.push(msg("user", words_text(&mut rng, 40)));
        let rendered = tok.template.render(&h, true).unwrap();
        let (ids, chains, _) = full_blocks(&tok, &rendered, 16, 1337);
        let mut held = |c: &[SequenceHash]| c.len().min(held_blocks);
        let mut stats = CacheStats::default();
        let got = tok
            .tokens_until(
                &RequestInput::Messages(h),
                &mut Reach::new(16, 1337, 0, &mut held),
                &mut stats,
            )
            .unwrap();
        assert_eq!((&got.ids.to_vec(), &got.chains), (&ids, &chains), "sibling {sibling}");
        assert_eq!(stats.memo_hits, 1, "sibling {sibling}");
        if sibling == 0 {
            assert!(
                stats.hits + stats.misses > 20,
                "the first sibling goes through the history: {stats:?}"
            );
        } else {
            // Only the new turn's pieces: the assistant reply, the user message, nothing of the history.
            assert_eq!(
                (stats.hits, stats.misses),
                (0, 3),
                "sibling {sibling} resumed at the held edge"
            );
        }
    }
}

// === resuming a long prompt from its tail ===

#[test]
fn long_conversations_resume_from_their_tail_with_the_ids_of_a_full_encode() {
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(23);
    let (mut resumed, mut tail_hits) = (0, 0);
    for conversation in 0..3 {
        // A system prompt past MIN_TAIL_SPLIT_BYTES, then turns with added tokens written by users.
        let mut history = vec![msg("system", words_text(&mut rng, 7_000))];
        assert!(history[0].content.len() >= MIN_TAIL_SPLIT_BYTES, "{}", history[0].content.len());
        for turn in 0..12 {
            let n = rng.gen_range(1..80);
            history.push(msg("user", random_text(&mut rng, n)));
            let what = format!("conversation {conversation} turn {turn}");
            let stats = checked(&tok, &history, &what);
            if turn > 0 {
                assert_eq!(stats.memo_hits + stats.memo_tail_hits, 1, "{what}: {stats:?}");
                resumed += 1;
            }
            tail_hits += stats.memo_tail_hits;
            let n = rng.gen_range(1..80);
            history.push(msg("assistant", random_text(&mut rng, n)));
        }
    }
    // The next turn's boundary lies in the last quarter: every resume found it there.
    assert_eq!((resumed, tail_hits), (33, 33));
}

#[test]
fn a_turn_past_the_shortest_tail_resumes_from_the_longer_one() {
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(25);
    let history =
        vec![msg("system", words_text(&mut rng, 7_000)), msg("user", random_text(&mut rng, 20))];
    checked(&tok, &history, "the prefix");
    let prefix = tok.template.render(&history, false).unwrap().len();
    // A short turn ends within the last 1/32 of the text past the kept boundary; a long one
    // (~1/10 of the prefix) only within the last quarter: both resume from the tail, exactly.
    for (what, words) in [("a short turn", 20), ("a long turn", 1_000)] {
        let mut m = history.clone();
        m.push(msg("assistant", words_text(&mut rng, words)));
        m.push(msg("user", random_text(&mut rng, 5)));
        let past = tok.template.render(&m, true).unwrap().len() - prefix;
        let whole = prefix + past;
        assert_eq!(
            (past < whole / 32, past < whole / 4),
            (words == 20, true),
            "{what}: {past} of {whole} bytes past the kept boundary"
        );
        let stats = checked(&tok, &m, what);
        assert_eq!((stats.memo_tail_hits, stats.memo_hits), (1, 0), "{what}: {stats:?}");
    }
}

#[test]
fn an_edit_in_a_long_prompt_resumes_only_where_the_text_is_the_same() {
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(24);
    let mut history = vec![msg("system", words_text(&mut rng, 7_000))];
    for _ in 0..6 {
        history.push(msg("user", random_text(&mut rng, 30)));
        history.push(msg("assistant", random_text(&mut rng, 30)));
    }
    let check = |messages: &[ChatMessage], what: &str| checked(&tok, messages, what);
    check(&history, "the prefix");
    let last = history.len() - 1;
    // Edits in the tail (the last assistant message, or an added token written into it) and at
    // the start (the system prompt): never a wrong id, wherever the memo resumes.
    for (at, edit) in [
        (last, "X"),
        (last, "<｜User｜>"),
        (last, "<｜end▁of▁sentence｜>"),
        (0, "X"),
        (0, "<｜Assistant｜>"),
    ] {
        let mut m = history.clone();
        m[at].content = format!("{edit}{}", m[at].content).into();
        m.push(msg("user", format!("after an edit of message {at}")));
        let stats = check(&m, edit);
        if at == 0 {
            assert_eq!(
                stats.memo_hits + stats.memo_tail_hits,
                0,
                "an edited system prompt shares no boundary: {stats:?}"
            );
        }
    }
    // A user turn that ends in a piece of an added token, then one that completes it.
    let mut m = history.clone();
    m.push(msg("user", "half <｜Assist".into()));
    check(&m, "a piece of an added token");
    m.push(msg("assistant", "ant｜> whole".into()));
    m.push(msg("user", "next".into()));
    check(&m, "the piece completed by the next message");
}

#[test]
fn a_yielding_tokenization_asks_before_each_chunk_and_stops_when_told() {
    let tok = load_without_memo(1 << 20);
    let mut rng = StdRng::seed_from_u64(31);
    let messages =
        vec![msg("system", random_text(&mut rng, 2000)), msg("user", random_text(&mut rng, 300))];
    let input = RequestInput::Messages(messages.clone());
    let rendered = tok.template.render(&messages, true).unwrap();
    let (ids, chains, _) = full_blocks(&tok, &rendered, 16, 1337);

    // Let through: the ids are a full encode's, and it was asked once per chunk (several).
    let mut asked = 0;
    let mut go_on = || {
        asked += 1;
        true
    };
    let got = tok
        .tokens_until(
            &input,
            &mut Reach::whole_blocks(16, 1337).yielding(&mut go_on),
            &mut CacheStats::default(),
        )
        .unwrap();
    assert_eq!((got.ids.to_vec(), got.chains), (ids, chains));
    assert!(asked > 3, "asked {asked} times for {} bytes", rendered.len());

    // Told to stop at the third chunk: it stops there, with the error that says so.
    let mut asked = 0;
    let mut stop_third = || {
        asked += 1;
        asked < 3
    };
    let stopped = tok.tokens_until(
        &input,
        &mut Reach::whole_blocks(16, 1337).yielding(&mut stop_third),
        &mut CacheStats::default(),
    );
    assert!(matches!(stopped, Err(TokenizeError::GaveWay)), "{:?}", stopped.map(|t| t.ids.len()));
    assert_eq!(asked, 3);
}

#[test]
fn a_budgeted_tokenization_refuses_more_new_text_than_its_budget_before_encoding_any() {
    let tok = load(8 << 20);
    let mut rng = StdRng::seed_from_u64(32);
    let budget = 4 * 1024;
    let mut history = vec![msg("system", words_text(&mut rng, 3_000))];
    history.push(msg("user", random_text(&mut rng, 40)));
    let within = |tok: &PromptTokenizer, messages: &[ChatMessage]| {
        tok.tokens_until(
            &RequestInput::Messages(messages.to_vec()),
            &mut Reach::whole_blocks(16, 1337).within(budget),
            &mut CacheStats::default(),
        )
    };
    let rendered = |m: &[ChatMessage]| tok.template.render(m, true).unwrap();

    // Nothing held: all of its text is new, over the budget; refused, and nothing was kept.
    let memo_before = tok.memo_bytes();
    let refused = within(&tok, &history);
    let fresh = rendered(&history).len();
    assert!(
        matches!(refused, Err(TokenizeError::OverBudget { fresh: f, budget: b }) if (f, b) == (fresh, budget)),
        "{:?}",
        refused.map(|t| t.ids.len())
    );
    assert_eq!(tok.memo_bytes(), memo_before, "a refused tokenization keeps nothing in the memo");

    // Tokenized whole once (as the pool does), its next turn resumes from the memo: a few hundred
    // bytes are new, within the budget, and the ids are a full encode's.
    checked(&tok, &history, "the conversation so far");
    history.push(msg("assistant", random_text(&mut rng, 30)));
    history.push(msg("user", random_text(&mut rng, 30)));
    let (ids, chains, _) = full_blocks(&tok, &rendered(&history), 16, 1337);
    let got = within(&tok, &history).expect("a short new turn is within the budget");
    assert_eq!((got.ids.to_vec(), got.chains), (ids, chains));

    // A long new turn past the same prefix is over it again.
    history.push(msg("assistant", words_text(&mut rng, 2_000)));
    history.push(msg("user", random_text(&mut rng, 10)));
    assert!(
        matches!(within(&tok, &history), Err(TokenizeError::OverBudget { fresh, .. }) if fresh > budget && fresh < rendered(&history).len() / 2)
    );
}
