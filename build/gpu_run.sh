#!/bin/bash
# build/gpu_run.py on a lent GPU host, in two device calls to the same warm machine (what
# travels per call: build/gpu_pack.py). Reports and logs go to $OUT.
#   bash build/gpu_run.sh engines   # carry [".gpu/server"]: installs the server, runs step 1
#   bash build/gpu_run.sh served    # carry [".gpu/site"]: installs the clients, runs 2 and 3
# `served` alone on a fresh machine fails its steps (no server): step 1 still came back.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false PYTHONPATH=$PWD
OUT=${OUT:-results/gpu-run}; mkdir -p "$OUT"
PY=$(command -v python3); SITE=$($PY -c "import site; print(site.getsitepackages()[0])")
WORK=/tmp/gpu-run; mkdir -p "$WORK"
T0=$(date +%s); el() { echo "== $(( $(date +%s) - T0 )) s: $*"; }
case "$1" in
engines)
  el setup; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  tar -xJf .gpu/server/server.tar.xz -C "$SITE" || echo "no server files: the next call needs them"
  el engines
  timeout 150 $PY -m build.gpu_run --steps engines --out "$OUT/gpu_run_engines.json" --work-dir "$WORK"
  ;;
served)
  el setup
  # numpy<2 for the Python backend; transformers imports scikit-learn, built for numpy 2
  $PY -m pip uninstall -y -q numpy grpcio protobuf python-rapidjson tritonclient scikit-learn
  tar -xJf .gpu/site/site.tar.xz -C "$SITE" || exit 3
  mkdir -p "$WORK/tok" && tar -xJf .gpu/site/tok.tar.xz -C "$WORK/tok" || exit 3
  $PY -c "import numpy, grpc, tritonclient.grpc, torch, transformers, pytriton; print(numpy.__version__, grpc.__version__, torch.__version__, torch.cuda.is_available())" || exit 3
  el served
  timeout 270 $PY -m build.gpu_run --steps served,gpu_check --out "$OUT/gpu_run_served.json" \
    --work-dir "$WORK" --tokenizer "$WORK/tok"
  cp "$WORK"/*.log "$WORK"/gpu_check.json "$OUT"/ 2>/dev/null
  ;;
*) echo "usage: bash build/gpu_run.sh engines|served"; exit 2 ;;
esac
el done; ls -la "$OUT"
