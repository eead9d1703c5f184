//! Environment overrides: where `KVMESH_*` variables come from ([`EnvSource`]: the process, or a
//! map in tests) and how they are applied onto the parsed document before it is typed.

use std::collections::BTreeMap;

use super::{ConfigError, RoutingConfig};

/// Prefix of every environment override.
pub const ENV_PREFIX: &str = "KVMESH_";

/// Where environment overrides come from (the process, or a map in tests).
pub trait EnvSource: Send + Sync {
    /// Every variable whose name starts with `prefix`, sorted by name.
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)>;
}

/// The real process environment.
#[derive(Debug, Clone, Copy, Default)]
pub struct ProcessEnv;

impl EnvSource for ProcessEnv {
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        let mut out: Vec<(String, String)> =
            std::env::vars().filter(|(k, _)| k.starts_with(prefix)).collect();
        out.sort();
        out
    }
}

/// A fixed set of variables, for tests.
#[derive(Debug, Clone, Default)]
pub struct MapEnv(pub BTreeMap<String, String>);

impl MapEnv {
    /// An environment holding exactly `pairs`.
    pub fn new<const N: usize>(pairs: [(&str, &str); N]) -> Self {
        Self(pairs.iter().map(|(k, v)| ((*k).to_owned(), (*v).to_owned())).collect())
    }
}

impl EnvSource for MapEnv {
    fn vars_with_prefix(&self, prefix: &str) -> Vec<(String, String)> {
        self.0
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    }
}

/// Applies `KVMESH_LISTEN` and `KVMESH_<SECTION>_<KEY>` (sections `model` — the default model,
/// in either file form — `routing`, `gateway`) onto the parsed document. A value is typed like the key's default (or existing) value, so
/// `KVMESH_MODEL_NAME=123` stays a string and `KVMESH_ROUTING_TEMPERATURE=0.5` becomes a float.
pub(super) fn apply_env(doc: &mut toml::Table, env: &dyn EnvSource) -> Result<(), ConfigError> {
    let defaults = default_scalars();
    for (var, raw) in env.vars_with_prefix(ENV_PREFIX) {
        let rest = &var[ENV_PREFIX.len()..];
        let (section, key) = if rest == "LISTEN" {
            (None, "listen".to_owned())
        } else {
            let Some((section, key)) = rest.split_once('_') else {
                continue;
            };
            let section = section.to_ascii_lowercase();
            if !["model", "routing", "gateway"].contains(&section.as_str()) || key.is_empty() {
                continue; // other KVMESH_* variables belong to other tools (KVMESH_TOKENIZER, …)
            }
            (Some(section), key.to_ascii_lowercase())
        };
        let table = match &section {
            None => &mut *doc,
            // `[model]` was normalized into `models` (config/models.rs): its overrides go to the
            // default (first) model, created when the file has none.
            Some(s) if s == "model" => match default_model_table(doc) {
                Some(t) => t,
                None => {
                    return Err(ConfigError::Env {
                        var,
                        reason: "models is not an array of tables in the file".into(),
                    })
                }
            },
            Some(s) => {
                match doc.entry(s.clone()).or_insert_with(|| toml::Value::Table(toml::Table::new()))
                {
                    toml::Value::Table(t) => t,
                    _ => {
                        return Err(ConfigError::Env {
                            var,
                            reason: format!("[{s}] is not a table in the file"),
                        })
                    }
                }
            }
        };
        let path = match &section {
            None => key.clone(),
            Some(s) => format!("{s}.{key}"),
        };
        let template = table.get(&key).cloned().or_else(|| defaults.get(&path).cloned());
        let value = typed_like(template.as_ref(), &raw)
            .map_err(|reason| ConfigError::Env { var: var.clone(), reason })?;
        table.insert(key, value);
    }
    Ok(())
}

/// The first `[[models]]` table (one is added when the file has no model).
fn default_model_table(doc: &mut toml::Table) -> Option<&mut toml::Table> {
    let models = doc.entry("models").or_insert_with(|| toml::Value::Array(Vec::new()));
    let toml::Value::Array(list) = models else { return None };
    if list.is_empty() {
        list.push(toml::Value::Table(toml::Table::new()));
    }
    match list.first_mut() {
        Some(toml::Value::Table(t)) => Some(t),
        _ => None,
    }
}

/// Scalar keys of the default configuration by dotted path, to type environment values.
fn default_scalars() -> BTreeMap<String, toml::Value> {
    let mut out = BTreeMap::new();
    if let Ok(toml::Value::Table(t)) = toml::Value::try_from(RoutingConfig::default()) {
        for (k, v) in t {
            out.insert(format!("routing.{k}"), v);
        }
    }
    out.insert("model.block_size".into(), toml::Value::Integer(16));
    out
}

fn typed_like(template: Option<&toml::Value>, raw: &str) -> Result<toml::Value, String> {
    let raw = raw.trim();
    match template {
        Some(toml::Value::Integer(_)) => raw
            .parse::<i64>()
            .map(toml::Value::Integer)
            .map_err(|_| format!("{raw:?} is not an integer")),
        Some(toml::Value::Float(_)) => raw
            .parse::<f64>()
            .map(toml::Value::Float)
            .map_err(|_| format!("{raw:?} is not a number")),
        Some(toml::Value::Boolean(_)) => match raw {
            "1" | "true" | "yes" | "on" => Ok(toml::Value::Boolean(true)),
            "0" | "false" | "no" | "off" => Ok(toml::Value::Boolean(false)),
            _ => Err(format!("{raw:?} is not a boolean")),
        },
        _ => Ok(toml::Value::String(raw.to_owned())),
    }
}
