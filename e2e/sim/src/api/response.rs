//! OpenAI response bodies as vLLM writes them: one JSON object, or SSE chunks.
//!
//! Streaming sends one `data:` event per generated token as the engine produces it (the last
//! token's chunk carries `finish_reason`), then — with `stream_options.include_usage` — a chunk
//! with empty `choices` and the usage, then `data: [DONE]`. Chat streams open with a chunk whose
//! delta holds only the role, as vLLM's do. Bodies are serialized from borrowed structs, so a
//! chunk costs one small allocation for its text.

use serde::Serialize;
use serde_json::Value;

use kvmesh_core::openai::Endpoint;

use crate::output::OutputVocab;
use crate::sched::{FinishReason, Finished};

/// Fields every body of one response shares.
#[derive(Debug, Clone)]
pub struct Meta {
    /// `cmpl-…` / `chatcmpl-…`.
    pub id: String,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Which API.
    pub endpoint: Endpoint,
}

impl Meta {
    fn object(&self, chunk: bool) -> &'static str {
        match (self.endpoint, chunk) {
            (Endpoint::Completions, _) => "text_completion",
            (Endpoint::ChatCompletions, false) => "chat.completion",
            (Endpoint::ChatCompletions, true) => "chat.completion.chunk",
        }
    }
}

/// `usage`.
#[derive(Debug, Clone, Serialize)]
pub struct Usage {
    prompt_tokens: u32,
    total_tokens: u32,
    completion_tokens: u32,
    prompt_tokens_details: PromptDetails,
}

#[derive(Debug, Clone, Serialize)]
struct PromptDetails {
    cached_tokens: u32,
    /// vLLM 0.32 reports the prompt tokens this request wrote to the prefix cache on chat
    /// completions, and `null` on completions (its completions server does not pass it on).
    created_cache_tokens: Option<u32>,
}

impl Usage {
    /// The usage of a finished request on `endpoint`.
    pub fn new(f: &Finished, endpoint: Endpoint) -> Self {
        let created = (endpoint == Endpoint::ChatCompletions).then_some(f.created_cache_tokens);
        Self {
            prompt_tokens: f.prompt_tokens,
            total_tokens: f.prompt_tokens + f.completion_tokens,
            completion_tokens: f.completion_tokens,
            prompt_tokens_details: PromptDetails {
                cached_tokens: f.cached_tokens,
                created_cache_tokens: created,
            },
        }
    }
}

#[derive(Serialize)]
struct Body<'a, C> {
    id: &'a str,
    object: &'static str,
    created: u64,
    model: &'a str,
    choices: C,
    #[serde(skip_serializing_if = "Option::is_none")]
    usage: Option<Usage>,
    #[serde(skip_serializing_if = "Option::is_none")]
    kv_transfer_params: Option<&'a Value>,
}

#[derive(Serialize)]
struct TextChoice<'a> {
    index: u32,
    text: &'a str,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
    #[serde(skip_serializing_if = "Option::is_none")]
    prompt_token_ids: Option<&'a [u32]>,
}

#[derive(Serialize)]
struct ChatChoice<'a> {
    index: u32,
    message: ChatMessage<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    stop_reason: Option<()>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(Serialize)]
struct ChatMessage<'a> {
    role: &'static str,
    content: &'a str,
    reasoning_content: Option<()>,
    tool_calls: [(); 0],
}

#[derive(Serialize)]
struct ChatDeltaChoice<'a> {
    index: u32,
    delta: Delta<'a>,
    logprobs: Option<()>,
    finish_reason: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    token_ids: Option<&'a [u32]>,
}

#[derive(Serialize)]
struct Delta<'a> {
    #[serde(skip_serializing_if = "Option::is_none")]
    role: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    content: Option<&'a str>,
}

fn body<'a, C>(
    meta: &'a Meta,
    chunk: bool,
    choices: C,
    usage: Option<Usage>,
    kv_transfer_params: Option<&'a Value>,
) -> Body<'a, C> {
    Body {
        id: &meta.id,
        object: meta.object(chunk),
        created: meta.created,
        model: &meta.model,
        choices,
        usage,
        kv_transfer_params,
    }
}

/// Everything a non-streaming body needs.
pub struct Full<'a> {
    /// Generated ids.
    pub tokens: &'a [u32],
    /// Summary.
    pub done: &'a Finished,
    /// Producer `kv_transfer_params`, if any.
    pub kv_transfer_params: Option<&'a Value>,
    /// Echo ids (`return_token_ids`).
    pub return_token_ids: bool,
    /// Prompt ids to echo.
    pub prompt_token_ids: Option<&'a [u32]>,
}

/// The single JSON body of a non-streaming response.
pub fn full_body(
    meta: &Meta,
    vocab: &OutputVocab,
    f: Full<'_>,
) -> Result<Vec<u8>, serde_json::Error> {
    let mut text = String::with_capacity(f.tokens.len() * 8);
    vocab.append_text(f.tokens, &mut text);
    let finish = Some(f.done.reason.as_str());
    let ids = f.return_token_ids.then_some(f.tokens);
    let usage = Some(Usage::new(f.done, meta.endpoint));
    match meta.endpoint {
        Endpoint::Completions => serde_json::to_vec(&body(
            meta,
            false,
            [TextChoice {
                index: 0,
                text: &text,
                logprobs: None,
                finish_reason: finish,
                stop_reason: None,
                token_ids: ids,
                prompt_token_ids: f.prompt_token_ids,
            }],
            usage,
            f.kv_transfer_params,
        )),
        Endpoint::ChatCompletions => serde_json::to_vec(&body(
            meta,
            false,
            [ChatChoice {
                index: 0,
                message: ChatMessage {
                    role: "assistant",
                    content: &text,
                    reasoning_content: None,
                    tool_calls: [],
                },
                logprobs: None,
                finish_reason: finish,
                stop_reason: None,
                token_ids: ids,
            }],
            usage,
            f.kv_transfer_params,
        )),
    }
}

/// Appends one SSE event (`data: <json>\n\n`).
fn push_event<T: Serialize>(out: &mut Vec<u8>, body: &T) -> Result<(), serde_json::Error> {
    out.extend_from_slice(b"data: ");
    serde_json::to_writer(&mut *out, body)?;
    out.extend_from_slice(b"\n\n");
    Ok(())
}

/// The role-only chunk that opens a chat stream.
pub fn chat_role_chunk(meta: &Meta, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    push_event(
        out,
        &Body {
            id: &meta.id,
            object: meta.object(true),
            created: meta.created,
            model: &meta.model,
            choices: [ChatDeltaChoice {
                index: 0,
                delta: Delta { role: Some("assistant"), content: Some("") },
                logprobs: None,
                finish_reason: None,
                token_ids: None,
            }],
            usage: None,
            kv_transfer_params: None,
        },
    )
}

/// The chunk of one generated token (`finish` set on the last one).
pub fn token_chunk(
    meta: &Meta,
    vocab: &OutputVocab,
    token: u32,
    finish: Option<FinishReason>,
    with_id: bool,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    let text = vocab.text(token);
    let finish_reason = finish.map(FinishReason::as_str);
    let ids = [token];
    let token_ids = with_id.then_some(&ids[..]);
    match meta.endpoint {
        Endpoint::Completions => push_event(
            out,
            &body(
                meta,
                true,
                [TextChoice {
                    index: 0,
                    text,
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                    token_ids,
                    prompt_token_ids: None,
                }],
                None,
                None,
            ),
        ),
        Endpoint::ChatCompletions => push_event(
            out,
            &body(
                meta,
                true,
                [ChatDeltaChoice {
                    index: 0,
                    delta: Delta { role: None, content: Some(text) },
                    logprobs: None,
                    finish_reason,
                    token_ids,
                }],
                None,
                None,
            ),
        ),
    }
}

/// A chunk that only ends the choice (no text), for an end without a final token.
pub fn finish_chunk(
    meta: &Meta,
    finish: FinishReason,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    let finish_reason = Some(finish.as_str());
    match meta.endpoint {
        Endpoint::Completions => push_event(
            out,
            &body(
                meta,
                true,
                [TextChoice {
                    index: 0,
                    text: "",
                    logprobs: None,
                    finish_reason,
                    stop_reason: None,
                    token_ids: None,
                    prompt_token_ids: None,
                }],
                None,
                None,
            ),
        ),
        Endpoint::ChatCompletions => push_event(
            out,
            &body(
                meta,
                true,
                [ChatDeltaChoice {
                    index: 0,
                    delta: Delta { role: None, content: Some("") },
                    logprobs: None,
                    finish_reason,
                    token_ids: None,
                }],
                None,
                None,
            ),
        ),
    }
}

/// The usage chunk (`choices: []`) sent with `stream_options.include_usage`.
pub fn usage_chunk(
    meta: &Meta,
    done: &Finished,
    out: &mut Vec<u8>,
) -> Result<(), serde_json::Error> {
    push_event(
        out,
        &Body {
            id: &meta.id,
            object: meta.object(true),
            created: meta.created,
            model: &meta.model,
            choices: [(); 0],
            usage: Some(Usage::new(done, meta.endpoint)),
            kv_transfer_params: None,
        },
    )
}

/// An error inside an already-started stream (vLLM sends it as a data event).
pub fn error_event(code: u16, message: &str, out: &mut Vec<u8>) -> Result<(), serde_json::Error> {
    push_event(out, &kvmesh_core::api::ErrorBody::new(code, "InternalServerError", message))
}

/// The stream's end.
pub const DONE: &[u8] = b"data: [DONE]\n\n";

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sched::PhaseTimes;

    fn meta(endpoint: Endpoint) -> Meta {
        Meta { id: "cmpl-1".into(), created: 7, model: "m".into(), endpoint }
    }

    fn vocab() -> OutputVocab {
        OutputVocab::from_words((0..16).map(|i| (100 + i, format!(" w{i}"))).collect()).unwrap()
    }

    fn done() -> Finished {
        Finished {
            reason: FinishReason::Length,
            prompt_tokens: 10,
            completion_tokens: 2,
            cached_tokens: 8,
            created_cache_tokens: 0,
            prefill_computed_tokens: 2,
            transfer: None,
            phases: PhaseTimes::default(),
        }
    }

    #[test]
    fn completion_body() {
        let v: Value = serde_json::from_slice(
            &full_body(
                &meta(Endpoint::Completions),
                &vocab(),
                Full {
                    tokens: &[100, 101],
                    done: &done(),
                    kv_transfer_params: None,
                    return_token_ids: true,
                    prompt_token_ids: Some(&[1, 2]),
                },
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(v["object"], "text_completion");
        assert_eq!(v["choices"][0]["text"], " w0 w1");
        assert_eq!(v["choices"][0]["finish_reason"], "length");
        assert_eq!(v["choices"][0]["token_ids"], serde_json::json!([100, 101]));
        assert_eq!(v["choices"][0]["prompt_token_ids"], serde_json::json!([1, 2]));
        assert_eq!(
            v["usage"],
            serde_json::json!({"prompt_tokens": 10, "total_tokens": 12, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 8, "created_cache_tokens": null}})
        );
        assert!(v.get("kv_transfer_params").is_none());
    }

    #[test]
    fn chat_body_with_transfer_params() {
        let params = serde_json::json!({"do_remote_prefill": true});
        let v: Value = serde_json::from_slice(
            &full_body(
                &meta(Endpoint::ChatCompletions),
                &vocab(),
                Full {
                    tokens: &[102],
                    done: &done(),
                    kv_transfer_params: Some(&params),
                    return_token_ids: false,
                    prompt_token_ids: None,
                },
            )
            .unwrap(),
        )
        .unwrap();
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(v["choices"][0]["message"]["content"], " w2");
        assert_eq!(v["kv_transfer_params"], params);
        assert_eq!(
            v["usage"]["prompt_tokens_details"]["created_cache_tokens"], 0,
            "chat carries vLLM's created_cache_tokens"
        );
    }

    #[test]
    fn stream_chunks() {
        let m = meta(Endpoint::ChatCompletions);
        let mut out = Vec::new();
        chat_role_chunk(&m, &mut out).unwrap();
        token_chunk(&m, &vocab(), 103, None, false, &mut out).unwrap();
        token_chunk(&m, &vocab(), 104, Some(FinishReason::Length), false, &mut out).unwrap();
        usage_chunk(&m, &done(), &mut out).unwrap();
        out.extend_from_slice(DONE);
        let text = String::from_utf8(out).unwrap();
        let events: Vec<&str> = text.split("\n\n").filter(|s| !s.is_empty()).collect();
        assert_eq!(events.len(), 5);
        let parse =
            |e: &str| serde_json::from_str::<Value>(e.strip_prefix("data: ").unwrap()).unwrap();
        assert_eq!(parse(events[0])["choices"][0]["delta"]["role"], "assistant");
        assert_eq!(parse(events[1])["choices"][0]["delta"]["content"], " w3");
        assert!(parse(events[1])["choices"][0]["finish_reason"].is_null());
        assert_eq!(parse(events[2])["choices"][0]["finish_reason"], "length");
        assert_eq!(parse(events[3])["choices"], serde_json::json!([]));
        assert_eq!(parse(events[3])["usage"]["prompt_tokens_details"]["cached_tokens"], 8);
        assert_eq!(events[4], "data: [DONE]");
    }
}
