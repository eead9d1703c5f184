//! The load sweep's decisions and numbers (pure): which rates to measure, where round_robin
//! saturates, which points are valid, and one point's summary.
//!
//! - **Ladder.** round_robin is measured first, from a light rate upwards by a factor
//!   ([`next_ladder_rate`]) until its TTFT p90 exceeds [`SATURATION_FACTOR`] × its light-load
//!   value (the p90 at the lowest rate), or the ladder's step bound is reached.
//! - **Saturation.** [`saturation_rate`] finds the crossing on the measured points: the first
//!   rate whose p90 exceeds the threshold, linearly interpolated from the point before it. The
//!   **load point** is [`LOAD_POINT_FRACTION`] × that rate; every policy (round_robin too) is
//!   measured there, and at the other fractions of [`SweepConfig::fractions`], light load to
//!   past saturation.
//! - **Validity.** A point is invalid when the machine's CPU was busier than
//!   [`MAX_CPU_BUSY`] on average over the point, or the client sent late: p90 of
//!   `sent − scheduled` above [`MAX_LATENESS_P90_MS`]. Then the machine, not the router, shaped
//!   the numbers; the headline never uses such a point, and the saturation search prefers valid
//!   points (it falls back to all points, and says so, when fewer than two are valid).
//! - **Validity on real engines.** When the engines are real vLLM CPU engines, the engines ARE
//!   the CPU load, so a busy machine is the workload, not noise. There a point is invalid when
//!   the CPU of everything except the engines (machine busy − the engines' own CPU, as a fraction
//!   of the machine) is above [`MAX_OTHER_CPU_BUSY`] — the gateway, the indexer, the client or
//!   anything else took the engines' cores — or lateness p90 is above [`MAX_LATENESS_P90_MS`]
//!   ([`invalid_reasons_real_engines`]).
//! - **Fleet timing per workload.** Each workload gets the simulated engines' timing that makes
//!   engine time, not the machine's CPU or the client's in-flight bound, saturate round_robin
//!   ([`default_timing`]; `--sim-speedup` / `--prefill-tokens-per-s` override it for
//!   every workload). The step budget (`--max-num-batched-tokens`) follows the prefill throughput
//!   so that one full prefill chunk always costs the same modelled engine time as the
//!   simulator's defaults (8,192 tokens at 20,000 tokens/s: 0.41 s) — otherwise a slower engine
//!   would also stall every decode step for longer while it is backlogged. The ladder's first
//!   rate is [`START_FRACTION`] × [`estimated_saturation`]: the fleet's real-time prefill
//!   throughput ÷ the uncached tokens one arrival costs round_robin ([`arrival_cost_tokens`]).
//! - **Steady state.** Agentic and paced sessions live longer than a point's window; their points
//!   start sessions a warm-up earlier and count only the requests scheduled inside the window
//!   ([`MeasureWindow`], [`window_for`], [`window_records`]); the ceiling of such a point counts
//!   the window's requests with everything sent before as history
//!   (`workload::ceiling_with_history`).
//! - **Several models.** A `models` point also has its numbers per base model (hit rate against
//!   the model's own ceiling, TTFT p90, load over its own workers) and the requests an engine
//!   answered 404, sent to a worker of another model ([`models::model_points`]).
//! - **Gateway replicas.** A point may run behind N gateway replicas, the client spreading
//!   requests over them per connection (session) or per request ([`replicas`]); its summary adds
//!   session moves and the load's CoV. A lost-events point faults one replica's indexer and
//!   measures its recovery ([`lost_events`]).

mod ladder;
pub mod lost_events;
pub mod models;
mod point;
pub mod replicas;
mod timing;
mod validity;
mod window;

pub use ladder::*;
pub use point::*;
pub use timing::*;
pub use validity::*;
pub use window::*;

#[cfg(test)]
mod tests;
