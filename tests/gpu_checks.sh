#!/usr/bin/env bash
# The GPU checks (`make gpu-check`), made to fit one short GPU window: PROFILE=default (the GPU figures the
# open issues ask for, inside BUDGET_S, 480 s unless set) or PROFILE=long (every check, no budget).
#   default, in order: the 8B one-token step and trees against cuBLAS (`specmesh bench --model random:llama-3-8b`,
#   whose lossless and batch-invariance checks fail the run; the first figure), the 8B offloaded (its step against
#   the host-to-device link), the cluster offloaded with a wide oracle, two tensor-parallel ranks sharing the GPU
#   (gloo over GPU tensors: NCCL refuses two ranks on one GPU; NCCL itself where there are two) with speculative
#   == plain, then, with the time left, the whole cluster on the device with the oracle drafter at 1, 16 and 64
#   requests (fails when a speculative answer differs from plain). Limits: 90 + 90 + 120 + 90 + 240 s.
#   long adds, first: the kernels' and CUDA graphs' tests, the tile ladder of the batch-invariant products, an
#   EAGLE-3 head's cost per drafted token; last, the runtime on the other real architectures (MODELS=).
# Each check writes its log and JSON to $OUT (default ./gpu-results) as it ends, so a window that closes early
# keeps what ran; a check that would start with under 20 s left is skipped and named, one cut at its limit named
# too. SKIP_<NAME>=1 leaves one out (TESTS, TILES, HEAD, STEP, ORACLE, OFFLOAD, OFFLOAD_ORACLE, TP, MODELS).
# Runs from the repository root without installing: a package shim maps `specmesh.kernels` to kernels/
# (PYTHONSAFEPATH keeps the un-mapped folder in the working directory off the import path). What a stock CUDA
# image lacks comes as wheels in .whl/ (`make gpu-wheels` on any machine with pip's registry; carry `.whl`),
# installed here into /tmp/site ahead of the image's own. Exit 1 if a check failed, 3 if one was cut or left for lack
# of time.
# REHEARSE=1 runs the checks on this CPU with random:tiny and few repeats and tokens (the tile ladder and kernel tests
# left out: CUDA's), the same commands and arguments, so a broken check fails here (tests/test_gpu_checks.py), not
# in a window.
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-results}
PY=${PYTHON:-python3}
PROFILE=${PROFILE:-default}
if [ -n "${REHEARSE:-}" ]; then
  MODEL=tiny DEVICE=cpu SKIP_TILES=1 SKIP_TESTS=1  # CUDA's own (the suite runs the kernel tests interpreted)
  : "${REPEATS:=2}" "${OFFLOAD_REPEATS:=1}" "${ORACLE_TOKENS:=8}" "${ORACLE_ROUNDS:=1}" "${ORACLE_ACCEPTANCE:=0.8}"
  # EAGLE-3 reads layers tiny lacks; the models loop is the step check again
  : "${HEAD_REPEATS:=7}" "${HEAD_MODEL:=smollm2-135m}" "${MODELS=}"
else
  MODEL=llama-3-8b DEVICE=cuda
fi
case "$PROFILE" in
  default) BUDGET_S=${BUDGET_S:-480} ;;
  long) BUDGET_S=${BUDGET_S:-100000} ;;
  *) echo "PROFILE must be default or long, got $PROFILE" >&2; exit 2 ;;
esac
started=$(date +%s)
mkdir -p "$OUT" /tmp/specmesh-shim/specmesh
for entry in specmesh/*; do ln -sfn "$PWD/$entry" /tmp/specmesh-shim/specmesh/; done
ln -sfn "$PWD/kernels" /tmp/specmesh-shim/specmesh/kernels
ln -sfn "$PWD/services" /tmp/specmesh-shim/specmesh/services
site=""
if [ -z "${REHEARSE:-}" ] && compgen -G ".whl/*.whl" >/dev/null; then  # a rehearsal runs on this machine's packages
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu-check: installing .whl/ failed"; exit 1; }
  site=:/tmp/site
fi
export PYTHONSAFEPATH=1 PYTHONPATH=/tmp/specmesh-shim$site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 \
  TRITON_INTERPRET=0 HF_HUB_OFFLINE=1
failed=()
skipped=()
cut=()
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
$PY -c "import torch, triton, transformers, grpc, google.protobuf, pydantic; print('torch', torch.__version__, 'triton', \
triton.__version__, 'transformers', transformers.__version__, 'grpcio', grpc.__version__, 'protobuf', \
google.protobuf.__version__)" || { echo "gpu-check: the image lacks a package specmesh imports (make gpu-wheels)"; exit 1; }

# check NAME LIMIT_S SHOWN_LINES COMMAND...: run it within its limit and what is left of the budget
check() {
  local name=$1 limit=$2 shown=$3 left
  shift 3
  local skip="SKIP_${name^^}"
  skip=${skip//[.-]/_}
  [ -n "${!skip:-}" ] && return
  left=$((BUDGET_S - ($(date +%s) - started)))
  if [ "$left" -lt 20 ]; then skipped+=("$name"); return; fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at $(($(date +%s) - started)) s, up to $limit s)"
  timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
  case $? in
    0) ;;
    124) cut+=("$name") ;;  # what it wrote before its limit is kept
    *) failed+=("$name") ;;
  esac
  grep -v -i -E "warn|it/s|level/s" "$OUT/$name.txt" | tail -"$shown"
}

if [ "$PROFILE" = long ]; then
  check tests 300 8 $PY -m pytest -q -p no:cacheprovider tests/test_paged_runtime.py tests/test_tree_attention_kernel.py
  check tiles 300 4 $PY -m specmesh.bench.invariant_tiles --model llama-3-8b --json "$OUT/tiles-$MODEL.json"
  check head 300 10 $PY -m specmesh.bench.head_cost --model "random:${HEAD_MODEL:-$MODEL}" --device $DEVICE \
    --repeats "${HEAD_REPEATS:-40}" --json "$OUT/head-cost-${HEAD_MODEL:-$MODEL}.json"
fi
check step 90 16 $PY -m specmesh bench --model "random:$MODEL" --device $DEVICE --repeats "${REPEATS:-10}" \
  --json "$OUT/$MODEL.json"
check offload 90 8 $PY -m specmesh bench --model "random:$MODEL" --device $DEVICE --offload \
  --repeats "${OFFLOAD_REPEATS:-3}" --json "$OUT/offload-$MODEL.json"
check offload-oracle 120 10 $PY -m specmesh bench --model "random:$MODEL" --device $DEVICE --offload \
  --oracle-acceptance 0.8 --oracle-width 4 --concurrency 1 --max-tokens 32 --sweep-rounds 1 \
  --max-tree-nodes 1024 --fixed-tree-nodes 256 --json "$OUT/offload-oracle-$MODEL.json"
check tp 90 4 $PY -m pytest -q -p no:cacheprovider tests/test_tensor_parallel.py -k two_ranks_is_their_plain
# last, with what is left (at least ~90 s): each level is written to its JSON as it ends
check oracle 240 24 $PY -m specmesh bench --model "random:$MODEL" --device $DEVICE \
  --oracle-acceptance "${ORACLE_ACCEPTANCE:-0.8,0.6}" --concurrency 1,16,64 --max-tokens "${ORACLE_TOKENS:-64}" \
  --sweep-rounds "${ORACLE_ROUNDS:-2}" --json "$OUT/oracle-$MODEL.json"
if [ "$PROFILE" = long ] && [ -z "${SKIP_MODELS:-}" ]; then
  for model in ${MODELS-llama-3.2-1b qwen2.5-0.5b}; do
    check "$model" 420 14 $PY -m specmesh bench --model "random:$model" --device $DEVICE --repeats "${REPEATS:-30}" \
      --json "$OUT/$model.json"
  done
fi
echo "gpu-check ($PROFILE) took $(($(date +%s) - started)) s"
left_out="${cut:+; cut at its limit (what it wrote is kept): ${cut[*]}}${skipped:+; not run, out of time: ${skipped[*]}}"
if [ ${#failed[@]} -gt 0 ]; then
  echo "gpu-check FAILED: ${failed[*]}$left_out"
  exit 1
fi
if [ ${#skipped[@]} -gt 0 ] || [ ${#cut[@]} -gt 0 ]; then
  echo "gpu-check INCOMPLETE: what ran passed$left_out"
  exit 3
fi
echo "gpu-check passed"
