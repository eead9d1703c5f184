//! kvmesh-tokens: turning a request into the token ids the engine will see.
//!
//! The indexer predicts which KV blocks a request reuses by hashing its token ids; those ids are only
//! right if they are exactly the engine's. So the indexer and the engine simulator share this crate:
//! the model's Hugging Face `tokenizer.json` (through the `tokenizers` crate) and the model's chat
//! template (minijinja, Jinja2-compatible like vLLM's). Text is encoded without added special tokens
//! — the DeepSeek tokenizer adds none, and chat templates write BOS themselves — while special tokens
//! written in the text (`<｜User｜>` …) are recognised, as in `transformers`.

use std::path::{Path, PathBuf};

use kvmesh_core::openai::{ChatMessage, Prompt, RequestInput};

mod deepseek;
mod pieces;
pub use deepseek::{deepseek_pipeline, has_deepseek_pipeline, safe_cut};

/// Environment variable naming the tokenizer.json to load by default.
pub const TOKENIZER_ENV: &str = "KVMESH_TOKENIZER";

/// The built-in chat template for the DeepSeek family (the default model).
pub const DEEPSEEK_TEMPLATE: &str = include_str!("../templates/deepseek.jinja");
const DEEPSEEK_BOS: &str = "<｜begin▁of▁sentence｜>";

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot load tokenizer {path}: {reason}")]
    Load { path: PathBuf, reason: String },
    #[error("cannot read chat template {path}: {reason}")]
    TemplateFile { path: PathBuf, reason: String },
    #[error("chat template: {0}")]
    Template(String),
    #[error("tokenizer: {0}")]
    Encode(String),
}

/// `$KVMESH_TOKENIZER`, else `<repo>/.tools/tokenizer/tokenizer.json` (installed by `make setup`).
pub fn default_tokenizer_path() -> PathBuf {
    match std::env::var_os(TOKENIZER_ENV) {
        Some(p) if !p.is_empty() => PathBuf::from(p),
        _ => Path::new(env!("CARGO_MANIFEST_DIR")).join("../.tools/tokenizer/tokenizer.json"),
    }
}

/// A loaded Hugging Face tokenizer. Cheap to share behind an `Arc`; encoding is `&self`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Text between added tokens without the library's pre-tokenizer, when the pipeline is
    /// DeepSeek-V4's ([`pieces`]).
    ascii: Option<pieces::AsciiEncoder>,
}

impl Tokenizer {
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TokensError> {
        let path = path.as_ref();
        let load_error = |reason: String| TokensError::Load { path: path.to_owned(), reason };
        let json = std::fs::read(path).map_err(|e| load_error(e.to_string()))?;
        let inner =
            tokenizers::Tokenizer::from_bytes(&json).map_err(|e| load_error(e.to_string()))?;
        let ascii = pieces::AsciiEncoder::for_tokenizer(&json, inner.get_model());
        Ok(Self { inner, ascii })
    }

    /// Whether [`Self::encode_piece`] encodes ASCII stretches without `tokenizers`' pre-tokenizer.
    pub fn encodes_ascii_directly(&self) -> bool {
        self.ascii.is_some()
    }

    /// [`Self::encode`] of text that holds **no added token** (the caller cut the text at them, as
    /// `tokenizers` does first): the same ids, for the ASCII stretches of a DeepSeek-V4 tokenizer's
    /// text at a fraction of the cost ([`pieces`]).
    pub fn encode_piece(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        let Some(ascii) = &self.ascii else {
            return self.encode(text);
        };
        let mut ids = Vec::with_capacity(text.len() / 3);
        ascii.encode(self.inner.get_model(), text, &mut ids, |stretch, ids| {
            ids.extend(self.encode(stretch)?);
            Ok(())
        })?;
        Ok(ids)
    }

    /// Token ids of `text`, special tokens in the text recognised, none added.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, TokensError> {
        let enc =
            self.inner.encode_fast(text, false).map_err(|e| TokensError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, special tokens kept (so a reply appended to a history re-encodes to the same ids).
    pub fn decode(&self, ids: &[u32]) -> Result<String, TokensError> {
        self.inner.decode(ids, false).map_err(|e| TokensError::Encode(e.to_string()))
    }

    /// The id of a token string, if the vocabulary has it.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The ids of the special (added) tokens, which a generator should never emit mid-text.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: minijinja::Environment<'static>,
    bos_token: String,
    /// The built-in DeepSeek template: rendered by [`render_deepseek`], which writes the same text
    /// as `env` (a property test holds them equal) at the cost of copying it. Through minijinja a
    /// ~150k-token conversation of 640 messages rendered in ~5M instructions — a third of a cold
    /// route's whole cost at that length (every content string converted to a template value,
    /// then written through the template's output).
    native_deepseek: bool,
}

impl ChatTemplate {
    /// The built-in DeepSeek template.
    pub fn deepseek() -> Result<Self, TokensError> {
        let mut template = Self::from_source(DEEPSEEK_TEMPLATE.to_owned(), DEEPSEEK_BOS)?;
        template.native_deepseek = true;
        Ok(template)
    }

    /// A Jinja2 chat template from a file (HF `chat_template` syntax: `messages`, `bos_token`,
    /// `add_generation_prompt`).
    pub fn from_file(path: impl AsRef<Path>, bos_token: &str) -> Result<Self, TokensError> {
        let path = path.as_ref();
        let source = std::fs::read_to_string(path).map_err(|e| TokensError::TemplateFile {
            path: path.to_owned(),
            reason: e.to_string(),
        })?;
        Self::from_source(source, bos_token)
    }

    fn from_source(source: String, bos_token: &str) -> Result<Self, TokensError> {
        let mut env = minijinja::Environment::new();
        // Hugging Face templates are Python Jinja2: they call Python methods on strings, dicts and
        // lists (`.strip()`, `.startswith()`, `.items()` …) and `raise_exception(msg)`. Without
        // these, such a template fails on every chat request.
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template_owned("chat", source).map_err(|e| TokensError::Template(e.to_string()))?;
        Ok(Self { env, bos_token: bos_token.to_owned(), native_deepseek: false })
    }

    /// The prompt text the engine builds from `messages`.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokensError> {
        if self.native_deepseek {
            return Ok(render_deepseek(&self.bos_token, messages, add_generation_prompt));
        }
        self.render_jinja(messages, add_generation_prompt)
    }

    /// [`Self::render`] through the Jinja template, whichever it is.
    fn render_jinja(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokensError> {
        #[derive(serde::Serialize)]
        struct Msg<'a> {
            role: &'a str,
            content: &'a str,
        }
        let msgs: Vec<Msg<'_>> =
            messages.iter().map(|m| Msg { role: &m.role, content: &m.content }).collect();
        let tpl =
            self.env.get_template("chat").map_err(|e| TokensError::Template(e.to_string()))?;
        tpl.render(minijinja::context! {
            messages => msgs,
            bos_token => self.bos_token.as_str(),
            add_generation_prompt => add_generation_prompt,
        })
        .map_err(|e| TokensError::Template(e.to_string()))
    }
}

/// `templates/deepseek.jinja`, written directly: every system message first (joined by a blank
/// line), then each user, assistant and tool message wrapped in its added tokens, other roles
/// skipped, then the generation prompt.
fn render_deepseek(
    bos_token: &str,
    messages: &[ChatMessage],
    add_generation_prompt: bool,
) -> String {
    const USER: &str = "<｜User｜>";
    const ASSISTANT: &str = "<｜Assistant｜>";
    const END: &str = "<｜end▁of▁sentence｜>";
    const TOOL_BEGIN: &str = "<｜tool▁output▁begin｜>";
    const TOOL_END: &str = "<｜tool▁output▁end｜>";
    let wrapping = ASSISTANT.len() + END.len().max(TOOL_BEGIN.len() + TOOL_END.len());
    let len = bos_token.len()
        + ASSISTANT.len()
        + messages.iter().map(|m| m.content.len() + wrapping).sum::<usize>();
    let mut out = String::with_capacity(len);
    out.push_str(bos_token);
    for (i, m) in messages.iter().filter(|m| &*m.role == "system").enumerate() {
        if i > 0 {
            out.push_str("\n\n");
        }
        out.push_str(&m.content);
    }
    for m in messages {
        let (open, close) = match &*m.role {
            "user" => (USER, ""),
            "assistant" => (ASSISTANT, END),
            "tool" => (TOOL_BEGIN, TOOL_END),
            _ => continue,
        };
        out.push_str(open);
        out.push_str(&m.content);
        out.push_str(close);
    }
    if add_generation_prompt {
        out.push_str(ASSISTANT);
    }
    out
}

/// The prompt text of a request as the engine renders it (chat with the generation prompt).
/// Token-id prompts have no text: `None`.
pub fn prompt_text(
    template: &ChatTemplate,
    input: &RequestInput,
) -> Result<Option<String>, TokensError> {
    match input {
        RequestInput::Prompt(Prompt::Tokens(_)) => Ok(None),
        RequestInput::Prompt(Prompt::Text(t)) => Ok(Some(t.clone())),
        RequestInput::Messages(m) => template.render(m, true).map(Some),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(role: &str, content: &str) -> ChatMessage {
        ChatMessage { role: role.into(), content: content.into() }
    }

    #[test]
    fn deepseek_rendering() {
        let t = ChatTemplate::deepseek().unwrap();
        let msgs = [
            msg("system", "S1"),
            msg("user", "hi"),
            msg("assistant", "hello"),
            msg("system", "S2"),
            msg("user", "bye"),
        ];
        assert_eq!(
            t.render(&msgs, true).unwrap(),
            "<｜begin▁of▁sentence｜>S1\n\nS2<｜User｜>hi<｜Assistant｜>hello<｜end▁of▁sentence｜><｜User｜>bye<｜Assistant｜>"
        );
        assert_eq!(
            t.render(&[msg("user", "x")], false).unwrap(),
            "<｜begin▁of▁sentence｜><｜User｜>x"
        );
    }

    proptest::proptest! {
        /// The native rendering of the built-in template is the Jinja rendering: any roles (known,
        /// unknown, several system messages anywhere), any content (whitespace at the ends, Jinja
        /// syntax, added tokens, non-ASCII), with and without the generation prompt.
        #[test]
        fn the_builtin_template_renders_natively_as_through_jinja(
            messages in proptest::collection::vec(
                (
                    proptest::sample::select(vec!["system", "user", "assistant", "tool", "developer", "User", ""]),
                    "(\\PC|[ \\n\\t{}%#-]|<｜User｜>|<｜end▁of▁sentence｜>){0,12}",
                ),
                0..12,
            ),
            add_generation_prompt: bool,
        ) {
            let t = ChatTemplate::deepseek().unwrap();
            let messages: Vec<ChatMessage> = messages.into_iter().map(|(role, content)| msg(role, &content)).collect();
            proptest::prop_assert_eq!(
                t.render(&messages, add_generation_prompt).unwrap(),
                t.render_jinja(&messages, add_generation_prompt).unwrap()
            );
        }
    }

    #[test]
    fn conversations_render_append_only() {
        let t = ChatTemplate::deepseek().unwrap();
        let mut history = vec![msg("system", "be brief"), msg("user", "q0")];
        let mut previous = t.render(&history, true).unwrap();
        for i in 1..6 {
            history.push(msg("assistant", &format!("a{i}")));
            history.push(msg("user", &format!("q{i}")));
            let now = t.render(&history, true).unwrap();
            assert!(now.starts_with(&previous), "turn {i}");
            previous = now;
        }
    }

    #[test]
    fn templates_may_call_python_methods() {
        // Fragments of real Hugging Face templates (Qwen, Llama 3, Mistral): str/dict methods.
        let src = "{{ bos_token }}{% for m in messages %}{% if m.content.strip().startswith('#') %}H{% endif %}\
            [{{ m.role.upper() }}] {{ m.content.strip() | trim }}|{{ m.content.split(' ') | length }}\
            {% endfor %}{% if add_generation_prompt %}{{ {'a': 1}.items() | list | length }}{% endif %}";
        let t = ChatTemplate::from_source(src.into(), "<s>").unwrap();
        let out =
            t.render(&[msg("system", "  # be brief \n"), msg("user", " hi there ")], true).unwrap();
        assert_eq!(out, "<s>H[SYSTEM] # be brief|6[USER] hi there|41");
        let strict = ChatTemplate::from_source(
            "{% if messages[0].role != 'user' %}{{ raise_exception('user first') }}{% endif %}ok"
                .into(),
            "",
        )
        .unwrap();
        assert_eq!(strict.render(&[msg("user", "x")], true).unwrap(), "ok");
        let err = strict.render(&[msg("system", "x")], true).unwrap_err();
        assert!(err.to_string().contains("user first"), "{err}");
    }

    #[test]
    fn bad_template_is_an_error() {
        assert!(matches!(
            ChatTemplate::from_source("{% if %}".into(), ""),
            Err(TokensError::Template(_))
        ));
        assert!(matches!(
            ChatTemplate::from_file("/nonexistent/x.jinja", ""),
            Err(TokensError::TemplateFile { .. })
        ));
    }

    #[test]
    fn missing_tokenizer_is_an_error() {
        assert!(matches!(
            Tokenizer::from_file("/nonexistent/tokenizer.json"),
            Err(TokensError::Load { .. })
        ));
    }

    // Needs `make setup` (the DeepSeek tokenizer); the Makefile runs it before the tests.
    #[test]
    fn deepseek_tokenizer_matches_known_ids() {
        let tok = Tokenizer::from_file(default_tokenizer_path()).unwrap();
        let ids =
            tok.encode("<｜begin▁of▁sentence｜><｜User｜>Hello, world!<｜Assistant｜>").unwrap();
        assert_eq!(ids.first(), Some(&0));
        assert_eq!(ids.get(1), Some(&128_803));
        assert_eq!(ids.last(), Some(&128_804));
        assert_eq!(
            tok.decode(&ids).unwrap(),
            "<｜begin▁of▁sentence｜><｜User｜>Hello, world!<｜Assistant｜>"
        );
    }
}
