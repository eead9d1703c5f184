//! How long an engine step takes: the simulator's whole performance model.
//!
//! A step costs its prefill tokens at `prefill_tokens_per_s` plus, when it decodes, one
//! inter-token latency that grows linearly with the batch: `itl × (1 + contention × (b-1)/(max-1))`
//! for `b` scheduled sequences out of `max_num_seqs` (so `contention` is the extra fraction of ITL
//! at a full batch, like llm-d-inference-sim's `time-factor-under-load − 1`). Prefill chunks and
//! decodes in one step add up, which is how a long prompt delays everyone's next token (chunked
//! prefill interference). Every duration is divided by `speedup`. Cached prompt tokens cost
//! nothing, which is the effect a KV-aware router is built to exploit. A step that runs a LoRA
//! adapter not in a GPU slot first loads it (`--lora-load-ms` each), which is what an
//! adapter-aware router avoids by sending an adapter where it is resident.

use std::time::Duration;

/// The step-duration model (validated by `config`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TimingModel {
    /// Uncached prompt tokens computed per second.
    pub prefill_tokens_per_s: f64,
    /// Inter-token latency of a batch of one, seconds.
    pub itl_s: f64,
    /// Extra fraction of ITL at a full batch.
    pub contention: f64,
    /// Batch size at which `contention` is reached.
    pub max_num_seqs: u32,
    /// Divides every duration.
    pub speedup: f64,
}

impl TimingModel {
    /// Duration of a step computing `prefill_tokens` prompt tokens and `decode_seqs` decode
    /// tokens, with `batch` sequences scheduled in total.
    pub fn step(&self, prefill_tokens: u64, decode_seqs: u32, batch: u32) -> Duration {
        let mut s = prefill_tokens as f64 / self.prefill_tokens_per_s;
        if decode_seqs > 0 {
            let span = f64::from(self.max_num_seqs.saturating_sub(1).max(1));
            let load = f64::from(batch.saturating_sub(1)).min(span) / span;
            s += self.itl_s * (1.0 + self.contention * load);
        }
        Duration::from_secs_f64((s / self.speedup).max(0.0))
    }

    /// Loading `tokens` from the CPU offload tier at `tokens_per_s`, sped up like everything else.
    pub fn offload_load(&self, tokens: u64, tokens_per_s: f64) -> Duration {
        let tps = if tokens_per_s.is_finite() && tokens_per_s > 0.0 { tokens_per_s } else { 1.0 };
        Duration::from_secs_f64((tokens as f64 / tps / self.speedup).max(0.0))
    }

    /// Loading `adapters` LoRA adapters into GPU slots at `ms_each`, sped up like everything else.
    pub fn lora_loads(&self, adapters: usize, ms_each: f64) -> Duration {
        Duration::from_secs_f64((adapters as f64 * ms_each / 1e3 / self.speedup).max(0.0))
    }

    /// A NIXL transfer of `blocks` blocks at `us_per_block`, sped up like everything else.
    pub fn transfer(&self, blocks: usize, us_per_block: f64) -> Duration {
        Duration::from_secs_f64((blocks as f64 * us_per_block / 1e6 / self.speedup).max(0.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model(speedup: f64) -> TimingModel {
        TimingModel {
            prefill_tokens_per_s: 1000.0,
            itl_s: 0.02,
            contention: 1.0,
            max_num_seqs: 5,
            speedup,
        }
    }

    #[test]
    fn step_durations() {
        let m = model(1.0);
        let cases: &[(u64, u32, u32, f64)] = &[
            (0, 0, 0, 0.0),
            (500, 0, 1, 0.5),   // pure prefill
            (0, 1, 1, 0.02),    // one sequence decoding
            (0, 5, 5, 0.04),    // full batch: ITL × (1 + contention)
            (0, 3, 3, 0.03),    // half way
            (1000, 2, 3, 1.03), // chunked prefill plus decodes
            (0, 9, 9, 0.04),    // beyond max_num_seqs: capped
        ];
        for &(p, d, b, want) in cases {
            let got = m.step(p, d, b).as_secs_f64();
            assert!((got - want).abs() < 1e-9, "step({p},{d},{b}) = {got}, want {want}");
        }
    }

    #[test]
    fn speedup_divides_everything() {
        assert!((model(100.0).step(1000, 1, 1).as_secs_f64() - 0.0102).abs() < 1e-9);
        assert!((model(10.0).transfer(100, 50.0).as_secs_f64() - 0.0005).abs() < 1e-12);
        assert!((model(10.0).lora_loads(2, 25.0).as_secs_f64() - 0.005).abs() < 1e-12);
    }
}
