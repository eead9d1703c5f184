//! Images (and other media parts) in chat requests, as vLLM handles them — with a fixed model.
//!
//! vLLM (0.32, `renderers/chat_utils.py`, `multimodal/processing/inputs.py`,
//! `v1/core/kv_cache_utils.py`) writes one placeholder per media item in front of its message's
//! text (`"\n".join(placeholders + [text])`, `kvmesh_core::openai::media`), its processor
//! expands each placeholder into the item's tokens, and every block overlapping an item is keyed
//! by `(identifier, offset of the item relative to the block's start)` — in the block's hash and
//! in the `BlockStored` event's `extra_keys`. The identifier is the part's `uuid` when it has one
//! (the engine adds no processor kwargs here), else a hash of the media.
//!
//! The simulator's model: the placeholder is the DeepSeek tokenizer's `<｜image｜>` (one added
//! token) and expands to [`MEDIA_TOKENS`] copies of its id, whatever the media; the identifier
//! without a `uuid` is `sim-` and the XXH3-64 of the part's payload JSON (the `image_url` object,
//! data URLs included) in hex. Any media part type counts as an image.

use std::sync::Arc;

use kvmesh_core::hashing::xxh3;
use kvmesh_core::openai::media::{content_with_placeholders, MediaPart, MEDIA_TYPES};
use kvmesh_core::openai::ChatMessage;
use serde_json::Value;

/// The placeholder the simulator's model writes for a media item.
pub const PLACEHOLDER: &str = "<｜image｜>";

/// Tokens one media item expands to.
pub const MEDIA_TOKENS: usize = 32;

/// One media item in a prompt: its identifier and the token range its placeholder expanded to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaSpan {
    pub identifier: Arc<str>,
    pub offset: usize,
    pub len: usize,
}

/// One block's media keys: `(identifier, item start − block start)` per overlapping item.
pub type BlockKeys = Vec<(Arc<str>, i64)>;

/// Why a request's media cannot be served.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum MediaError {
    #[error(
        "found more '{PLACEHOLDER}' placeholders in input prompt than actual multimodal data items"
    )]
    TooManyPlaceholders,
}

/// The identifiers of `media` (the request's parts in prompt order), read with the raw
/// `messages` JSON for parts without a `uuid`.
pub fn identifiers(media: &[MediaPart], messages: Option<&str>) -> Vec<Arc<str>> {
    let payloads = messages.map(payloads).unwrap_or_default();
    media
        .iter()
        .enumerate()
        .map(|(i, m)| match &m.uuid {
            Some(u) => u.clone(),
            None => {
                let p = payloads.get(i).map_or("", String::as_str);
                Arc::from(format!("sim-{:016x}", xxh3(p.as_bytes(), 0)))
            }
        })
        .collect()
}

/// The payload JSON of every media part of `messages`, in prompt order.
fn payloads(messages: &str) -> Vec<String> {
    let Ok(Value::Array(messages)) = serde_json::from_str::<Value>(messages) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for m in &messages {
        let Some(Value::Array(parts)) = m.get("content") else { continue };
        for p in parts {
            let Some(kind) = p.get("type").and_then(Value::as_str) else { continue };
            if MEDIA_TYPES.contains(&kind) {
                out.push(p.get(kind).map(Value::to_string).unwrap_or_default());
            }
        }
    }
    out
}

/// `messages` with each message's media placeholders written in front of its text.
pub fn with_placeholders(
    messages: &[ChatMessage],
    media: &[MediaPart],
) -> Result<Vec<ChatMessage>, MediaError> {
    messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let items = media.iter().filter(|p| p.message as usize == i).count();
            let content = content_with_placeholders(&m.content, items, PLACEHOLDER)
                .ok_or(MediaError::TooManyPlaceholders)?;
            Ok(ChatMessage { role: m.role.clone(), content: content.into() })
        })
        .collect()
}

/// Expands each `placeholder` token of `ids` into [`MEDIA_TOKENS`] copies, the `i`-th for
/// `identifiers[i]`; the counts must agree.
pub fn expand(
    ids: &[u32],
    placeholder: u32,
    identifiers: &[Arc<str>],
) -> Result<(Vec<u32>, Vec<MediaSpan>), MediaError> {
    let found = ids.iter().filter(|&&t| t == placeholder).count();
    if found != identifiers.len() {
        return Err(MediaError::TooManyPlaceholders);
    }
    let mut out = Vec::with_capacity(ids.len() + found * MEDIA_TOKENS);
    let mut spans = Vec::with_capacity(found);
    for &t in ids {
        if t == placeholder {
            let identifier = identifiers[spans.len()].clone();
            spans.push(MediaSpan { identifier, offset: out.len(), len: MEDIA_TOKENS });
            out.extend(std::iter::repeat_n(placeholder, MEDIA_TOKENS));
        } else {
            out.push(t);
        }
    }
    Ok((out, spans))
}

/// The media keys of the block of tokens `start..end`: every item overlapping it, in order
/// (vLLM's `_gen_mm_extra_hash_keys`).
pub fn block_keys(spans: &[MediaSpan], start: usize, end: usize) -> BlockKeys {
    spans
        .iter()
        .filter(|s| s.offset < end && start < s.offset + s.len)
        .map(|s| (s.identifier.clone(), s.offset as i64 - start as i64))
        .collect()
}

/// The `extra_keys` of a `BlockStored` of blocks `from..to` (`block_size` tokens each): one entry
/// per block, `None` for a block without media; empty (left out on the wire) when none has any.
pub fn event_keys(
    spans: &[MediaSpan],
    from: usize,
    to: usize,
    block_size: usize,
) -> Vec<Option<BlockKeys>> {
    let keys: Vec<Option<BlockKeys>> = (from..to)
        .map(|i| Some(block_keys(spans, i * block_size, (i + 1) * block_size)))
        .map(|k| k.filter(|k| !k.is_empty()))
        .collect();
    if keys.iter().all(Option::is_none) {
        return Vec::new();
    }
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn placeholders_expand_and_key_the_blocks_they_touch() {
        let ids = [1, 2, 9, 3];
        let (out, spans) = expand(&ids, 9, &["a".into()]).unwrap();
        assert_eq!(out.len(), 3 + MEDIA_TOKENS);
        assert_eq!(spans, vec![MediaSpan { identifier: "a".into(), offset: 2, len: MEDIA_TOKENS }]);
        assert_eq!(block_keys(&spans, 0, 16), vec![("a".into(), 2)]);
        assert_eq!(block_keys(&spans, 16, 32), vec![("a".into(), -14)]);
        assert_eq!(block_keys(&spans, 32, 48), vec![("a".into(), -30)]);
        assert!(block_keys(&spans, 48, 64).is_empty());
        assert!(block_keys(&spans, 0, 2).is_empty());
        assert_eq!(expand(&ids, 9, &[]), Err(MediaError::TooManyPlaceholders));
    }

    #[test]
    fn identifiers_are_the_uuid_or_a_hash_of_the_payload() {
        let messages = r#"[{"role":"user","content":[{"type":"image_url","image_url":{"url":"a"}},{"type":"image_url","image_url":{"url":"b"},"uuid":"u"},{"type":"image_url","image_url":{"url":"c"}}]}]"#;
        let media = vec![
            MediaPart { message: 0, uuid: None },
            MediaPart { message: 0, uuid: Some("u".into()) },
            MediaPart { message: 0, uuid: None },
        ];
        let ids = identifiers(&media, Some(messages));
        assert_eq!(&*ids[1], "u");
        assert!(ids[0].starts_with("sim-") && ids[2].starts_with("sim-"));
        assert_ne!(ids[0], ids[2]);
    }

    /// On the wire as vLLM publishes them: `extra_keys` one entry per block, nil or a list of
    /// `[identifier, offset]`, in both layouts (position 7 after the tag in the legacy one).
    #[test]
    fn events_carry_the_keys_per_block() {
        use crate::events::{EventBatch, KvEvent};
        use crate::wire::{encode_batch, Layout};
        use rmpv::Value;
        let spans = [MediaSpan { identifier: "img".into(), offset: 6, len: 8 }];
        let extra_keys = event_keys(&spans, 0, 3, 4);
        assert_eq!(
            extra_keys,
            vec![None, Some(vec![("img".into(), 2)]), Some(vec![("img".into(), -2)])]
        );
        assert!(event_keys(&spans, 4, 6, 4).is_empty());
        let stored = KvEvent::BlockStored {
            block_hashes: vec![1, 2, 3],
            parent_block_hash: None,
            token_ids: (0..12).collect(),
            block_size: 4,
            lora: None,
            extra_keys,
        };
        let batch = EventBatch { ts: 1.0, events: vec![stored] };
        let pair = |o: i64| Value::Array(vec![Value::from("img"), Value::from(o)]);
        let want = Value::Array(vec![
            Value::Nil,
            Value::Array(vec![pair(2)]),
            Value::Array(vec![pair(-2)]),
        ]);
        for layout in [Layout::Current, Layout::Legacy] {
            let bytes = encode_batch(&batch, 0, layout).unwrap();
            let v = rmpv::decode::read_value(&mut &bytes[..]).unwrap();
            let event = &v[1][0];
            let got = match event {
                Value::Map(kv) => {
                    kv.iter().find(|(k, _)| k.as_str() == Some("extra_keys")).map(|(_, v)| v)
                }
                Value::Array(items) => items.get(8),
                _ => None,
            };
            assert_eq!(got, Some(&want), "{layout:?}");
        }
    }
}
