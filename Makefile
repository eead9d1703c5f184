# kvmesh — one entry point for developers and CI. `make help` lists the targets.
SHELL := /bin/bash
.DEFAULT_GOAL := help

CARGO        ?= cargo
PROFILE      ?= debug
WASM         := target/wasm32-wasip1/wasm/kvmesh_filter.wasm
FLEET        ?=
ENGINES      ?=
EDGE         ?=
VLLM_TESTS   := $(basename $(notdir $(wildcard e2e/tests/vllm_*.rs)))
export KVMESH_TOKENIZER ?= $(CURDIR)/.tools/tokenizer/tokenizer.json
export KVMESH_ENVOY     ?= $(CURDIR)/.tools/bin/envoy
export KVMESH_WASM      ?= $(CURDIR)/$(WASM)

ifeq ($(PROFILE),release)
CARGO_PROFILE_FLAG := --release
else
CARGO_PROFILE_FLAG :=
endif

.PHONY: help setup build wasm test run demo bench bench-quick bench-vllm bench-aiperf bench-scale bench-replicas lint validate clean setup-vllm test-vllm fuzz soak

help: ## List the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: ## Install the wasm target, Envoy 1.40, the DeepSeek tokenizer and test tools into .tools/
	@scripts/setup.sh

wasm: setup ## Build the proxy-wasm filter (target/wasm32-wasip1/wasm/kvmesh_filter.wasm)
	$(CARGO) build -p kvmesh-filter --target wasm32-wasip1 --profile wasm

build: setup wasm ## Build every binary (PROFILE=debug|release)
	$(CARGO) build $(CARGO_PROFILE_FLAG) --bins

test: build ## Run every unit, integration and end-to-end test, and validate every config
	$(CARGO) test --workspace --no-fail-fast -- --test-threads=$${KVMESH_TEST_THREADS:-2}
	envoy/validate.sh
	@echo "(the workspace tests include a short fuzz run of every target: kvmesh-fuzz, KVMESH_FUZZ_CASES per target)"

# `make fuzz`: every parser of outside bytes (fuzz/README.md). proptest engine by default (stable
# toolchain); FUZZ_ENGINE=libfuzzer runs cargo-fuzz (coverage-guided, RUSTC_BOOTSTRAP=1 on stable).
FUZZ_SECONDS ?= 60
FUZZ_ENGINE  ?= proptest
FUZZ_TARGETS ?=
fuzz: setup ## Fuzz each parser of outside bytes for FUZZ_SECONDS (default 60) each; FUZZ_TARGETS="kv_batch …" to pick, FUZZ_ENGINE=libfuzzer for cargo-fuzz
ifeq ($(FUZZ_ENGINE),libfuzzer)
	@command -v cargo-fuzz >/dev/null || $(CARGO) install cargo-fuzz --locked
	$(CARGO) run -q -p kvmesh-fuzz --bin kvmesh-fuzz -- --write-corpus target/fuzz-corpus
	set -eo pipefail; for t in $${FUZZ_TARGETS:-$$($(CARGO) run -q -p kvmesh-fuzz --bin kvmesh-fuzz -- --list)}; do \
	  RUSTC_BOOTSTRAP=1 $(CARGO) fuzz run --fuzz-dir fuzz --features libfuzzer --sanitizer none $$t target/fuzz-corpus/$$t \
	    -- -max_total_time=$(FUZZ_SECONDS) -rss_limit_mb=4096 -max_len=65536 -print_final_stats=1 2>&1 | grep -E 'stat::number_of_executed_units|ERROR|SUMMARY|Done' | sed "s/^/$$t: /"; \
	done
else
	$(CARGO) run -p kvmesh-fuzz --bin kvmesh-fuzz -- --seconds $(FUZZ_SECONDS) $(FUZZ_TARGETS)
endif

# `make soak`: memory under a steady mixed workload with churn (e2e/bench/README.md "Soak"); not in CI.
SOAK_MINUTES  ?= 30
SOAK_SAMPLE_S ?= 60
soak: build ## Soak Envoy + indexer + sims for SOAK_MINUTES (default 30) under churn, sampling memory every SOAK_SAMPLE_S (default 60) s; PROFILE=release for release binaries → bench-out/soak/report.md + PNG
	target/$(PROFILE)/kvmesh-soak $(if $(filter release,$(PROFILE)),--release,) --minutes $(SOAK_MINUTES) --sample-s $(SOAK_SAMPLE_S) --out bench-out/soak $(SOAK_ARGS)

setup-vllm: setup ## Install vLLM's CPU build and a dummy model into .tools/vllm/ (about 4 GB; ENGINES=vllm and test-vllm do it on first use)
	@scripts/setup-vllm.sh >/dev/null

test-vllm: build setup-vllm ## End-to-end tests against real vLLM CPU engines (not part of `make test`: needs the vLLM install)
	$(CARGO) test -p kvmesh-e2e --features real-vllm $(addprefix --test ,$(VLLM_TESTS)) -- --test-threads=1 --nocapture

validate: build ## Validate Envoy, Istio, Kubernetes and Prometheus configs offline
	envoy/validate.sh

# `make run` is what a newcomer judges kvmesh by: release binaries (the build is paid once); tests stay on debug.
RUN_PROFILE ?= release
run: setup wasm ## Serve a KV-aware gateway on 127.0.0.1:8080 over local simulated workers, release build (FLEET=<file> for another fleet, e.g. FLEET=envoy/fleets/multi-model.toml: two models and three LoRA adapters, a curl per kind of request; ENGINES=vllm for real vLLM CPU engines, ENGINES=external FLEET=<file> for engines already running, EDGE=ext_proc for the indexer's endpoint picker over Envoy ext_proc instead of the wasm filter (GIE's protocol, gRPC on :9002; EDGE=both: the picker, the filter as its fallback), PROMETHEUS=1 for Prometheus on :9090, RUN_PROFILE=debug for debug binaries)
	@echo "make run: building $(RUN_PROFILE) binaries (the first build takes a few minutes)"
	$(MAKE) --no-print-directory build PROFILE=$(RUN_PROFILE)
	$(if $(filter vllm,$(ENGINES)),@scripts/setup-vllm.sh >/dev/null,)
	target/$(RUN_PROFILE)/kvmesh-stack $(if $(filter release,$(RUN_PROFILE)),--release,) $(if $(FLEET),--fleet $(FLEET),) $(if $(ENGINES),--engines $(ENGINES),) $(if $(EDGE),--edge $(EDGE),) $(if $(filter 1,$(PROMETHEUS)),--prometheus,)

demo: ## `make run` on the disaggregated example fleet (2 prefill + 2 decode workers, disaggregation, local continuations, KV migration)
	$(MAKE) run FLEET=envoy/fleets/disagg.toml

# Extra kvmesh-bench flags: BENCH_ARGS goes to every invocation of a bench target (shared flags,
# e.g. --block-size; for bench-quick, bench-vllm and bench-aiperf also that subcommand's own);
# `make bench` runs two parts and a report step, so their own flags go in SWEEP_ARGS and
# OVERHEAD_ARGS (e2e/bench/README.md, "The orchestrator").
bench: ## Load sweep of five workloads × six policies (≤ 90 min in all; agentic and paced after a warm-up), router overhead, indexer microbenchmarks → bench-out/report.md
	$(MAKE) build PROFILE=release
	mkdir -p bench-out/indexer
	rm -f bench-out/indexer/figures.jsonl
	KVMESH_BENCH_FIGURES=$(CURDIR)/bench-out/indexer/figures.jsonl $(CARGO) bench -p kvmesh-indexer --bench index --bench route
	target/release/kvmesh-bench sweep --out bench-out --duration-s 20 --max-steps 5 $(BENCH_ARGS) $(SWEEP_ARGS)
	target/release/kvmesh-bench overhead --out bench-out --samples 100 $(BENCH_ARGS) $(OVERHEAD_ARGS)
	target/release/kvmesh-bench report --out bench-out --parts sweep,overhead --indexer-figures bench-out/indexer/figures.jsonl $(BENCH_ARGS)

bench-quick: ## Load sweep for iteration (≤ 10 min after the build): the trace, three rates, three policies → bench-out/quick/report.md
	$(MAKE) build PROFILE=release
	target/release/kvmesh-bench sweep --out bench-out/quick --workloads trace --policies round_robin,kvmesh_approximate,kvmesh_precise --factor 2 --max-steps 4 --fractions 0.5,0.8,1.2 --duration-s 20 $(BENCH_ARGS)

bench-vllm: setup-vllm ## Load sweep on 2 real vLLM CPU engines (agentic, 3 policies, one rate, ~15 min; installs vLLM on first use) → bench-out/vllm/report.md
	$(MAKE) build PROFILE=release
	nice -n 19 target/release/kvmesh-bench sweep --out bench-out/vllm --engines vllm --workers 2 --block-size 32 --workloads agentic --policies round_robin,kvmesh_precise,least_request --rates 0.06 --duration-s 150 $(BENCH_ARGS)

# `make bench-aiperf ENGINES=vllm`: 2 real vLLM CPU engines (started once), the workload at half
# size and 0.6 requests/s for 240 s, four policies.
AIPERF_VLLM_ARGS := --engines vllm --workers 2 --block-size 32 --policies round_robin,least_request,ring_hash,kvmesh_precise --rate 0.6 --duration-s 240 --scale 0.5

bench-aiperf: ## NVIDIA's aiperf as the client of each policy's gateway (5 policies, multi-turn chats sharing a system prompt, ~7 min; ENGINES=vllm: 2 real vLLM CPU engines, ~20 min; installs aiperf into .tools/aiperf on first use) → bench-out/aiperf[-vllm]/report.md
	$(MAKE) build PROFILE=release
	$(if $(filter vllm,$(ENGINES)),@scripts/setup-vllm.sh >/dev/null,)
	@scripts/setup-aiperf.sh >/dev/null
	$(if $(filter vllm,$(ENGINES)),nice -n 19 ,)target/release/kvmesh-bench aiperf $(if $(filter vllm,$(ENGINES)),--out bench-out/aiperf-vllm $(AIPERF_VLLM_ARGS),--out bench-out/aiperf) $(BENCH_ARGS)

# `make bench-scale`: a thousand workers, one indexer (issue 47; e2e/bench/README.md "Scale"); not in
# CI. SCALE_ARGS goes to `kvmesh-bench scale`, e.g. `--workers 250 --blocks-per-worker 16384` on a
# machine without ~10 GB to spare, `--note "…"` for what else ran.
bench-scale: setup ## One release indexer under 1,000 synthetic workers' KV events (64k blocks each): memory, apply throughput, routes, subscriptions, replay storm (~15 min, ~10 GB RAM at full size) → bench-out/scale/scale.md
	$(CARGO) build --release -p kvmesh-indexer -p kvmesh-bench --bin kvmesh-indexer --bin kvmesh-bench
	target/release/kvmesh-bench scale --out bench-out/scale $(BENCH_ARGS) $(SCALE_ARGS)

# `make bench-replicas`: the gateway-replica curve (issue 47; e2e/bench/README.md "Gateway
# replicas"); not in CI, and only valid on a quiet machine. REPLICAS_WORKLOADS picks the
# workloads, REPLICAS_ARGS goes to the sweep: `make bench-replicas REPLICAS_WORKLOADS=agentic
# REPLICAS_ARGS="--sim-speedup 2"` when the 8-replica points come out invalid (CPU > 85 %).
REPLICAS_WORKLOADS ?= agentic,trace
bench-replicas: ## Replica curve: agentic and trace, round_robin / ring_hash / kvmesh_precise at 1, 2, 4, 8 gateway replicas at the load point, per connection and per request (~80 min) → bench-out/replicas/report.md
	$(MAKE) build PROFILE=release
	target/release/kvmesh-bench sweep --out bench-out/replicas --workloads $(REPLICAS_WORKLOADS) --policies round_robin,ring_hash,kvmesh_precise --fractions 0.8 --max-steps 5 --duration-s 20 --replicas 1,2,4,8 --replica-spread per-connection,per-request $(BENCH_ARGS) $(REPLICAS_ARGS)

# cargo-machete (unused dependencies) is installed into .tools/cargo on first use, pinned.
MACHETE := .tools/cargo/bin/cargo-machete
$(MACHETE):
	$(CARGO) install --quiet --locked --root .tools/cargo cargo-machete@0.9.2

lint: $(MACHETE) ## rustfmt check, import cycles, unused dependencies, clippy with the workspace lints (wasm included)
	$(CARGO) fmt --all -- --check
	python3 scripts/module-cycles.py
	$(MACHETE)
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) clippy -p kvmesh-filter --target wasm32-wasip1 -- -D warnings

clean: ## Remove build output (keeps .tools/)
	$(CARGO) clean
	rm -rf bench-out
