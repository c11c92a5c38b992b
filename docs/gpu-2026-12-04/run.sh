#!/bin/bash
# One device call: install the carried server and clients, then build.gpu_check and the
# loop's overhead on CUDA. Everything is logged under $OUT.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD; shopt -s nullglob
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
PY=$(command -v python3); SITE=$($PY -c "import site;print(site.getsitepackages()[0])")
el env; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; nproc
$PY -m pip install -q --no-index --no-deps --no-compile --upgrade .gpu/whl/*.whl 2>&1 | tail -3
$PY -m pip uninstall -y -q scikit-learn 2>&1 | tail -1  # transformers imports it if present; it needs numpy 2, the pinned Python backend numpy 1
tar -xJf .gpu/pytriton.tar.xz -C "$SITE"
$PY -c "from transformers import AutoTokenizer, GenerationMixin" || exit 3
$PY -c "import numpy, grpc, google.protobuf as pb, tritonclient.grpc, torch, transformers; print(numpy.__version__, grpc.__version__, pb.__version__, torch.__version__, transformers.__version__, torch.cuda.is_available())"
$PY -c "import sysconfig;print('LIBDIR', sysconfig.get_config_var('LIBDIR'))"
LD_LIBRARY_PATH=$($PY -c "import sysconfig;print(sysconfig.get_config_var('LIBDIR'))") ldd "$SITE/pytriton/tritonserver/python_backend_stubs/3.12/triton_python_backend_stub" | grep -E "python|not found"
M=$PWD/models; mkdir -p "$M"
$PY -m build.tiny_checkpoint --out "$M/shaped-135m" --tokenizer-from .gpu/tok --shape-of .gpu/tok
$PY -m build.tiny_checkpoint --out "$M/tiny" --tokenizer-from .gpu/tok
mkdir -p "$M/smollm2-135m-instruct" && cp .gpu/tok/* "$M/smollm2-135m-instruct/"  # the bench tokenizes prompts with it
if [ -z "$SKIP_CHECK" ]; then el gpu_check
timeout 270 $PY -m build.gpu_check --out "$OUT/gpu_check.json" --target "$M/shaped-135m" --draft "$M/tiny" \
  --num-prompts 4 --max-tokens 64 --num-slots 16 --max-context 512 --streams 1,16 --skip-tensorrt > "$OUT/gpu_check.log" 2>&1
echo "gpu_check rc=$?"; tail -25 "$OUT/gpu_check.log"; fi
el bench-overhead
timeout 300 $PY loadtest/bench.py --name bench-overhead-h200 --out-dir "$OUT" --workloads chat \
  --modes k0,k4,k4-sampled,k0-si16,k4-si16,k0-again --concurrency 16,64,256 --level-seconds 8 --max-tokens 64 \
  --server-env "TARGET_CHECKPOINT=$M/tiny,DRAFT_CHECKPOINT=$M/tiny,NUM_SLOTS=256,MAX_CONTEXT=512,DTYPE=float32,DEVICE=cuda" > "$OUT/bench.log" 2>&1
echo "bench rc=$?"; tail -30 "$OUT/bench.log"
el logs; rm -f "$OUT"/*.png
mkdir -p "$OUT/logs"; for f in .run/gpu-check-cuda/server.log .run/bench*/server.log; do n=$(basename "$(dirname "$f")"); tail -c 3000000 "$f" > "$OUT/logs/$n.log"; done; ls -la "$OUT" "$OUT/logs"
el done
