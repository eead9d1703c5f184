//! Media content parts of a chat request (images, audio, video, embeddings): which parts are
//! media, the client's `uuid` for each, and where vLLM puts their placeholders in the prompt.
//!
//! Facts (vLLM 0.32, `vllm/renderers/chat_utils.py`, `vllm/multimodal/processing/inputs.py`,
//! `vllm/v1/engine/input_processor.py`):
//! * A part whose `type` is one of [`MEDIA_TYPES`] is a media item; the others (`text`, `refusal`
//!   …) are not. A part's `uuid` field (stringified) is the client's id for the item.
//! * For chat templates that take string content, a message's parts become
//!   `"\n".join(placeholders + [text])` — one model-specific placeholder string per media item not
//!   already written in the text, in front of the text (`_get_full_multimodal_text_prompt` with
//!   `interleave_strings` off, the default); the model's processor then expands each placeholder
//!   into a number of tokens that depends on the processor (and usually on the image's size).
//! * The item's cache identifier is the client's `uuid` verbatim when the request and the engine
//!   add no per-modality processor or media-io kwargs and the engine runs no tower-connector LoRA;
//!   otherwise a hash (blake3 by default) of the model id, the media bytes (or the uuid) and those
//!   kwargs. Blocks overlapping the item are keyed `(identifier, offset)` ([`crate::hashing`]).
//!
//! So a router can know an item's key only from a `uuid`, and the tokens after it only when the
//! model's placeholder expands to a fixed count; everything else about media is the engine's.

use std::sync::Arc;

use serde_json::{Map, Value};

/// Part types vLLM parses as multimodal items (`MM_PARSER_MAP`), prompt embeddings included:
/// each changes the tokens or the block keys in ways only the engine knows.
pub const MEDIA_TYPES: [&str; 10] = [
    "image_url",
    "input_image",
    "image_pil",
    "image_embeds",
    "audio_url",
    "input_audio",
    "audio_embeds",
    "video_url",
    "video_embeds",
    "prompt_embeds",
];

/// The `uuid`s of one message's media parts, in order (`None`: the part has none).
pub(super) type Uuids = Vec<Option<Arc<str>>>;

/// One media item of a chat request, in prompt order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MediaPart {
    /// Index of its message in `messages`.
    pub message: u32,
    /// The part's `uuid` (a string, or an integer written as text, as vLLM's `str(uuid)`).
    pub uuid: Option<Arc<str>>,
}

/// The media item a content part object is, if it is one: `Some(uuid)`.
pub(super) fn part(obj: &Map<String, Value>) -> Option<Option<Arc<str>>> {
    let kind = obj.get("type").and_then(Value::as_str)?;
    if !MEDIA_TYPES.contains(&kind) {
        return None;
    }
    Some(match obj.get("uuid") {
        Some(Value::String(s)) => Some(Arc::from(s.as_str())),
        Some(Value::Number(n)) if n.is_u64() || n.is_i64() => Some(Arc::from(n.to_string())),
        _ => None,
    })
}

/// A message's content as vLLM renders it for a string-content chat template: `placeholder` once
/// for each of its `items` media items not already written in `text`, in front of the text,
/// joined by `"\n"` (module docs). `None` when the text holds more placeholders than items (vLLM
/// refuses such a request).
pub fn content_with_placeholders(text: &str, items: usize, placeholder: &str) -> Option<String> {
    if items == 0 {
        return Some(text.to_owned());
    }
    let written = if placeholder.is_empty() { 0 } else { text.matches(placeholder).count() };
    let missing = items.checked_sub(written)?;
    let mut parts: Vec<&str> = vec![placeholder; missing];
    if !text.is_empty() {
        parts.push(text);
    }
    Some(parts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::{parse, Endpoint};

    #[test]
    fn placeholders_go_in_front_like_vllm() {
        let ph = "<image>";
        assert_eq!(content_with_placeholders("hi", 0, ph).as_deref(), Some("hi"));
        assert_eq!(content_with_placeholders("hi", 2, ph).as_deref(), Some("<image>\n<image>\nhi"));
        assert_eq!(content_with_placeholders("", 1, ph).as_deref(), Some("<image>"));
        assert_eq!(content_with_placeholders("a <image> b", 1, ph).as_deref(), Some("a <image> b"));
        assert_eq!(content_with_placeholders("<image><image>", 1, ph), None);
    }

    #[test]
    fn chat_requests_list_their_media_in_prompt_order() {
        let body = r#"{"messages":[
            {"role":"system","content":"s"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{"url":"x"},"uuid":"img-1"},{"type":"input_audio","input_audio":{},"uuid":7},{"type":"refusal","refusal":"no"}]},
            {"role":"assistant","content":"ok"},
            {"role":"user","content":[{"type":"image_url","image_url":{"url":"y"}},"b"]}]}"#;
        let want = vec![
            MediaPart { message: 1, uuid: Some("img-1".into()) },
            MediaPart { message: 1, uuid: Some("7".into()) },
            MediaPart { message: 3, uuid: None },
        ];
        let r = parse(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        assert_eq!(r.media, want);
        let (r, _) = crate::openai::parse_raw(Endpoint::ChatCompletions, body.as_bytes()).unwrap();
        assert_eq!(r.media, want);
        let text =
            parse(Endpoint::ChatCompletions, br#"{"messages":[{"role":"user","content":"x"}]}"#);
        assert!(text.unwrap().media.is_empty());
    }
}
