//! A fleet file (the indexer's TOML) read into a [`StackSpec`]: what `make run FLEET=…` starts.
//! Its workers (roles, models, addresses for external engines), its models (one `[model]`'s block
//! size, or `[[models]]` with aliases and adapters), `[routing]`, `[filter]`, `[epp] conformance`
//! and `[gateway] local_sim_args`. Pure: text in, spec out.

use anyhow::Context;
use kvmesh_core::api::Role;

use super::spec::{ModelSpec, StackSpec};
use crate::worker::WorkerSpec;

impl StackSpec {
    /// Takes the workers, models, `[routing]`, `[filter]` and `[gateway]` settings of a fleet
    /// file's text; a fleet whose workers and models do not fit together is an error.
    pub fn apply_fleet_file(&mut self, text: &str) -> anyhow::Result<()> {
        let doc: toml::Table = toml::from_str(text).context("parse")?;
        if let Some(models) = doc.get("models") {
            let models =
                models.as_array().context("`models` must be an array of tables ([[models]])")?;
            self.models = models.iter().map(model_spec).collect::<anyhow::Result<_>>()?;
            if let Some(first) = self.models.first() {
                self.block_size = first.block_size;
            }
        }
        if let Some(bs) =
            doc.get("model").and_then(|m| m.get("block_size")).and_then(toml::Value::as_integer)
        {
            self.block_size = u32::try_from(bs).context("model.block_size")?;
        }
        if let Some(routing) = doc.get("routing").and_then(toml::Value::as_table) {
            self.routing_toml = toml::to_string(routing)?;
        }
        if let Some(filter) = doc.get("filter") {
            self.filter_config = serde_json::to_value(filter)?;
        }
        if let Some(c) =
            doc.get("epp").and_then(|e| e.get("conformance")).and_then(toml::Value::as_bool)
        {
            self.epp_conformance = c;
        }
        if let Some(gateway) = doc.get("gateway").and_then(toml::Value::as_table) {
            if let Some(sim) = gateway.get("local_sim_args").and_then(toml::Value::as_array) {
                self.sim_args = sim.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect();
            }
        }
        let workers = doc
            .get("workers")
            .and_then(toml::Value::as_array)
            .context("fleet file has no [[workers]]")?;
        self.workers = workers.iter().map(worker_spec).collect::<anyhow::Result<_>>()?;
        self.check_models()
    }
}

/// One `[[workers]]` table.
fn worker_spec(w: &toml::Value) -> anyhow::Result<WorkerSpec> {
    let id = w.get("id").and_then(toml::Value::as_str).context("worker without id")?;
    let role = match w.get("role").and_then(toml::Value::as_str).unwrap_or("both") {
        "decode" => Role::Decode,
        "prefill" => Role::Prefill,
        "both" => Role::Both,
        other => anyhow::bail!("worker {id}: unknown role {other}"),
    };
    let field = |k: &str| w.get(k).and_then(toml::Value::as_str).map(str::to_owned);
    Ok(WorkerSpec {
        model: field("model"),
        endpoint: field("endpoint"),
        kv_events: field("kv_events"),
        kv_replay: field("kv_replay"),
        ..WorkerSpec::new(id, role)
    })
}

/// One `[[models]]` table: what the simulators need (names, block size, adapters); the rest
/// (tokenizer, chat template) goes to the generated fleet file as written.
fn model_spec(m: &toml::Value) -> anyhow::Result<ModelSpec> {
    let name = m.get("name").and_then(toml::Value::as_str).context("[[models]] without name")?;
    let block_size = m
        .get("block_size")
        .and_then(toml::Value::as_integer)
        .with_context(|| format!("model {name}: no block_size"))?;
    let names = |k: &str| -> anyhow::Result<Vec<String>> {
        let Some(v) = m.get(k) else { return Ok(Vec::new()) };
        v.as_array()
            .and_then(|a| a.iter().map(|n| n.as_str().map(str::to_owned)).collect())
            .with_context(|| format!("model {name}: `{k}` must be a list of names"))
    };
    let mut spec = ModelSpec::new(name, u32::try_from(block_size).context("model block_size")?);
    spec.aliases = names("aliases")?;
    spec.adapters = names("adapters")?;
    let mut rest = m.as_table().cloned().unwrap_or_default();
    for k in ["name", "block_size", "aliases", "adapters"] {
        rest.remove(k);
    }
    spec.extra_toml = toml::to_string(&rest)?;
    Ok(spec)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::procs::repo_root;

    fn read(fleet: &str) -> StackSpec {
        let text = std::fs::read_to_string(repo_root().join("envoy/fleets").join(fleet)).unwrap();
        let mut spec = StackSpec::aggregate(0);
        spec.apply_fleet_file(&text).unwrap();
        spec
    }

    #[test]
    fn the_multi_model_example_is_two_models_and_three_adapters_on_four_workers() {
        let spec = read("multi-model.toml");
        assert!(spec.has_model_catalog());
        let models: Vec<(&str, u32, usize)> =
            spec.models.iter().map(|m| (m.name.as_str(), m.block_size, m.adapters.len())).collect();
        assert_eq!(models, [("deepseek-v4", 16, 2), ("deepseek-v4-mini", 32, 1)]);
        assert_eq!(spec.block_size, 16, "the default model's");
        let served: Vec<(&str, &str)> = spec
            .workers
            .iter()
            .map(|w| (w.id.as_str(), spec.model(w.model.as_deref()).unwrap().name.as_str()))
            .collect();
        assert_eq!(
            served,
            [
                ("w0", "deepseek-v4"),
                ("w1", "deepseek-v4"),
                ("w2", "deepseek-v4-mini"),
                ("w3", "deepseek-v4-mini")
            ]
        );
        assert_eq!(spec.models[0].aliases, ["ds4"]);
    }

    #[test]
    fn single_model_examples_stay_single_model() {
        for fleet in ["local.toml", "disagg.toml"] {
            let spec = read(fleet);
            assert!(spec.models.is_empty() && !spec.has_model_catalog(), "{fleet}");
            assert!(spec.workers.iter().all(|w| w.model.is_none()), "{fleet}");
        }
    }

    #[test]
    fn a_worker_of_an_unlisted_model_and_a_repeated_name_are_refused() {
        let base = "[[models]]\nname = \"a\"\nblock_size = 16\nadapters = [\"x\"]\n\n[[models]]\nname = \"b\"\nblock_size = 32\n";
        let worker = |model: &str| {
            format!("\n[[workers]]\nid = \"w0\"\nmodel = \"{model}\"\n\n[[workers]]\nid = \"w1\"\nmodel = \"b\"\n")
        };
        let mut spec = StackSpec::aggregate(0);
        assert!(spec.apply_fleet_file(&format!("{base}{}", worker("a"))).is_ok());
        let err = spec.apply_fleet_file(&format!("{base}{}", worker("c"))).unwrap_err();
        assert!(err.to_string().contains("w0"), "{err}");
        let dup = base.replace("name = \"b\"", "name = \"b\"\naliases = [\"x\"]");
        let err = spec.apply_fleet_file(&format!("{dup}{}", worker("a"))).unwrap_err();
        assert!(format!("{err:#}").contains("used twice: [\"x\"]"), "{err:#}");
    }

    #[test]
    fn tokenizer_and_template_pass_through_to_the_generated_fleet_file() {
        let text = "[[models]]\nname = \"a\"\nblock_size = 16\ntokenizer = \"/t.json\"\nchat_template = \"/c.jinja\"\n\n[[workers]]\nid = \"w0\"\n";
        let mut spec = StackSpec::aggregate(0);
        spec.apply_fleet_file(text).unwrap();
        let extra: toml::Table = toml::from_str(&spec.models[0].extra_toml).unwrap();
        assert_eq!(extra.get("tokenizer").and_then(toml::Value::as_str), Some("/t.json"));
        assert_eq!(extra.get("chat_template").and_then(toml::Value::as_str), Some("/c.jinja"));
        assert_eq!(extra.len(), 2);
    }
}
