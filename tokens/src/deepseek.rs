//! What kvmesh relies on about the DeepSeek-V4 tokenizer's pipeline: its normalizer and
//! pre-tokenizer as its `tokenizer.json` writes them (one definition: a tokenizer is treated as
//! DeepSeek-V4's only when its file says exactly this), and the boundaries where text may be cut
//! and encoded in parts with the ids of the whole ([`safe_cut`]).

/// The DeepSeek-V4 pre-tokenizer's word regex (its third split), as its `tokenizer.json` writes it.
const WORD_REGEX: &str = concat!(
    r##"[!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+"##,
    r"|[^",
    "\r\n",
    r"\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+",
    r"| ?[\p{P}\p{S}]+[",
    "\r\n",
    "]*",
    r"|\s*[",
    "\r\n",
    "]+",
    r"|\s+(?!\S)|\s+",
);

/// The DeepSeek-V4 `tokenizer.json` normalizer (none) and pre-tokenizer, as JSON values: digits
/// isolated in runs of 1–3, CJK/kana runs isolated, then the word regex, then bytes. What
/// [`safe_cut`] is proved for and the direct ASCII encoder (`pieces.rs`) is written from.
pub fn deepseek_pipeline() -> (serde_json::Value, serde_json::Value) {
    let split = |re: &str| serde_json::json!({"type": "Split", "pattern": {"Regex": re}, "behavior": "Isolated", "invert": false});
    let normalizer = serde_json::json!({"type": "Sequence", "normalizers": []});
    let pre = serde_json::json!({"type": "Sequence", "pretokenizers": [
        split(r"\p{N}{1,3}"),
        split("[\u{4e00}-\u{9fa5}\u{3040}-\u{309f}\u{30a0}-\u{30ff}]+"),
        split(WORD_REGEX),
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false},
    ]});
    (normalizer, pre)
}

/// Whether a `tokenizer.json` (its bytes) has [`deepseek_pipeline`]'s normalizer and pre-tokenizer.
pub fn has_deepseek_pipeline(tokenizer_json: &[u8]) -> bool {
    #[derive(serde::Deserialize)]
    struct Pipeline {
        #[serde(default)]
        normalizer: serde_json::Value,
        #[serde(default)]
        pre_tokenizer: serde_json::Value,
    }
    let Ok(file) = serde_json::from_slice::<Pipeline>(tokenizer_json) else {
        return false;
    };
    let (normalizer, pre) = deepseek_pipeline();
    file.normalizer == normalizer && file.pre_tokenizer == pre
}

fn is_cjk(c: char) -> bool {
    matches!(c, '\u{4e00}'..='\u{9fa5}' | '\u{3040}'..='\u{309f}' | '\u{30a0}'..='\u{30ff}')
}

/// Whether text with `before` as the last char of a prefix and `after` as the first of the rest may
/// be encoded as two halves: the DeepSeek-V4 pre-tokenizer then gives exactly the pre-tokens of the
/// whole, so (BPE encoding each pre-token on its own) the ids too. Three boundaries qualify:
///
/// 1. `\n` then a char that is alphanumeric or ASCII-graphic (never whitespace).
/// 2. an ASCII letter then a space.
/// 3. a CJK/kana char (the second split's ranges) then one outside them.
///
/// Why, split by split (each is a left-to-right scan with no look-behind and no anchors, so a scan
/// restarts identically at a position no match spans, and the pieces before it are the same when
/// no match attempt that starts before it reads differently at it):
/// - `\p{N}{1,3}`: `before` is never a digit (`\n`, a letter, CJK), so no match spans the cut; a
///   non-matched stretch spanning it becomes two stretches, which the next splits see separately —
///   fine when they, too, split there.
/// - CJK runs `[…]+`: in 1 and 2 `before` is not CJK; in 3 the run ends at the cut (greedy, `after`
///   is outside), so the scan restarts there.
/// - the word regex `A1|A2|A3|A4|A5|A6` (`[punct][A-Za-z]+`, `[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+`,
///   ` ?[\p{P}\p{S}]+[\r\n]*`, `\s*[\r\n]+`, `\s+(?!\S)`, `\s+`). Rule 1: only A3–A6 can take a
///   `\n`, and each stops before a non-whitespace `after` — exactly as at the end of the prefix, except
///   A5's look-ahead; but A5 is tried at a start `s` only when A4 failed there, i.e. the whitespace
///   from `s` holds no newline, so it never reaches the `\n` and never looks at the cut. A4 matches
///   any `\n` a scan reaches, so the match holding `before` ends exactly at the cut. Rule 2: only A1
///   and A2 take letters; both are greedy over letters and stop at the space, with or without the
///   rest; so the match holding `before` ends at the cut. Rule 3: CJK pieces are already isolated.
/// - ByteLevel (no regex) maps bytes; the normalizer is the identity.
///
/// The indexer's `tokenize_tests` check every such cut in generated and real text against a full
/// encode, and the chunked encoding too.
pub fn safe_cut(before: char, after: char) -> bool {
    (before == '\n' && (after.is_alphanumeric() || after.is_ascii_graphic()))
        || (before.is_ascii_alphabetic() && after == ' ')
        || (is_cjk(before) && !is_cjk(after))
}
