#!/usr/bin/env bash
# The GPU suite: the equivalence tests in float32 and bfloat16 (tests/test_gpu.py), then the
# benchmark at GPU shapes (GPT-2 small at 16 x 1024 in float32 and bfloat16, GPT-2 medium's forward
# and caches in bfloat16). Needs torch with CUDA and transformers; transformer-lens is optional (the
# benchmark leaves its cases out, and says so, where it cannot be imported).
#
#   bash scripts/gpu_check.sh OUT_DIR
#   WHEELS=dir bash scripts/gpu_check.sh OUT_DIR   # a machine without internet: install these wheels first
#
# Each stage has a time limit (seconds: TESTS_S, F32_S, BF16_S, MEDIUM_S), so the whole takes about
# ten minutes at most; a stage cut short keeps what it finished (bench.partial.json).
set -uo pipefail
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    echo "gpu_check: $OUT exists and is not empty; give a new directory (earlier results are kept)" >&2
    exit 2
fi
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/probe-gpu-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/probe-gpu-site:${PYTHONPATH:-}
fi
export PYTHONPATH=$REPO:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: this torch sees no CUDA device; run it on a machine with a GPU" >&2
    exit 2
fi
mkdir -p "$OUT"
cd "$REPO" || exit 2
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1

timeout "${TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider tests/test_gpu.py \
    "tests/test_attribution.py::test_gpu_matches_cpu" 2>&1 | tee "$OUT/tests.log"
tests=${PIPESTATUS[0]}

bench() {  # seconds, out subdirectory, bench.py arguments...
    local limit=$1 dir=$2
    shift 2
    timeout "$limit" python3 scripts/bench.py --device cuda --repeats 3 --min-run-time 0.1 --batch 16 --seq 1024 \
        --workload-timeout 120 --out "$OUT/$dir" "$@" 2>&1 | tee "$OUT/$dir.log"
    pkill -f "bench.py --workload" 2>/dev/null  # a child the time limit orphaned
}
bench "${F32_S:-300}" float32 --dtype float32
bench "${BF16_S:-200}" bfloat16 --dtype bfloat16 --workloads 1,2,3,4,6,9
bench "${MEDIUM_S:-100}" medium-bfloat16 --dtype bfloat16 --shape medium --workloads 1,2,3
echo "gpu_check: tests exit $tests; results in $OUT" >&2
exit "$tests"
