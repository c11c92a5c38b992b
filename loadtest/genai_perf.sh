#!/usr/bin/env bash
# genai-perf (PyPI 0.0.16) against the ensemble, as for a TensorRT-LLM deployment, or with
# ENDPOINT_TYPE=chat (or completions) against the OpenAI-compatible API (docs/openai.md).
#
#   loadtest/genai_perf.sh -u 127.0.0.1:8001 --concurrency 4 --request-count 16
#   ENDPOINT_TYPE=chat loadtest/genai_perf.sh -m smollm2-135m-instruct -u 127.0.0.1:9000 \
#     --concurrency 4 --request-count 16
#
# genai-perf lives in a venv of its own (.run/genai-perf: its dependencies differ from the
# server's) and drives perf_analyzer through loadtest/perf_analyzer.sh. The tokenizer is the
# local target checkpoint, so nothing is fetched from a model hub.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.run/genai-perf
if [ ! -x "$VENV/bin/genai-perf" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q genai-perf==0.0.16
fi
SHIM=$ROOT/.run/genai-perf-bin
mkdir -p "$SHIM"
ln -sf "$ROOT/loadtest/perf_analyzer.sh" "$SHIM/perf_analyzer"
export PATH="$SHIM:$PATH" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
ENDPOINT_TYPE=${ENDPOINT_TYPE:-kserve}
if [ "$ENDPOINT_TYPE" = kserve ]; then
  TARGET=(-m ensemble --endpoint-type kserve --backend tensorrtllm)
else  # the OpenAI-compatible API: -m its model name (GET /v1/models), -u its host:port
  TARGET=(--endpoint-type "$ENDPOINT_TYPE")
fi
exec "$VENV/bin/genai-perf" profile "${TARGET[@]}" \
  --streaming --tokenizer "$ROOT/models/smollm2-135m-instruct" \
  --synthetic-input-tokens-mean 64 --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean 64 --artifact-dir "$ROOT/results/genai-perf" "$@"
