#!/usr/bin/env bash
# The `build` service: the checkpoints and their engines, into the mounted volumes.
#
# With the default pair (TARGET_CHECKPOINT unset) it first prepares models/ as `make models`
# does (SmolLM2-135M-Instruct from its GGUF, the committed draft). Then, by ENGINE:
# onnxruntime exports both checkpoints to ONNX (.run/engines/<name>/onnx-float32); tensorrt
# compiles plans in DTYPE (auto: bfloat16 where the GPU has it, else float16) for NUM_SLOTS x
# MAX_CONTEXT (.run/engines/<name>/tensorrt-<dtype>), the dtype the server asks for;
# torch reads the checkpoints as they are.
# Existing, current engines are kept, so a second `docker compose up` starts at once.
set -euo pipefail
cd "$(dirname "$0")/.."
TARGET=${TARGET_CHECKPOINT:-models/smollm2-135m-instruct}
DRAFT=${DRAFT_CHECKPOINT:-models/smollm2-135m-draft}
if [ -z "${TARGET_CHECKPOINT:-}" ]; then
  python3 -m build.prepare_models --models-dir models
fi
for checkpoint in "$TARGET" "$DRAFT"; do
  if [ ! -e "$checkpoint" ]; then
    echo "checkpoint $checkpoint not found: mount it under models/ (MODELS_DIR)" >&2
    exit 1
  fi
done
case "${ENGINE:-torch}" in
  onnxruntime) python3 -m build.export_onnx "$TARGET" "$DRAFT" ;;
  tensorrt) python3 -m build.build_trt "$TARGET" "$DRAFT" \
    --num-slots "${NUM_SLOTS:-64}" --max-context "${MAX_CONTEXT:-2048}" --dtype "${DTYPE:-auto}" ;;
  *) echo "engine ${ENGINE:-torch}: reads the checkpoints directly, nothing to build" ;;
esac
