//! Cutting text at added tokens the way `tokenizers`' `AddedVocabulary` does (two passes:
//! non-normalized tokens on the raw text, then normalized ones in the remaining pieces), and whether
//! the tokenizer's normalizer and pre-tokenizer are the ones [`super::safe_cut`] is proved for.

use std::path::Path;

use aho_corasick::{AhoCorasick, MatchKind};

use super::TokenizeError;
/// Cuts text at added tokens, the way `tokenizers`' `AddedVocabulary` does.
pub struct SegmentSplitter {
    raw: Option<(AhoCorasick, Vec<u32>)>,
    normalized: Option<(AhoCorasick, Vec<u32>)>,
    /// Whether pieces may be cut into chunks at [`safe_cut`](super::safe_cut) boundaries (the tokenizer's normalizer
    /// and pre-tokenizer are the ones the rule is proved for).
    chunks: bool,
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
        Self {
            raw: None,
            normalized: None,
            chunks: false,
        }
    }

    /// Whether long pieces are cut into chunks at [`safe_cut`](super::safe_cut) boundaries.
    pub fn chunks(&self) -> bool {
        self.chunks
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
        out.clear();
        ends.clear();
        let mut first = Vec::new();
        let mut first_ends = Vec::new();
        split_with(self.raw.as_ref(), text, 0, &mut first, &mut first_ends);
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

fn automaton(tokens: Vec<AddedTokenDecl>) -> Result<Option<(AhoCorasick, Vec<u32>)>, String> {
    if tokens.is_empty() {
        return Ok(None);
    }
    let ids = tokens.iter().map(|t| t.id).collect();
    let ac = AhoCorasick::builder()
        .match_kind(MatchKind::LeftmostLongest)
        .build(tokens.iter().map(|t| t.content.as_str()))
        .map_err(|e| e.to_string())?;
    Ok(Some((ac, ids)))
}

fn split_with<'a>(
    ac: Option<&(AhoCorasick, Vec<u32>)>,
    text: &'a str,
    base: usize,
    out: &mut Vec<Segment<'a>>,
    ends: &mut Vec<usize>,
) {
    let Some((ac, ids)) = ac else {
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
