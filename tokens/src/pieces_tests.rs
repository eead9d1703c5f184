// Needs `make setup` (the DeepSeek tokenizer); the Makefile runs it before the tests.
use std::sync::OnceLock;

use tokenizers::{OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer};

use super::*;
use crate::{default_tokenizer_path, Tokenizer};

fn deepseek() -> &'static Tokenizer {
    static TOKENIZER: OnceLock<Tokenizer> = OnceLock::new();
    TOKENIZER.get_or_init(|| Tokenizer::from_file(default_tokenizer_path()).unwrap())
}

/// The pre-tokens `tokenizers` gives for `text`, as byte ranges.
fn library_pre_tokens(text: &str) -> Vec<std::ops::Range<usize>> {
    let pre = deepseek().inner.get_pre_tokenizer().unwrap();
    let mut pretokenized = PreTokenizedString::from(text);
    pre.pre_tokenize(&mut pretokenized).unwrap();
    pretokenized
        .get_splits(OffsetReferential::Original, OffsetType::Byte)
        .into_iter()
        .map(|(_, (start, end), _)| start..end)
        .collect()
}

fn direct_pre_tokens(text: &str) -> Vec<std::ops::Range<usize>> {
    let mut out = Vec::new();
    pre_tokens(text.as_bytes(), |range| out.push(range));
    out
}

/// Whether `text` holds an added token (`encode_piece` is for text cut at them).
fn holds_added_token(text: &str) -> bool {
    deepseek().inner.get_added_tokens_decoder().values().any(|t| text.contains(t.content.as_str()))
}

#[test]
fn the_deepseek_tokenizer_encodes_ascii_directly() {
    assert!(deepseek().encodes_ascii_directly());
}

/// Every string of up to 4 bytes over an alphabet with a byte of each class the regexes tell
/// apart (spaces, both newlines, the other whitespace, control bytes, letters, a digit,
/// punctuation and symbols): the same pre-tokens as the library.
#[test]
fn pre_tokens_are_the_librarys_on_every_short_string() {
    let alphabet = b" \n\r\t\x0b\x0c\x00\x1f\x7faZ7.($";
    let mut text = Vec::new();
    let mut checked = 0;
    for len in 1..=4u32 {
        for mut n in 0..alphabet.len().pow(len) {
            text.clear();
            for _ in 0..len {
                text.push(alphabet[n % alphabet.len()]);
                n /= alphabet.len();
            }
            let text = std::str::from_utf8(&text).unwrap();
            assert_eq!(direct_pre_tokens(text), library_pre_tokens(text), "{text:?}");
            checked += 1;
        }
    }
    assert_eq!(checked, 15 + 15 * 15 + 15usize.pow(3) + 15usize.pow(4));
}

#[test]
fn realistic_ascii_encodes_as_the_library_does() {
    let texts = [
        "Hello, world! It's 2026-12-03T21:21:23Z; the answer is 42.\n\nNext paragraph:\tcols\r\n",
        "fn main() {\n    let x = vec![1, 2, 3];\n    println!(\"{x:?}\"); // done\n}\n\n\n   ",
        "{\"role\": \"user\", \"content\": \"What's up?\"}, [1,22,333,4444,55555]   trailing  ",
        "   leading spaces, -dash, --double, ...ellipsis, $100.00, 50%, a_b_c, CamelCase, URL: https://x.io/a?b=c",
        "\n\n\n",
        " ",
        "x",
        "1234567",
        "a  b   c    d\t\te \n f\r\ng",
        "<div class=\"x\">text</div> <|not added|>",
    ];
    for text in texts {
        assert!(!holds_added_token(text), "{text:?}");
        assert_eq!(direct_pre_tokens(text), library_pre_tokens(text), "{text:?}");
        assert_eq!(
            deepseek().encode_piece(text).unwrap(),
            deepseek().encode(text).unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn text_with_non_ascii_chars_encodes_as_the_library_does() {
    for text in [
        "naïve café — “quoted” 你好世界 カタカナ 123４５６",
        "The router — unlike round robin — keeps “sessions” where their cache is.\nNext line: ok",
        "é",
        "a é b",
        "\né\nx",
        "你好 world\nhello 世界",
        "emoji 🚀 at the end 🚀",
    ] {
        assert_eq!(
            deepseek().encode_piece(text).unwrap(),
            deepseek().encode(text).unwrap(),
            "{text:?}"
        );
    }
}

#[test]
fn another_pipeline_is_not_encoded_directly() {
    let json = std::fs::read(default_tokenizer_path()).unwrap();
    assert!(has_deepseek_pipeline(&json));
    let mut file: serde_json::Value = serde_json::from_slice(&json).unwrap();
    file["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] =
        serde_json::json!(r"\p{N}{1,4}");
    let changed = serde_json::to_vec(&file).unwrap();
    assert!(!has_deepseek_pipeline(&changed));
    let path =
        std::env::temp_dir().join(format!("kvmesh-tokens-pieces-{}.json", std::process::id()));
    std::fs::write(&path, &changed).unwrap();
    let tokenizer = Tokenizer::from_file(&path);
    std::fs::remove_file(&path).unwrap();
    let tokenizer = tokenizer.unwrap();
    assert!(!tokenizer.encodes_ascii_directly());
    assert_eq!(
        tokenizer.encode_piece("year 12345").unwrap(),
        tokenizer.encode("year 12345").unwrap()
    );
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(512))]

    /// Any ASCII text (every byte, runs of whitespace, digits and punctuation weighted up): the
    /// library's pre-tokens and ids.
    #[test]
    fn any_ascii_text_encodes_as_the_library_does(
        text in "([\\x00-\\x7f]|[ \\t\\r\\n]{1,4}|[0-9]{1,5}|[a-zA-Z]{1,8}|[!-/:-@\\[-`{-~]{1,3}){0,60}"
    ) {
        proptest::prop_assume!(!holds_added_token(&text));
        proptest::prop_assert_eq!(direct_pre_tokens(&text), library_pre_tokens(&text));
        proptest::prop_assert_eq!(deepseek().encode_piece(&text).unwrap(), deepseek().encode(&text).unwrap());
    }

    /// ASCII prose and code with non-ASCII chars anywhere (Latin accents, punctuation, CJK, kana,
    /// full-width digits, emoji, non-ASCII whitespace and marks): the library's ids.
    #[test]
    fn mixed_text_encodes_as_the_library_does(
        text in "([ -~]{1,12}|[\\n\\t ]{1,3}|[0-9]{1,4}|[éüñ—–“”’…•€°]|[你好世界路由]{1,3}|[カタひら]{1,2}|[０-９]{1,2}|🚀|[\\u{a0}\\u{3000}\\u{2028}]|e\\u{301}|\\PC){0,40}"
    ) {
        proptest::prop_assume!(!holds_added_token(&text));
        proptest::prop_assert_eq!(deepseek().encode_piece(&text).unwrap(), deepseek().encode(&text).unwrap());
    }
}

/// The word cache answers repeats with the same ids and never holds more than its bound: it
/// starts again when full.
#[test]
fn the_word_cache_is_exact_and_bounded() {
    let tokenizer = Tokenizer::from_file(default_tokenizer_path()).unwrap();
    let cached_words = || tokenizer.ascii.as_ref().unwrap().words.read().unwrap().len();
    let text = "Repeated words, repeated ids: the the the cache cache.";
    let first = tokenizer.encode_piece(text).unwrap();
    assert!(cached_words() > 0);
    assert_eq!(tokenizer.encode_piece(text).unwrap(), first);
    assert_eq!(first, tokenizer.encode(text).unwrap());
    // More distinct letter-only words than the cache holds (digits would be pre-tokens of their own).
    let word = |mut n: usize| {
        let mut w = String::from(" q");
        for _ in 0..4 {
            w.push(char::from(b'a' + (n % 26) as u8));
            n /= 26;
        }
        w
    };
    let flood: String = (0..WORD_CACHE_ENTRIES + 100).map(word).collect();
    tokenizer.encode_piece(&flood).unwrap();
    assert!(cached_words() <= WORD_CACHE_ENTRIES, "{} words cached", cached_words());
    assert!(cached_words() >= 100, "the cache starts again, it does not stop learning");
    assert_eq!(tokenizer.encode_piece(text).unwrap(), first);
}
