#!/usr/bin/env bash
# The GPU checks (`make gpu-check`): the kernels and CUDA graphs compiled on a CUDA machine, the tile ladder
# of the batch-invariant products, then the target runtime's speed on random weights of real architectures
# (`specmesh bench --model random:...`), whose lossless and batch-invariance checks fail the run.
# Runs from the repository root without installing: a package shim maps `specmesh.kernels` to kernels/
# (PYTHONSAFEPATH keeps the un-mapped folder in the working directory off the import path).
# Results (JSON, logs) go to $OUT (default ./gpu-results). Exit 1 if any step failed.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
mkdir -p "$OUT" /tmp/specmesh-shim/specmesh
for entry in specmesh/*; do ln -sfn "$PWD/$entry" /tmp/specmesh-shim/specmesh/; done
ln -sfn "$PWD/kernels" /tmp/specmesh-shim/specmesh/kernels
ln -sfn "$PWD/services" /tmp/specmesh-shim/specmesh/services
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/specmesh-shim PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
failed=()
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider tests/test_paged_runtime.py >"$OUT/tests.txt" 2>&1 \
  || failed+=(tests)
tail -8 "$OUT/tests.txt"
if [ -z "${SKIP_TILES:-}" ]; then
  timeout 300 $PY -m specmesh.bench.invariant_tiles --model llama-3-8b --json "$OUT/tiles-llama-3-8b.json" \
    >"$OUT/tiles.txt" 2>&1 || failed+=(tiles)
  tail -4 "$OUT/tiles.txt"
fi
for model in ${MODELS:-llama-3-8b llama-3.2-1b qwen2.5-0.5b}; do
  timeout "${BENCH_TIMEOUT:-420}" $PY -m specmesh bench --model "random:$model" --device cuda --repeats "${REPEATS:-30}" \
    --json "$OUT/$model.json" >"$OUT/$model.txt" 2>&1 || failed+=("$model")
  grep -v -i warn "$OUT/$model.txt" | tail -14
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu-check passed"
