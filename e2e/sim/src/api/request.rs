//! From request body to engine request: parse, tokenize, validate, decide the NIXL role.
//!
//! The prompt is read with `kvmesh_core::openai::parse_raw` — the same reading the filter and
//! the indexer use — which also hands back the body's raw top-level fields, from which the
//! engine-only fields (`kv_transfer_params`, `kv_migration_source`, `stream_options`, `seed`,
//! `n`, `return_token_ids`, `ignore_eos`) are read without scanning the body again. Text is tokenized with the shared tokenizer and chat messages
//! rendered with the chat template, exactly as the indexer does, so both see the same blocks.
//! Media parts (images …) get the simulator's placeholder tokens and key the blocks they overlap
//! ([`crate::media`]), as vLLM's processor and block hasher do.

use kvmesh_core::openai::{self, Endpoint, Prompt, RawFields, RequestInput};
use serde_json::Value;

use super::{ApiError, AppState};
use crate::hash;
use crate::lora::Adapter;
use crate::media::{self, MediaSpan};
use crate::nixl::{parse_params, TransferRequest};
use crate::output::{seed_for, splitmix64};
use crate::sched::{FinishReason, KvRole, NewRequest, RemoteSource};

/// Text prompts longer than this are tokenized on the blocking pool, not the async workers.
const INLINE_TOKENIZE_BYTES: usize = 16 * 1024;

struct Extras {
    kv_transfer_params: Option<Value>,
    kv_migration_source: bool,
    include_usage: bool,
    seed: Option<i64>,
    n: Option<u64>,
    return_token_ids: bool,
}

fn typed<T: serde::de::DeserializeOwned>(
    field: &str,
    v: Option<Value>,
) -> Result<Option<T>, ApiError> {
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v)
            .map(Some)
            .map_err(|e| ApiError::bad_request(format!("field `{field}`: {e}"))),
    }
}

impl Extras {
    /// Reads the engine-side fields from the body's raw top-level fields (each small), so the
    /// body is scanned once; every type error names its field.
    fn read(raw: &RawFields) -> Result<Self, ApiError> {
        let field = |k: &str| raw.get(k).and_then(|r| serde_json::from_str::<Value>(r.get()).ok());
        let include_usage = match field("stream_options") {
            None | Some(Value::Null) => false,
            Some(Value::Object(o)) => {
                typed::<bool>("stream_options.include_usage", o.get("include_usage").cloned())?
                    .unwrap_or(false)
            }
            Some(_) => {
                return Err(ApiError::bad_request("field `stream_options` must be an object"))
            }
        };
        // Accepted for compatibility (replies always run to `max_tokens` when it is given), but
        // type-checked.
        typed::<bool>("ignore_eos", field("ignore_eos"))?;
        Ok(Self {
            kv_transfer_params: field("kv_transfer_params"),
            kv_migration_source: typed::<bool>(
                "kv_migration_source",
                field("kv_migration_source"),
            )?
            .unwrap_or(false),
            include_usage,
            seed: typed("seed", field("seed"))?,
            n: typed("n", field("n"))?,
            return_token_ids: typed::<bool>("return_token_ids", field("return_token_ids"))?
                .unwrap_or(false),
        })
    }
}

/// The NIXL part of a prepared request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transfer {
    /// None.
    None,
    /// Prefill leg (`do_remote_decode`).
    Prefill,
    /// Migration source (`kv_migration_source`), one step.
    MigrationSource,
    /// Pull from a producer first.
    Consume(RemoteSource),
}

/// A validated request, ready for the engine.
#[derive(Debug)]
pub struct Prepared {
    /// SSE or one JSON body.
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// vLLM's `return_token_ids`.
    pub return_token_ids: bool,
    /// Prompt token ids.
    pub prompt: Vec<u32>,
    /// Engine hashes of the prompt's full blocks (computed once, here, off the engine loop).
    pub hashes: Vec<u64>,
    /// The prompt's media items.
    pub media: Vec<MediaSpan>,
    /// `cache_salt`.
    pub salt: Option<String>,
    /// The LoRA adapter the request's `model` names (`None`: the base model).
    pub lora: Option<Adapter>,
    /// Tokens to generate.
    pub max_tokens: u32,
    /// Reported when `max_tokens` is reached.
    pub finish_reason: FinishReason,
    /// Reply seed.
    pub seed: u64,
    /// NIXL role.
    pub transfer: Transfer,
}

impl Prepared {
    /// The engine request (`transfer_id` names a producer's hold).
    pub fn into_new_request(self, id: u64, transfer_id: String) -> (NewRequest, RequestShape) {
        let shape = RequestShape {
            stream: self.stream,
            include_usage: self.include_usage,
            prompt_token_ids: self.return_token_ids.then(|| self.prompt.clone()),
            return_token_ids: self.return_token_ids,
            transfer: matches!(self.transfer, Transfer::Prefill | Transfer::MigrationSource),
        };
        let kv = match self.transfer {
            Transfer::None => KvRole::Plain,
            Transfer::Prefill | Transfer::MigrationSource => KvRole::Producer { transfer_id },
            Transfer::Consume(source) => KvRole::Consumer { source },
        };
        let req = NewRequest {
            id,
            prompt: self.prompt,
            hashes: self.hashes,
            salt: self.salt,
            media: self.media,
            lora: self.lora,
            max_tokens: self.max_tokens,
            finish_reason: self.finish_reason,
            seed: self.seed,
            kv,
        };
        (req, shape)
    }
}

/// What the response builder needs to know about the request.
#[derive(Debug, Clone)]
pub struct RequestShape {
    /// SSE?
    pub stream: bool,
    /// Final usage chunk?
    pub include_usage: bool,
    /// Prompt ids to echo (`return_token_ids`).
    pub prompt_token_ids: Option<Vec<u32>>,
    /// Echo generated ids?
    pub return_token_ids: bool,
    /// A producer: the response carries `kv_transfer_params`.
    pub transfer: bool,
}

/// Parses and tokenizes `body`; every problem is a 400 (404 for a model that is neither a served
/// name nor a loaded adapter, in vLLM's shape).
pub async fn prepare(st: &AppState, endpoint: Endpoint, body: &[u8]) -> Result<Prepared, ApiError> {
    let (req, raw) = openai::parse_raw(endpoint, body).map_err(|e| match e {
        openai::ParseError::BatchPrompt => ApiError::bad_request(
            "batched prompts are not supported by vllm-sim: send one prompt per request",
        ),
        e => ApiError::bad_request(e.to_string()),
    })?;
    let extras = Extras::read(&raw)?;
    let lora = st
        .models
        .read()
        .resolve(req.model.as_deref())
        .map_err(|e| ApiError::unknown_model(e.to_string()))?;
    if extras.n.is_some_and(|n| n != 1) {
        return Err(ApiError::bad_request("n > 1 is not supported by vllm-sim"));
    }
    if req.max_tokens == Some(0) {
        return Err(max_tokens_zero());
    }
    let from_text = !matches!(req.input, RequestInput::Prompt(Prompt::Tokens(_)));
    let identifiers = (!req.media.is_empty()).then(|| {
        media::identifiers(&req.media, raw.get("messages").map(serde_json::value::RawValue::get))
    });
    let (prompt, spans) = tokenize(st, req.input, &req.media, identifiers.as_deref()).await?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("The prompt cannot be empty"));
    }
    let mut transfer = match parse_params(extras.kv_transfer_params.as_ref())
        .map_err(|e| ApiError::bad_request(e.to_string()))?
    {
        TransferRequest::None => Transfer::None,
        TransferRequest::Produce => Transfer::Prefill,
        TransferRequest::Consume(source) => Transfer::Consume(source),
    };
    if extras.kv_migration_source {
        if transfer != Transfer::None {
            return Err(ApiError::bad_request(
                "kv_migration_source cannot be combined with kv_transfer_params",
            ));
        }
        transfer = Transfer::MigrationSource;
    }
    if req.stream && matches!(transfer, Transfer::Prefill | Transfer::MigrationSource) {
        return Err(ApiError::bad_request(
            "a KV producer request (do_remote_decode / kv_migration_source) cannot stream",
        ));
    }
    let explicit_seed = extras.seed.map(|s| s as u64);
    let block_size = st.info.block_size;
    let lora_name = lora.as_ref().map(|a| &*a.name);
    let salt = req.cache_salt.as_deref();
    let hashes = hash::chain_for_keyed(&prompt, block_size, lora_name, salt, &spans);
    let seed = seed_for(&prompt, &hashes, block_size, explicit_seed);
    let (max_tokens, finish_reason) = match (req.max_tokens, &transfer) {
        // A migration source is a producer for exactly one step.
        (_, Transfer::MigrationSource) => (1, FinishReason::Length),
        (Some(n), _) => (u32::try_from(n).unwrap_or(u32::MAX), FinishReason::Length),
        (None, _) => {
            let mut s = seed ^ 0x6c65_6e67_7468; // "length"
            let n = splitmix64(&mut s) % u64::from(st.default_max_tokens.max(1)) + 1;
            (n as u32, FinishReason::Stop)
        }
    };
    let (max_tokens, finish_reason) =
        fit_context(st.info.max_model_len, prompt.len(), from_text, max_tokens, finish_reason)?;
    Ok(Prepared {
        hashes,
        media: spans,
        stream: req.stream,
        include_usage: extras.include_usage,
        return_token_ids: extras.return_token_ids,
        prompt,
        salt: req.cache_salt,
        lora,
        max_tokens,
        finish_reason,
        seed,
        transfer,
    })
}

/// vLLM 0.32's length rules (`renderers/params.py` `_token_len_check`, `get_max_tokens`): a prompt
/// longer than `max_model_len` is a 400 — a text prompt is tokenized only up to `max_model_len + 1`
/// tokens, so it reports "at least" that many; otherwise `max_tokens` is clamped to the room left
/// (the reply then ends `length`), and no room at all is a 400 for `max_tokens` 0.
pub fn fit_context(
    max_model_len: usize,
    prompt: usize,
    from_text: bool,
    max_tokens: u32,
    finish: FinishReason,
) -> Result<(u32, FinishReason), ApiError> {
    if prompt > max_model_len {
        let n = if from_text { prompt.min(max_model_len + 1) } else { prompt };
        let at_least = if n == max_model_len + 1 { "at least " } else { "" };
        return Err(ApiError::bad_request(format!(
            "This model's maximum context length is {max_model_len} tokens. However, your prompt contains {at_least}{n} input tokens, which exceeds this limit even without any output tokens. Please reduce the length of the input prompt. (parameter=input_tokens, value={n})"
        ))
        .with_reason("too_long")
        .with_param("input_tokens"));
    }
    let room = u32::try_from(max_model_len - prompt).unwrap_or(u32::MAX);
    match room {
        0 => Err(max_tokens_zero()),
        r if r < max_tokens => Ok((r, FinishReason::Length)),
        _ => Ok((max_tokens, finish)),
    }
}

fn max_tokens_zero() -> ApiError {
    ApiError::bad_request("max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)")
        .with_param("max_tokens")
}

/// The prompt's token ids and its media items: a chat's media parts (`media`, with their
/// `identifiers`) become the model's placeholder tokens ([`crate::media`]).
async fn tokenize(
    st: &AppState,
    input: RequestInput,
    parts: &[openai::media::MediaPart],
    identifiers: Option<&[std::sync::Arc<str>]>,
) -> Result<(Vec<u32>, Vec<MediaSpan>), ApiError> {
    let text = match input {
        RequestInput::Prompt(Prompt::Tokens(ids)) => {
            if let Some(bad) = ids.iter().find(|&&t| t >= st.vocab_size) {
                return Err(ApiError::bad_request(format!("Token id {bad} is out of vocabulary")));
            }
            return Ok((ids, Vec::new()));
        }
        RequestInput::Prompt(Prompt::Text(t)) => t,
        RequestInput::Messages(m) => {
            let m = if parts.is_empty() {
                m
            } else {
                media::with_placeholders(&m, parts)
                    .map_err(|e| ApiError::bad_request(e.to_string()))?
            };
            st.template.render(&m, true).map_err(|e| {
                ApiError::bad_request(format!("cannot apply the chat template: {e}"))
            })?
        }
    };
    let encoded = if text.len() <= INLINE_TOKENIZE_BYTES {
        st.tokenizer.encode(&text)
    } else {
        let tok = st.tokenizer.clone();
        tokio::task::spawn_blocking(move || tok.encode(&text)).await.map_err(|e| {
            ApiError::new(
                axum::http::StatusCode::INTERNAL_SERVER_ERROR,
                "other",
                format!("tokenizer task: {e}"),
            )
        })?
    };
    let ids =
        encoded.map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))?;
    let Some(identifiers) = identifiers else { return Ok((ids, Vec::new())) };
    let placeholder = st.tokenizer.token_to_id(media::PLACEHOLDER).ok_or_else(|| {
        ApiError::bad_request("this model's tokenizer has no media placeholder token")
    })?;
    media::expand(&ids, placeholder, identifiers).map_err(|e| ApiError::bad_request(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn context_rules_follow_vllm() {
        use FinishReason::{Length, Stop};
        // (max_model_len, prompt, from text, max_tokens, finish) → Ok((max_tokens, finish)), then the errors.
        type Case = (usize, usize, bool, u32, FinishReason, (u32, FinishReason));
        let ok: &[Case] = &[
            (64, 10, true, 8, Stop, (8, Stop)),
            (64, 60, true, 8, Stop, (4, Length)), // clamped to the room left, ends length
            (64, 63, false, 100, Length, (1, Length)),
            (64, 56, false, 8, Length, (8, Length)),
        ];
        for &(max, prompt, text, mt, finish, want) in ok {
            assert_eq!(
                fit_context(max, prompt, text, mt, finish).map_err(|e| e.message),
                Ok(want),
                "{max} {prompt} {mt}"
            );
        }
        let err: &[(usize, usize, bool, &str, &str)] = &[
            (
                64,
                64,
                true,
                "max_tokens",
                "max_tokens must be at least 1, got 0. (parameter=max_tokens, value=0)",
            ),
            (64, 80, true, "input_tokens", "your prompt contains at least 65 input tokens"),
            (
                64,
                80,
                false,
                "input_tokens",
                "your prompt contains 80 input tokens, which exceeds this limit",
            ),
            (64, 65, false, "input_tokens", "contains at least 65 input tokens"),
        ];
        for &(max, prompt, text, param, needle) in err {
            let e = fit_context(max, prompt, text, 1, Length)
                .err()
                .unwrap_or_else(|| panic!("{max} {prompt} must fail"));
            assert_eq!((e.status.as_u16(), e.param), (400, Some(param)));
            assert!(e.message.contains(needle), "{:?} lacks {needle:?}", e.message);
            assert!(e.message.contains("maximum context length is 64") || param == "max_tokens");
        }
    }
}
