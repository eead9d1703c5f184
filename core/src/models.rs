//! The fleet's models as the filter and the indexer both see them: base models with their aliases
//! and LoRA adapters, how a request's `model` field selects one ([`resolve`]), and the answer for a
//! model nobody serves ([`not_found`]).
//!
//! One definition, because the two sides must agree: the indexer routes a request within the
//! workers of the base model [`resolve`] names, and with the indexer down the filter pins it within
//! the same workers from its last fleet snapshot. Names follow vLLM: a request without `model` is
//! for the default model (vLLM serves its first served name); a name that is neither a base model,
//! an alias nor an adapter is vLLM's 404 (`param: "model"`), never a request to a random worker.
//! "All model names, including base and LoRA names, must be unique" (GIE's rule, kept here): a
//! fleet that repeats a name is refused where it is loaded, so resolution is never ambiguous.

pub use crate::api::FleetModel;
use crate::api::{ErrorBody, ErrorDetail};

/// What a request's `model` selects: a base model, and the adapter when it names one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ModelRef<'a> {
    /// The base model whose workers may serve the request.
    pub base: &'a str,
    /// The LoRA adapter, when the request names one (its KV is keyed by this name).
    pub adapter: Option<&'a str>,
}

/// A `model` no entry of the fleet serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnknownModel(pub String);

impl std::fmt::Display for UnknownModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "the model `{}` does not exist", self.0)
    }
}

impl std::error::Error for UnknownModel {}

/// Resolves a request's `model` against `models`: a base name or an alias selects that base model,
/// an adapter name its base model with the adapter; no `model` (or an empty one) selects the first
/// model, the default. `Err` for a name nobody serves, or for any request when `models` is empty.
pub fn resolve<'a>(
    models: &'a [FleetModel],
    requested: Option<&str>,
) -> Result<ModelRef<'a>, UnknownModel> {
    let unknown = || UnknownModel(requested.unwrap_or_default().to_owned());
    let Some(name) = requested.filter(|n| !n.is_empty()) else {
        return models
            .first()
            .map(|m| ModelRef { base: &m.name, adapter: None })
            .ok_or_else(unknown);
    };
    for m in models {
        if m.name == name || m.aliases.iter().any(|a| a == name) {
            return Ok(ModelRef { base: &m.name, adapter: None });
        }
        if let Some(a) = m.adapters.iter().find(|a| *a == name) {
            return Ok(ModelRef { base: &m.name, adapter: Some(a) });
        }
    }
    Err(unknown())
}

/// The names `models` repeat (across base names, aliases and adapters), each once: a fleet with
/// any is ambiguous and is refused where it is loaded.
pub fn duplicate_names(models: &[FleetModel]) -> Vec<String> {
    let mut seen = std::collections::HashSet::new();
    let mut dup = Vec::new();
    let names = models
        .iter()
        .flat_map(|m| std::iter::once(&m.name).chain(m.aliases.iter()).chain(m.adapters.iter()));
    for n in names {
        if !seen.insert(n.as_str()) && !dup.contains(n) {
            dup.push(n.clone());
        }
    }
    dup
}

/// The `model` label value of a request whose base model is not known (no fleet snapshot yet, an
/// unknown model, a body that could not be read).
pub const UNKNOWN_MODEL_LABEL: &str = "unknown";
/// The `model` label value of the base models past a label bound.
pub const OTHER_MODEL_LABEL: &str = "other";
/// Longest `model` label value; a longer name is cut (names come from the fleet file).
pub const MAX_MODEL_LABEL_BYTES: usize = 64;

/// A base model's `model` metric label, the same in the filter and the indexer so their series
/// join: the name with every character outside `[A-Za-z0-9_-]` as `_` (a dot would end the value
/// in an Envoy stat name), at most [`MAX_MODEL_LABEL_BYTES`]; an empty name is
/// [`UNKNOWN_MODEL_LABEL`].
pub fn metric_label(base: &str) -> String {
    metric_label_cow(base).into_owned()
}

/// [`metric_label`] without a copy for a name that is already a label value (the usual case).
pub fn metric_label_cow(base: &str) -> std::borrow::Cow<'_, str> {
    let clean = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
    if !base.is_empty() && base.len() <= MAX_MODEL_LABEL_BYTES && base.chars().all(clean) {
        return std::borrow::Cow::Borrowed(base);
    }
    let mut out: String = base
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() || c == '_' || c == '-' { c } else { '_' })
        .take(MAX_MODEL_LABEL_BYTES)
        .collect();
    if out.is_empty() {
        out.push_str(UNKNOWN_MODEL_LABEL);
    }
    std::borrow::Cow::Owned(out)
}

/// The stable reason of the unknown-model answer (metrics label, `x-kvmesh-error`).
pub const UNKNOWN_MODEL_REASON: &str = "unknown_model";

/// vLLM's answer for a model it does not serve (HTTP 404):
/// `{"error": {"message": "The model `x` does not exist.", "type": "NotFoundError", "param": "model", "code": 404}}`,
/// with kvmesh's stable reason added.
pub fn not_found(requested: &str) -> ErrorBody {
    ErrorBody {
        error: ErrorDetail {
            message: format!("The model `{requested}` does not exist."),
            kind: "NotFoundError".to_owned(),
            code: 404,
            param: Some("model".to_owned()),
            reason: Some(UNKNOWN_MODEL_REASON.to_owned()),
        },
    }
}

/// `GET /v1/models` as vLLM answers it, for the whole fleet: each base model (`parent: null`),
/// its aliases as models of their own (vLLM lists each `--served-model-name`), and each adapter
/// with `parent` = its base model. `created` is the caller's clock (seconds since the epoch).
pub fn models_list(models: &[FleetModel], created: u64) -> serde_json::Value {
    let entry = |id: &str, root: &str, parent: Option<&str>| {
        serde_json::json!({
            "id": id,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": root,
            "parent": parent,
        })
    };
    let data: Vec<_> = models
        .iter()
        .flat_map(|m| {
            let base =
                std::iter::once(&m.name).chain(m.aliases.iter()).map(|n| entry(n, &m.name, None));
            let adapters = m.adapters.iter().map(|a| entry(a, a, Some(&m.name)));
            base.chain(adapters).collect::<Vec<_>>()
        })
        .collect();
    serde_json::json!({ "object": "list", "data": data })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fleet() -> Vec<FleetModel> {
        vec![
            FleetModel {
                name: "base-a".into(),
                aliases: vec!["a".into()],
                adapters: vec!["a-sql".into(), "a-chat".into()],
                block_size: 16,
            },
            FleetModel {
                name: "base-b".into(),
                aliases: vec![],
                adapters: vec!["b-code".into()],
                block_size: 32,
            },
        ]
    }

    #[test]
    fn names_aliases_and_adapters_resolve_to_their_base() {
        let m = fleet();
        let r = |n| resolve(&m, n);
        assert_eq!(r(Some("base-a")), Ok(ModelRef { base: "base-a", adapter: None }));
        assert_eq!(r(Some("a")), Ok(ModelRef { base: "base-a", adapter: None }));
        assert_eq!(r(Some("a-chat")), Ok(ModelRef { base: "base-a", adapter: Some("a-chat") }));
        assert_eq!(r(Some("b-code")), Ok(ModelRef { base: "base-b", adapter: Some("b-code") }));
        assert_eq!(r(Some("base-b")), Ok(ModelRef { base: "base-b", adapter: None }));
    }

    #[test]
    fn no_model_is_the_default_and_an_unknown_one_is_refused() {
        let m = fleet();
        assert_eq!(resolve(&m, None), Ok(ModelRef { base: "base-a", adapter: None }));
        assert_eq!(resolve(&m, Some("")), Ok(ModelRef { base: "base-a", adapter: None }));
        assert_eq!(resolve(&m, Some("gpt-4")), Err(UnknownModel("gpt-4".into())));
        assert_eq!(resolve(&m, Some("BASE-A")), Err(UnknownModel("BASE-A".into())));
        assert_eq!(resolve(&[], None), Err(UnknownModel(String::new())));
    }

    #[test]
    fn repeated_names_are_found_once() {
        let mut m = fleet();
        assert!(duplicate_names(&m).is_empty());
        m[1].aliases = vec!["a-sql".into(), "base-a".into()];
        m[1].adapters.push("a-sql".into());
        assert_eq!(duplicate_names(&m), vec!["a-sql".to_owned(), "base-a".to_owned()]);
    }

    #[test]
    fn the_model_list_names_every_base_alias_and_adapter() {
        let list = models_list(&fleet(), 7);
        let ids: Vec<_> = list["data"]
            .as_array()
            .unwrap()
            .iter()
            .map(|e| (e["id"].as_str().unwrap(), e["parent"].as_str()))
            .collect();
        assert_eq!(
            ids,
            vec![
                ("base-a", None),
                ("a", None),
                ("a-sql", Some("base-a")),
                ("a-chat", Some("base-a")),
                ("base-b", None),
                ("b-code", Some("base-b")),
            ]
        );
        assert_eq!(list["object"], "list");
        assert_eq!(list["data"][0]["created"], 7);
    }

    #[test]
    fn not_found_is_vllms_shape() {
        let body = serde_json::to_value(not_found("gpt-4")).unwrap();
        assert_eq!(
            body,
            serde_json::json!({"error": {
                "message": "The model `gpt-4` does not exist.",
                "type": "NotFoundError",
                "param": "model",
                "code": 404,
                "reason": "unknown_model",
            }})
        );
    }
}
