//! Cutting text at added tokens the way `tokenizers`' `AddedVocabulary` does (two passes:
//! non-normalized tokens on the raw text, then normalized ones in the remaining pieces), and whether
//! the tokenizer's normalizer and pre-tokenizer are the ones [`super::safe_cut`] is proved for.

use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};

use super::TokenizeError;
/// Cuts text at added tokens, the way `tokenizers`' `AddedVocabulary` does.
pub struct SegmentSplitter {
    raw: Option<AddedTokens>,
    normalized: Option<AddedTokens>,
    /// Whether pieces may be cut into chunks at [`safe_cut`](super::safe_cut) boundaries (the tokenizer's normalizer
    /// and pre-tokenizer are the ones the rule is proved for).
    chunks: bool,
}

/// One pass's added tokens: the automaton that cuts (leftmost-longest, as `tokenizers`), one that
/// finds every occurrence (for [`SegmentSplitter::cuts_at`]), and their ids.
struct AddedTokens {
    cut: AhoCorasick,
    every: AhoCorasick,
    ids: Vec<u32>,
}

/// A piece of text: an added token (with its id) or plain text between added tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Segment<'a> {
    Added(u32),
    Text(&'a str),
}

#[derive(serde::Deserialize)]
struct AddedTokenDecl {
    id: u32,
    content: String,
    #[serde(default)]
    normalized: bool,
}

#[derive(serde::Deserialize)]
struct TokenizerFile {
    #[serde(default)]
    added_tokens: Vec<AddedTokenDecl>,
}

impl SegmentSplitter {
    /// Reads the `added_tokens` of a `tokenizer.json`.
    ///
    /// Only valid for tokenizers whose added tokens have no `lstrip`/`rstrip`/`single_word` and whose
    /// normalizer is the identity (DeepSeek's); [`PromptTokenizer::load`](super::PromptTokenizer::load) checks the result on a probe
    /// text and falls back to whole-text encoding otherwise.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self, TokenizeError> {
        let err = |reason: String| TokenizeError::AddedTokens {
            path: path.display().to_string(),
            reason,
        };
        let text = std::fs::read(path).map_err(|e| err(e.to_string()))?;
        let file: TokenizerFile = serde_json::from_slice(&text).map_err(|e| err(e.to_string()))?;
        // The cut rule is proved for the DeepSeek-V4 normalizer and pre-tokenizer only.
        let chunks = kvmesh_tokens::has_deepseek_pipeline(&text);
        if !chunks {
            tracing::info!("tokenizer's pre-tokenizer is not DeepSeek-V4's: pieces between added tokens are encoded whole");
        }
        let (norm, raw): (Vec<_>, Vec<_>) =
            file.added_tokens.into_iter().partition(|t| t.normalized);
        Ok(Self {
            raw: automaton(raw).map_err(err)?,
            normalized: automaton(norm).map_err(err)?,
            chunks,
        })
    }

    /// A splitter that never splits (whole-text encoding).
    pub fn none() -> Self {
        Self { raw: None, normalized: None, chunks: false }
    }

    /// Whether long pieces are cut into chunks at [`safe_cut`](super::safe_cut) boundaries.
    pub fn chunks(&self) -> bool {
        self.chunks
    }

    /// Whether no added token occurs in `text` starting before byte `at` and ending after it.
    ///
    /// Why the prefix memo asks (`super::memo`): let an earlier text `e` have a segment boundary at
    /// `at` and agree with `text` on `..at`. Every occurrence in `text` that ends by `at` is one in
    /// `e` too, and here none spans `at`; so each pass (leftmost-longest, a search resuming where
    /// the last match ended) decides the same in both texts until it reaches `at`, where `e`'s
    /// split has a match end, and from there it searches `text[at..]` afresh. So `text`'s segments
    /// are `e`'s up to `at`, then [`Self::split_from`]`(text, at)`'s. Either pass counts (a
    /// normalized token spanning `at` would only matter inside a raw piece; refusing it is safe).
    pub fn cuts_at(&self, text: &str, at: usize) -> bool {
        let bytes = text.as_bytes();
        [&self.raw, &self.normalized].into_iter().flatten().all(|t| {
            let reach = t.every.max_pattern_len().saturating_sub(1);
            let from = at.saturating_sub(reach);
            let window = bytes.get(from..bytes.len().min(at + reach)).unwrap_or_default();
            !t.every
                .find_overlapping_iter(window)
                .any(|m| from + m.start() < at && from + m.end() > at)
        })
    }

    /// The segments of `text`, in order; concatenated they are `text`.
    pub fn split<'a>(&self, text: &'a str, out: &mut Vec<Segment<'a>>) {
        self.split_with_ends(text, out, &mut Vec::new());
    }

    /// [`Self::split`], and in `ends` the byte offset in `text` where each segment ends.
    pub fn split_with_ends<'a>(
        &self,
        text: &'a str,
        out: &mut Vec<Segment<'a>>,
        ends: &mut Vec<usize>,
    ) {
        self.split_from(text, 0, out, ends);
    }

    /// [`Self::split_with_ends`] of `text[from..]` (`from` a char boundary), offsets in `text`.
    pub fn split_from<'a>(
        &self,
        text: &'a str,
        from: usize,
        out: &mut Vec<Segment<'a>>,
        ends: &mut Vec<usize>,
    ) {
        out.clear();
        ends.clear();
        let mut first = Vec::new();
        let mut first_ends = Vec::new();
        split_with(
            self.raw.as_ref(),
            text.get(from..).unwrap_or_default(),
            from,
            &mut first,
            &mut first_ends,
        );
        for (seg, end) in first.into_iter().zip(first_ends) {
            match seg {
                Segment::Text(t) => {
                    split_with(self.normalized.as_ref(), t, end - t.len(), out, ends)
                }
                added => {
                    out.push(added);
                    ends.push(end);
                }
            }
        }
    }
}

fn automaton(tokens: Vec<AddedTokenDecl>) -> Result<Option<AddedTokens>, String> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let ids = tokens.iter().map(|t| t.id).collect();
    let build = |kind| {
        AhoCorasick::builder()
            .match_kind(kind)
            .build(tokens.iter().map(|t| t.content.as_str()))
            .map_err(|e| e.to_string())
    };
    Ok(Some(AddedTokens {
        cut: build(MatchKind::LeftmostLongest)?,
        every: build(MatchKind::Standard)?,
        ids,
    }))
}

fn split_with<'a>(
    ac: Option<&AddedTokens>,
    text: &'a str,
    base: usize,
    out: &mut Vec<Segment<'a>>,
    ends: &mut Vec<usize>,
) {
    let Some(AddedTokens { cut: ac, ids, .. }) = ac else {
        if !text.is_empty() {
            out.push(Segment::Text(text));
            ends.push(base + text.len());
        }
        return;
    };
    let mut at = 0;
    for m in ac.find_iter(text) {
        if m.start() > at {
            out.push(Segment::Text(&text[at..m.start()]));
            ends.push(base + m.start());
        }
        out.push(Segment::Added(ids[m.pattern().as_usize()]));
        ends.push(base + m.end());
        at = m.end();
    }
    if at < text.len() {
        out.push(Segment::Text(&text[at..]));
        ends.push(base + text.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Added tokens that overlap every way a cut can go wrong: one the start of another (`<A>`,
    /// `<A>B`), one ending inside another (`A>B<`), and normalized ones (`BB`, `B<A`) cut inside
    /// the raw pass's pieces.
    fn overlapping() -> SegmentSplitter {
        let json = serde_json::json!({"added_tokens": [
            {"id": 1, "content": "<A>", "normalized": false},
            {"id": 2, "content": "<A>B", "normalized": false},
            {"id": 3, "content": "A>B<", "normalized": false},
            {"id": 4, "content": "xy", "normalized": false},
            {"id": 5, "content": "BB", "normalized": true},
            {"id": 6, "content": "B<A", "normalized": true},
        ]});
        let dir = std::env::temp_dir().join(format!(
            "kvmesh-split-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tokenizer.json");
        std::fs::write(&path, json.to_string()).unwrap();
        let splitter = SegmentSplitter::from_tokenizer_json(&path).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        splitter
    }

    fn split_all<'a>(s: &SegmentSplitter, text: &'a str) -> (Vec<Segment<'a>>, Vec<usize>) {
        let (mut out, mut ends) = (Vec::new(), Vec::new());
        s.split_with_ends(text, &mut out, &mut ends);
        (out, ends)
    }

    /// `text`'s segments as `earlier`'s up to `at`, then a split of `text[at..]` alone.
    fn resumed<'a>(
        s: &SegmentSplitter,
        earlier: &'a str,
        text: &'a str,
        at: usize,
    ) -> Vec<Segment<'a>> {
        let (before, ends) = split_all(s, earlier);
        let (mut after, mut after_ends) = (Vec::new(), Vec::new());
        s.split_from(text, at, &mut after, &mut after_ends);
        let mut joined: Vec<Segment<'a>> = before
            .into_iter()
            .zip(ends)
            .take_while(|&(_, end)| end <= at)
            .map(|(seg, _)| seg)
            .collect();
        // The earlier text's pieces before `at` are the same bytes as `text`'s.
        joined.extend(after);
        joined
    }

    #[test]
    fn a_token_spanning_the_cut_is_refused() {
        let s = overlapping();
        // `<A>` ends at 3 in "<A>x", but in "<A>B" the longer `<A>B` spans 3.
        assert_eq!(split_all(&s, "<A>x").0[0], Segment::Added(1));
        assert!(!s.cuts_at("<A>B", 3));
        assert_ne!(split_all(&s, "<A>B").0, resumed(&s, "<A>x", "<A>B", 3));
        // A token starting before the cut and ending past it: `A>B<` over "xy<A>B<".
        assert!(!s.cuts_at("<A>B<", 3) && !s.cuts_at("xyB<A", 3) && !s.cuts_at("xB<A", 2));
        assert!(
            s.cuts_at("<A>x", 3) && s.cuts_at("xy", 2) && s.cuts_at("xy", 0) && s.cuts_at("", 0)
        );
        assert!(SegmentSplitter::none().cuts_at("<A>B", 3));
    }

    proptest! {
        /// What the prefix memo relies on ([`SegmentSplitter::cuts_at`]'s doc): a text that agrees
        /// with an earlier one up to an added token's end there, and that no added token spans,
        /// splits as the earlier one up to it and then as its own rest alone.
        #[test]
        fn a_cut_no_token_spans_resumes_the_split_exactly(
            earlier in "[<A>Bxy]{0,24}",
            rest in "[<A>Bxy]{0,16}",
            pick in any::<prop::sample::Index>(),
        ) {
            let s = overlapping();
            let (segs, ends) = split_all(&s, &earlier);
            let cuts: Vec<usize> = segs.iter().zip(&ends).filter(|(seg, _)| matches!(seg, Segment::Added(_))).map(|(_, &e)| e).collect();
            prop_assume!(!cuts.is_empty());
            let at = cuts[pick.index(cuts.len())];
            let text = format!("{}{rest}", &earlier[..at]);
            if s.cuts_at(&text, at) {
                prop_assert_eq!(split_all(&s, &text).0, resumed(&s, &earlier, &text, at));
            }
        }
    }
}
