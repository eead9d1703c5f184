//! The fleet's base models: `[model]` (one model, the original form) or `[[models]]` (several, the
//! first is the default), each with its block size, tokenizer, chat template, aliases and LoRA
//! adapters; how the file's two forms become one list ([`normalize`]) and their checks.
//!
//! Both forms type into the same `Config::models` (the default first), so the rest of the indexer
//! knows one shape. `KVMESH_MODEL_*` overrides apply to the default model in either form.

use std::path::PathBuf;

use kvmesh_core::models::FleetModel;
use serde::{Deserialize, Serialize};

use super::{invalid, ConfigError, WorkerConfig};

/// Most base models one fleet serves: every model has a tokenizer (its caches bounded by
/// `routing.tokenize_cache_bytes` and `routing.tokenize_memo_bytes` each) and a `model` label value.
pub const MAX_MODELS: usize = 16;

/// Most LoRA adapters known per base model, configured and discovered together (discovered ones
/// past it are refused and counted: `kvmesh_served_adapters_refused_total{reason="too_many"}`).
pub const MAX_ADAPTERS_PER_MODEL: usize = 256;

/// Longest model, alias or adapter name accepted (vLLM's are paths or short names).
pub const MAX_NAME_BYTES: usize = 256;

/// One served base model: block size and tokenization, the names requests may use for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    /// The engines' served model name (what they list in `/v1/models`).
    pub name: String,
    /// Other names requests may use for it (no adapter).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub aliases: Vec<String>,
    /// Tokens per KV block; must equal the engines' (`--block-size`). Events that disagree are refused.
    pub block_size: u32,
    /// The model's `tokenizer.json`; default [`kvmesh_tokens::default_tokenizer_path`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tokenizer: Option<PathBuf>,
    /// A Jinja2 chat template file; default the built-in DeepSeek template.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<PathBuf>,
    /// `bos_token` given to a chat template loaded from `chat_template`.
    #[serde(default = "default_bos")]
    pub bos_token: String,
    /// LoRA adapters served on its workers (more are learned from the engines' `/v1/models`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adapters: Vec<String>,
}

fn default_bos() -> String {
    "<｜begin▁of▁sentence｜>".to_owned()
}

impl ModelConfig {
    /// The tokenizer file to load.
    pub fn tokenizer_path(&self) -> PathBuf {
        self.tokenizer.clone().unwrap_or_else(kvmesh_tokens::default_tokenizer_path)
    }

    /// Whether a change from `other` needs a new tokenizer (file, template or BOS changed).
    pub fn tokenizer_differs(&self, other: &ModelConfig) -> bool {
        self.tokenizer != other.tokenizer
            || self.chat_template != other.chat_template
            || self.bos_token != other.bos_token
    }

    /// The model as the fleet snapshot and `models::resolve` see it, with `extra` adapters
    /// (discovered) after the configured ones.
    pub fn fleet_model(&self, extra: &[String]) -> FleetModel {
        FleetModel {
            name: self.name.clone(),
            aliases: self.aliases.clone(),
            adapters: self.adapters.iter().chain(extra).cloned().collect(),
            block_size: self.block_size,
        }
    }
}

/// Rewrites the file's `[model]` into `models = [ … ]` before typing: one shape from here on. Both
/// forms at once is refused (which would be the default?).
pub(super) fn normalize(doc: &mut toml::Table) -> Result<(), ConfigError> {
    match (doc.remove("model"), doc.contains_key("models")) {
        (Some(_), true) => Err(invalid(
            "model",
            "[model] and [[models]]",
            "give one model as [model] or several as [[models]], not both",
        )),
        (Some(single), false) => {
            doc.insert("models".into(), toml::Value::Array(vec![single]));
            Ok(())
        }
        (None, _) => Ok(()),
    }
}

fn bad_name(name: &str) -> bool {
    name.trim().is_empty() || name.chars().any(char::is_whitespace) || name.len() > MAX_NAME_BYTES
}

/// Checks the models and every worker's `model`; the first problem is returned, naming the field.
pub(super) fn validate_models(
    models: &[ModelConfig],
    workers: &[WorkerConfig],
) -> Result<(), ConfigError> {
    if models.is_empty() {
        return Err(invalid("models", "[]", "one model is required: [model] or [[models]]"));
    }
    if models.len() > MAX_MODELS {
        return Err(invalid("models", models.len(), format!("at most {MAX_MODELS} models")));
    }
    // The single form keeps its old field names in errors (`model.block_size`).
    let single = models.len() == 1;
    for (i, m) in models.iter().enumerate() {
        let field =
            |k: &str| if single { format!("model.{k}") } else { format!("models[{i}].{k}") };
        if m.name.trim().is_empty() {
            return Err(invalid(field("name"), &m.name, "must not be empty"));
        }
        if bad_name(&m.name) {
            return Err(invalid(
                field("name"),
                &m.name,
                format!("must be a name without whitespace, at most {MAX_NAME_BYTES} bytes"),
            ));
        }
        if m.block_size == 0 || m.block_size > 4096 {
            return Err(invalid(field("block_size"), m.block_size, "must be in 1..=4096"));
        }
        for (key, names) in [("aliases", &m.aliases), ("adapters", &m.adapters)] {
            if let Some(n) = names.iter().find(|n| bad_name(n)) {
                return Err(invalid(
                    field(key),
                    n,
                    format!("must be names without whitespace, at most {MAX_NAME_BYTES} bytes"),
                ));
            }
        }
        if m.adapters.len() > MAX_ADAPTERS_PER_MODEL {
            return Err(invalid(
                field("adapters"),
                m.adapters.len(),
                format!("at most {MAX_ADAPTERS_PER_MODEL} adapters per model"),
            ));
        }
    }
    let fleet: Vec<FleetModel> = models.iter().map(|m| m.fleet_model(&[])).collect();
    let dup = kvmesh_core::models::duplicate_names(&fleet);
    if !dup.is_empty() {
        return Err(invalid(
            "models",
            dup.join(", "),
            "every model, alias and adapter name must be unique across the fleet",
        ));
    }
    for (i, w) in workers.iter().enumerate() {
        if let Some(name) = &w.model {
            if !models.iter().any(|m| &m.name == name) {
                let known: Vec<&str> = models.iter().map(|m| m.name.as_str()).collect();
                return Err(invalid(
                    format!("workers[{i}].model"),
                    name,
                    format!("must name a base model of the fleet ({})", known.join(", ")),
                ));
            }
        }
    }
    Ok(())
}
