use super::*;
use kvmesh_core::openai::ChatMessage;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn load(cache_bytes: usize) -> PromptTokenizer {
    let path = kvmesh_tokens::default_tokenizer_path();
    PromptTokenizer::load(&path, None, "<｜begin▁of▁sentence｜>", cache_bytes)
        .unwrap_or_else(|e| panic!("{e} (run `make setup` for the DeepSeek tokenizer)"))
}

/// Text with every kind of boundary a BPE pre-tokenizer cares about: words, digit runs, CJK and
/// kana runs, punctuation, whitespace runs, newlines, emoji, and added tokens written by users.
fn random_text(rng: &mut StdRng, words: usize) -> String {
    const PIECES: &[&str] = &[
        "hello", " world", "The", " quick", "brown", "fox", "12345", "3.14159", "2024-01-01", "你好", "世界", "こんにちは", "カタカナ",
        "!", "?", "...", ", ", "; ", "(", ")", "\"quoted\"", "'s", "don't", "\n", "\n\n", "  ", "\t", "   x", " ", "🙂", "é", "naïve",
        "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜end▁of▁sentence｜>", "<|EOT|>", "fn main() { x += 1; }", "a_b", "CamelCase",
        "URL: https://example.invalid/a?b=c", "—", "%", "$100", "#tag", "@user",
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
    ChatMessage { role: role.into(), content }
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
    let tok = load(8 * 1024 * 1024);
    let mut rng = StdRng::seed_from_u64(11);
    let mut history = vec![msg("system", random_text(&mut rng, 200)), msg("user", "first question".into())];
    let mut stats = CacheStats::default();
    tok.tokens(&RequestInput::Messages(history.clone()), &mut stats).unwrap();
    history.push(msg("assistant", "an answer".into()));
    history.push(msg("user", "a follow-up".into()));
    let mut stats = CacheStats::default();
    tok.tokens(&RequestInput::Messages(history), &mut stats).unwrap();
    // New: the answer and the follow-up. Everything else comes from the cache.
    assert_eq!(stats.misses, 2, "{stats:?}");
    assert!(stats.hits >= 2, "{stats:?}");
}

#[test]
fn completions_text_and_token_prompts() {
    let tok = load(1024 * 1024);
    let mut stats = CacheStats::default();
    let text = "<｜begin▁of▁sentence｜>Hello, world! 12345 你好";
    let ids = tok.tokens(&RequestInput::Prompt(Prompt::Text(text.into())), &mut stats).unwrap();
    assert_eq!(ids, tok.tokenizer().encode(text).unwrap());
    let passthrough = tok.tokens(&RequestInput::Prompt(Prompt::Tokens(vec![5, 6, 7])), &mut stats).unwrap();
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
    let splitter = SegmentSplitter::from_tokenizer_json(&kvmesh_tokens::default_tokenizer_path()).unwrap();
    let mut out = Vec::new();
    splitter.split("a<｜User｜>b<｜User｜><｜Assistant｜>", &mut out);
    assert_eq!(out, vec![Segment::Text("a"), Segment::Added(128_803), Segment::Text("b"), Segment::Added(128_803), Segment::Added(128_804)]);
    SegmentSplitter::none().split("a<｜User｜>", &mut out);
    assert_eq!(out, vec![Segment::Text("a<｜User｜>")]);
}
