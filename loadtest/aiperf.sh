#!/usr/bin/env bash
# AIPerf (PyPI 0.13.0, NVIDIA's successor to genai-perf) against this server: the
# OpenAI-compatible API (ENDPOINT_TYPE=chat, the default, or completions), or Triton's own
# HTTP generate extension on the ensemble (ENDPOINT_TYPE=triton: POST
# /v2/models/ensemble/generate_stream, TensorRT-LLM's input names; AIPerf's template
# endpoint writes the request and reads `text_output`). AIPerf speaks HTTP only, not
# Triton's gRPC (perf_analyzer and genai-perf do: loadtest/perf_analyzer.sh, genai_perf.sh).
#
#   loadtest/aiperf.sh -m smollm2-135m-instruct -u 127.0.0.1:9000 --concurrency 4 \
#     --request-count 16
#   ENDPOINT_TYPE=triton loadtest/aiperf.sh -u 127.0.0.1:8000 --concurrency 4 --request-count 16
#
# INPUT_TOKENS and OUTPUT_TOKENS (64 each) size the synthetic prompts and answers, and
# ARTIFACT_DIR (results/aiperf) takes the figures (AIPerf refuses an option given twice, so
# these are not flags here). Any other `aiperf profile` flag passes through.
#
# AIPerf lives in a venv of its own (.run/aiperf: its dependencies differ from the
# server's). The tokenizer is the local target checkpoint, so nothing is fetched from a
# model hub. Its figures: profile_export_aiperf.{json,csv}, every request in
# profile_export.jsonl.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$ROOT/.run/aiperf
if [ ! -x "$VENV/bin/aiperf" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q aiperf==0.13.0
fi
ENDPOINT_TYPE=${ENDPOINT_TYPE:-chat}
if [ "$ENDPOINT_TYPE" = triton ]; then
  # One JSON object per request; the generate extension makes each field a [1] tensor.
  TEMPLATE='{"text_input": {{ text|tojson }}, "max_tokens": {{ max_tokens }}, "stream": {{ stream|tojson }}}'
  EXTRA=$(python3 -c 'import json, sys; print(json.dumps({"payload_template": sys.argv[1], "response_field": "text_output"}))' "$TEMPLATE")
  TARGET=(-m ensemble --endpoint-type template --custom-endpoint /v2/models/ensemble/generate_stream
    --extra-inputs "$EXTRA")
else  # the OpenAI-compatible API: -m its model name (GET /v1/models), -u its host:port
  TARGET=(--endpoint-type "$ENDPOINT_TYPE")
fi
# AIPerf 0.13 in offline mode looks a local tokenizer path up as a hub repo and fails;
# online, a local folder loads from disk without a request.
unset HF_HUB_OFFLINE TRANSFORMERS_OFFLINE
exec "$VENV/bin/aiperf" profile "${TARGET[@]}" \
  --streaming --tokenizer "$ROOT/models/smollm2-135m-instruct" --ui none \
  --synthetic-input-tokens-mean "${INPUT_TOKENS:-64}" --synthetic-input-tokens-stddev 0 \
  --output-tokens-mean "${OUTPUT_TOKENS:-64}" --artifact-dir "${ARTIFACT_DIR:-$ROOT/results/aiperf}" "$@"
