#!/usr/bin/env bash
# The GPU checks (`make gpu-check`): the kernels and CUDA graphs compiled on a CUDA machine, the tile ladder
# of the batch-invariant products, an EAGLE-3 head's cost per drafted token on the 8B shape (its greedy
# check fails the run), the target runtime's speed on random weights of real architectures (`specmesh bench
# --model random:...`), whose lossless and batch-invariance checks fail the run, then the whole cluster on
# the device with the oracle drafter (`--oracle-acceptance`), which fails the run when a speculative answer
# differs from plain decoding, and the 8B offloaded (layers streamed from host memory: its step against the
# host-to-device link, trees of 256 and 1,024 nodes; then the cluster offloaded with a wide oracle, where trees
# of hundreds of nodes pay). SKIP_TESTS, SKIP_TILES, SKIP_HEAD, SKIP_ORACLE, SKIP_OFFLOAD, SKIP_OFFLOAD_ORACLE
# and MODELS= narrow it (offload alone: SKIP_TESTS=1 SKIP_TILES=1 SKIP_HEAD=1 SKIP_ORACLE=1 MODELS=).
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
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/specmesh-shim${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
failed=()
nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout "${TEST_TIMEOUT:-300}" $PY -m pytest -q -p no:cacheprovider tests/test_paged_runtime.py tests/test_tree_attention_kernel.py >"$OUT/tests.txt" 2>&1 \
    || failed+=(tests)
  tail -8 "$OUT/tests.txt"
fi
if [ -z "${SKIP_TILES:-}" ]; then
  timeout 300 $PY -m specmesh.bench.invariant_tiles --model llama-3-8b --json "$OUT/tiles-llama-3-8b.json" \
    >"$OUT/tiles.txt" 2>&1 || failed+=(tiles)
  tail -4 "$OUT/tiles.txt"
fi
if [ -z "${SKIP_HEAD:-}" ]; then
  timeout 300 $PY -m specmesh.bench.head_cost --model random:llama-3-8b --device cuda \
    --json "$OUT/head-cost-llama-3-8b.json" >"$OUT/head-cost.txt" 2>&1 || failed+=(head-cost)
  grep -v -i warn "$OUT/head-cost.txt" | tail -10
fi
for model in ${MODELS-llama-3-8b llama-3.2-1b qwen2.5-0.5b}; do
  timeout "${BENCH_TIMEOUT:-420}" $PY -m specmesh bench --model "random:$model" --device cuda --repeats "${REPEATS:-30}" \
    --json "$OUT/$model.json" >"$OUT/$model.txt" 2>&1 || failed+=("$model")
  grep -v -i warn "$OUT/$model.txt" | tail -14
done
if [ -z "${SKIP_ORACLE:-}" ]; then
  timeout "${ORACLE_TIMEOUT:-540}" $PY -m specmesh bench --model random:llama-3-8b --device cuda \
    --oracle-acceptance "${ORACLE_ACCEPTANCE:-0.8,0.6}" --concurrency 1,16,64 --max-tokens "${ORACLE_TOKENS:-64}" \
    --json "$OUT/oracle-llama-3-8b.json" >"$OUT/oracle.txt" 2>&1 || failed+=(oracle)
  grep -v -i -E "warn|it/s|level/s" "$OUT/oracle.txt" | tail -24
fi
if [ -z "${SKIP_OFFLOAD:-}" ]; then
  timeout "${OFFLOAD_TIMEOUT:-420}" $PY -m specmesh bench --model random:llama-3-8b --device cuda --offload \
    --repeats "${OFFLOAD_REPEATS:-5}" --json "$OUT/offload-llama-3-8b.json" >"$OUT/offload.txt" 2>&1 || failed+=(offload)
  grep -v -i warn "$OUT/offload.txt" | tail -10
  if [ -z "${SKIP_OFFLOAD_ORACLE:-}" ]; then
    timeout "${OFFLOAD_ORACLE_TIMEOUT:-540}" $PY -m specmesh bench --model random:llama-3-8b --device cuda --offload \
      --oracle-acceptance 0.8 --oracle-width 4 --concurrency 1 --max-tokens 32 --sweep-rounds 1 \
      --max-tree-nodes 1024 --fixed-tree-nodes 256 --json "$OUT/offload-oracle-llama-3-8b.json" \
      >"$OUT/offload-oracle.txt" 2>&1 || failed+=(offload-oracle)
    grep -v -i -E "warn|it/s|level/s" "$OUT/offload-oracle.txt" | tail -10
  fi
fi
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check FAILED: ${failed[*]}"
  exit 1
fi
echo "gpu-check passed"
