//! Lenient reading of OpenAI `/v1/completions` and `/v1/chat/completions` request bodies.
//!
//! Only the fields routing needs are read; unknown fields are ignored. The filter (for session keys)
//! and the indexer (for tokenization) both read requests through [`parse`], so they can never
//! disagree about what the prompt is. Chat content given as parts is joined the way vLLM joins text
//! parts for string-format chat templates: text parts separated by `"\n"`, other parts skipped.

use serde_json::Value;

/// Which OpenAI endpoint a request targets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

impl Endpoint {
    /// The endpoint a request path (query string allowed) names, if routable.
    pub fn from_path(path: &str) -> Option<Self> {
        let path = path.split('?').next().unwrap_or(path);
        match path.trim_end_matches('/') {
            "/v1/completions" => Some(Self::Completions),
            "/v1/chat/completions" => Some(Self::ChatCompletions),
            _ => None,
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Self::Completions => "/v1/completions",
            Self::ChatCompletions => "/v1/chat/completions",
        }
    }
}

/// A completion prompt: text, or token ids (vLLM accepts both).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

/// One chat message with its content flattened to text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// What routing needs from a request body.
#[derive(Debug, Clone, PartialEq)]
pub enum RequestInput {
    Prompt(Prompt),
    Messages(Vec<ChatMessage>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct OpenAiRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub input: RequestInput,
    pub stream: bool,
    pub max_tokens: Option<u64>,
    /// vLLM's per-request prefix-cache salt; changes the block hash seed.
    pub cache_salt: Option<String>,
}

/// Why a body cannot be read as a routable request. The request still goes to an engine, which
/// answers it with its own error; these only explain why kvmesh did not route by content.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    NotJson,
    NotAnObject,
    Missing { field: &'static str },
    WrongType { field: &'static str, expected: &'static str },
    /// A batch of several prompts: the engine serves it, kvmesh does not route it by content.
    BatchPrompt,
}

impl ParseError {
    /// A short, stable label for metrics and log lines.
    pub fn reason(&self) -> &'static str {
        match self {
            Self::NotJson => "not_json",
            Self::NotAnObject => "not_an_object",
            Self::Missing { .. } => "missing_field",
            Self::WrongType { .. } => "wrong_type",
            Self::BatchPrompt => "batch_prompt",
        }
    }
}

impl std::fmt::Display for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NotJson => write!(f, "body is not valid JSON"),
            Self::NotAnObject => write!(f, "body is not a JSON object"),
            Self::Missing { field } => write!(f, "missing field `{field}`"),
            Self::WrongType { field, expected } => write!(f, "field `{field}` must be {expected}"),
            Self::BatchPrompt => write!(f, "`prompt` holds several prompts (a batch)"),
        }
    }
}

impl std::error::Error for ParseError {}

/// Reads `body` as a request to `endpoint`.
pub fn parse(endpoint: Endpoint, body: &[u8]) -> Result<OpenAiRequest, ParseError> {
    let value: Value = serde_json::from_slice(body).map_err(|_| ParseError::NotJson)?;
    let obj = value.as_object().ok_or(ParseError::NotAnObject)?;
    let input = match endpoint {
        Endpoint::Completions => RequestInput::Prompt(prompt(obj.get("prompt"))?),
        Endpoint::ChatCompletions => RequestInput::Messages(messages(obj.get("messages"))?),
    };
    let model = match obj.get("model") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(ParseError::WrongType { field: "model", expected: "a string" }),
    };
    let stream = match obj.get("stream") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(ParseError::WrongType { field: "stream", expected: "a boolean" }),
    };
    let max_tokens = match obj.get("max_tokens").or_else(|| obj.get("max_completion_tokens")) {
        None | Some(Value::Null) => None,
        Some(v) => Some(v.as_u64().ok_or(ParseError::WrongType { field: "max_tokens", expected: "a non-negative integer" })?),
    };
    let cache_salt = obj.get("cache_salt").and_then(Value::as_str).map(str::to_owned);
    Ok(OpenAiRequest { endpoint, model, input, stream, max_tokens, cache_salt })
}

fn prompt(value: Option<&Value>) -> Result<Prompt, ParseError> {
    const FIELD: &str = "prompt";
    match value {
        None | Some(Value::Null) => Err(ParseError::Missing { field: FIELD }),
        Some(Value::String(s)) => Ok(Prompt::Text(s.clone())),
        Some(Value::Array(items)) => match items.as_slice() {
            [] => Err(ParseError::WrongType { field: FIELD, expected: "a non-empty string or list" }),
            [Value::String(s)] => Ok(Prompt::Text(s.clone())),
            [Value::Array(inner)] => token_ids(inner).map(Prompt::Tokens),
            [Value::Number(_), ..] => token_ids(items).map(Prompt::Tokens),
            [Value::String(_) | Value::Array(_), ..] => Err(ParseError::BatchPrompt),
            _ => Err(ParseError::WrongType { field: FIELD, expected: "a string, a list of token ids, or a one-element list of either" }),
        },
        Some(_) => Err(ParseError::WrongType { field: FIELD, expected: "a string or a list" }),
    }
}

fn token_ids(items: &[Value]) -> Result<Vec<u32>, ParseError> {
    items
        .iter()
        .map(|v| {
            v.as_u64()
                .and_then(|n| u32::try_from(n).ok())
                .ok_or(ParseError::WrongType { field: "prompt", expected: "token ids in 0..2^32" })
        })
        .collect()
}

fn messages(value: Option<&Value>) -> Result<Vec<ChatMessage>, ParseError> {
    const FIELD: &str = "messages";
    let items = match value {
        None | Some(Value::Null) => return Err(ParseError::Missing { field: FIELD }),
        Some(Value::Array(items)) if !items.is_empty() => items,
        Some(_) => return Err(ParseError::WrongType { field: FIELD, expected: "a non-empty list of messages" }),
    };
    items
        .iter()
        .map(|m| {
            let obj = m.as_object().ok_or(ParseError::WrongType { field: FIELD, expected: "a list of objects" })?;
            let role = obj
                .get("role")
                .and_then(Value::as_str)
                .ok_or(ParseError::WrongType { field: "messages[].role", expected: "a string" })?
                .to_owned();
            let content = match obj.get("content") {
                None | Some(Value::Null) => String::new(),
                Some(Value::String(s)) => s.clone(),
                Some(Value::Array(parts)) => content_parts(parts)?,
                Some(_) => {
                    return Err(ParseError::WrongType { field: "messages[].content", expected: "a string or a list of parts" })
                }
            };
            Ok(ChatMessage { role, content })
        })
        .collect()
}

fn content_parts(parts: &[Value]) -> Result<String, ParseError> {
    let mut texts = Vec::with_capacity(parts.len());
    for part in parts {
        match part {
            Value::String(s) => texts.push(s.as_str()),
            Value::Object(obj) => {
                if obj.get("type").and_then(Value::as_str).unwrap_or("text") == "text" {
                    let text = obj
                        .get("text")
                        .and_then(Value::as_str)
                        .ok_or(ParseError::WrongType { field: "messages[].content[].text", expected: "a string" })?;
                    texts.push(text);
                }
            }
            _ => return Err(ParseError::WrongType { field: "messages[].content", expected: "a list of parts" }),
        }
    }
    Ok(texts.join("\n"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn completions(body: &str) -> Result<OpenAiRequest, ParseError> {
        parse(Endpoint::Completions, body.as_bytes())
    }
    fn chat(body: &str) -> Result<OpenAiRequest, ParseError> {
        parse(Endpoint::ChatCompletions, body.as_bytes())
    }

    #[test]
    fn paths() {
        assert_eq!(Endpoint::from_path("/v1/completions"), Some(Endpoint::Completions));
        assert_eq!(Endpoint::from_path("/v1/chat/completions?x=1"), Some(Endpoint::ChatCompletions));
        assert_eq!(Endpoint::from_path("/v1/models"), None);
    }

    #[test]
    fn prompt_shapes() {
        let cases: &[(&str, Result<Prompt, ParseError>)] = &[
            (r#"{"prompt":"hi"}"#, Ok(Prompt::Text("hi".into()))),
            (r#"{"prompt":["hi"]}"#, Ok(Prompt::Text("hi".into()))),
            (r#"{"prompt":[1,2,3]}"#, Ok(Prompt::Tokens(vec![1, 2, 3]))),
            (r#"{"prompt":[[4,5]]}"#, Ok(Prompt::Tokens(vec![4, 5]))),
            (r#"{"prompt":["a","b"]}"#, Err(ParseError::BatchPrompt)),
            (r#"{"prompt":[[1],[2]]}"#, Err(ParseError::BatchPrompt)),
            (r#"{"prompt":[1,-2]}"#, Err(ParseError::WrongType { field: "prompt", expected: "token ids in 0..2^32" })),
            (r#"{"prompt":[]}"#, Err(ParseError::WrongType { field: "prompt", expected: "a non-empty string or list" })),
            (r#"{"prompt":7}"#, Err(ParseError::WrongType { field: "prompt", expected: "a string or a list" })),
            (r#"{"model":"m"}"#, Err(ParseError::Missing { field: "prompt" })),
        ];
        for (body, want) in cases {
            let got = completions(body).map(|r| match r.input {
                RequestInput::Prompt(p) => p,
                RequestInput::Messages(_) => unreachable!(),
            });
            assert_eq!(&got, want, "{body}");
        }
    }

    #[test]
    fn not_json_and_not_object() {
        assert_eq!(completions("{not json"), Err(ParseError::NotJson));
        assert_eq!(completions(r#"{"prompt":"tru"#), Err(ParseError::NotJson));
        assert_eq!(completions("[1]"), Err(ParseError::NotAnObject));
    }

    #[test]
    fn chat_content_parts_are_joined_like_vllm() {
        let r = chat(r#"{"model":"m","stream":true,"max_tokens":5,"extra":{"x":1},"messages":[
            {"role":"system","content":"be brief"},
            {"role":"user","content":[{"type":"text","text":"a"},{"type":"image_url","image_url":{}},{"type":"text","text":"b"}]},
            {"role":"assistant","content":null}]}"#)
        .unwrap();
        assert!(r.stream);
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.model.as_deref(), Some("m"));
        let RequestInput::Messages(m) = r.input else { panic!("messages") };
        assert_eq!(m[1].content, "a\nb");
        assert_eq!(m[2].content, "");
    }

    #[test]
    fn chat_errors() {
        assert_eq!(chat(r#"{"messages":[]}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{"messages":"hi"}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{"messages":[{"content":"x"}]}"#).unwrap_err().reason(), "wrong_type");
        assert_eq!(chat(r#"{}"#).unwrap_err().reason(), "missing_field");
        assert_eq!(chat(r#"{"messages":[{"role":"user","content":"x"}],"stream":"yes"}"#).unwrap_err().reason(), "wrong_type");
    }
}
