#!/usr/bin/env bash
# The GPU suite: the equivalence tests in float32 and bfloat16 (tests/test_gpu.py), then the
# benchmark at GPU shapes (GPT-2 small at 16 x 1024 in float32 and bfloat16, GPT-2 medium's forward
# and caches in bfloat16). Needs torch with CUDA and transformers; transformer-lens is optional (the
# benchmark leaves its cases out, and says so, where it cannot be imported).
#
#   bash scripts/gpu_check.sh OUT_DIR
#   WHEELS=dir bash scripts/gpu_check.sh OUT_DIR      # a machine without internet: install these wheels first
#   STAGES="float32 bfloat16" F32_WORKLOADS=2,11 bash scripts/gpu_check.sh OUT_DIR   # only what is missing
#   GPU_CHECK_DEVICE=cpu TESTS_K=tiny bash scripts/gpu_check.sh OUT_DIR   # the same stages on the CPU at tiny
#                                                                         # shapes: checks this script itself
#
# Stages, in order (STAGES, default all four): tests, float32, bfloat16, medium. Workloads per
# benchmark stage: F32_WORKLOADS, BF16_WORKLOADS (default all), MEDIUM_WORKLOADS (default 1,2,3).
# On an H200 a benchmark workload takes 15-30 s (most of it starting its process), so all four stages
# take about twelve minutes: more than one 10-minute call. TOTAL_S (default 540) caps the whole run;
# each stage also has its own cap (TESTS_S, F32_S, BF16_S, MEDIUM_S) and gets no more than is left;
# WORKLOAD_TIMEOUT_S (default 120) caps each benchmark workload (workload 23 compiles twice: give it more).
# A stage cut short keeps what it finished (bench.partial.json); OUT_DIR/stages.txt says, per stage,
# whether it finished, failed, was cut short or did not start. Exit 0 only when every stage finished
# and passed.
set -uo pipefail
OUT=${1:?usage: bash scripts/gpu_check.sh OUT_DIR}
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEVICE=${GPU_CHECK_DEVICE:-cuda}
STAGES=${STAGES:-tests float32 bfloat16 medium}
case $DEVICE in
    cuda) BENCH_SHAPES=(--device cuda --repeats 3 --min-run-time 0.1 --batch 16 --seq 1024); MEDIUM_SHAPE=medium ;;
    cpu) BENCH_SHAPES=(--device cpu --quick); MEDIUM_SHAPE=tiny ;;  # medium would be a 355M-parameter build
    *) echo "gpu_check: GPU_CHECK_DEVICE=$DEVICE; use cuda (the default) or cpu (a check of this script)" >&2; exit 2 ;;
esac
for stage in $STAGES; do
    case $stage in tests|float32|bfloat16|medium) ;;
        *) echo "gpu_check: unknown stage '$stage' in STAGES; choose from: tests float32 bfloat16 medium" >&2; exit 2 ;;
    esac
done
if [ -e "$OUT" ] && [ -n "$(ls -A "$OUT" 2>/dev/null)" ]; then
    echo "gpu_check: $OUT exists and is not empty; give a new directory (earlier results are kept)" >&2
    exit 2
fi
if [ -n "${WHEELS:-}" ]; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/probe-gpu-site "$WHEELS"/*.whl || exit 2
    export PYTHONPATH=/tmp/probe-gpu-site:${PYTHONPATH:-}
fi
# This checkout's code under the names the distribution installs it with (probe, probe.hooks, probe.analyses,
# probe.cli; see pyproject.toml's package-dir), without installing anything: a tree of links in a temp directory.
SOURCE=$(mktemp -d /tmp/probe-gpu-source.XXXXXX) || exit 2
mkdir "$SOURCE/probe" || exit 2
for entry in "$REPO"/probe/*; do ln -s "$entry" "$SOURCE/probe/$(basename "$entry")" || exit 2; done
ln -s "$REPO/hooks" "$SOURCE/probe/hooks" && ln -s "$REPO/analyses" "$SOURCE/probe/analyses" \
    && ln -s "$REPO/scripts" "$SOURCE/probe/cli" || exit 2
export PYTHONPATH=$SOURCE:${PYTHONPATH:-} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
if [ "$DEVICE" = cuda ] && ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: this torch sees no CUDA device; run it on a machine with a GPU (or GPU_CHECK_DEVICE=cpu)" >&2
    exit 2
fi
mkdir -p "$OUT"
cd "$REPO" || exit 2
if [ "$DEVICE" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
fi

deadline=$((SECONDS + ${TOTAL_S:-540}))
all_ok=1
record() {  # stage, outcome
    echo "$1: $2" | tee -a "$OUT/stages.txt" >&2
    [ "$2" = finished ] || all_ok=0
}
limit_for() {  # the stage's own cap, or what is left of TOTAL_S if less
    local left=$((deadline - SECONDS))
    echo $(( $1 < left ? $1 : left ))
}
outcome() {  # exit status of a time-limited command -> what stages.txt says
    case $1 in 0) echo finished ;; 124|137) echo "cut short by its time limit" ;; *) echo "failed (exit $1)" ;; esac
}
run_stage() {  # stage, own cap in seconds, command...
    local stage=$1 limit
    limit=$(limit_for "$2")
    shift 2
    if [ "$limit" -lt 30 ]; then
        record "$stage" "not started: under 30 s of TOTAL_S left"
        return
    fi
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$stage.log"
    local status=${PIPESTATUS[0]}
    pkill -f "$REPO/scripts/bench.py --workload" 2>/dev/null  # a child the time limit orphaned
    record "$stage" "$(outcome "$status")"
}

bench_stage() {  # stage, own cap, out subdirectory, dtype, workloads, more bench.py arguments...
    local stage=$1 cap=$2 dir=$3 dtype=$4 workloads=$5
    shift 5
    run_stage "$stage" "$cap" python3 scripts/bench.py "${BENCH_SHAPES[@]}" --workload-timeout "${WORKLOAD_TIMEOUT_S:-120}" \
        --out "$OUT/$dir" --dtype "$dtype" --workloads "$workloads" "$@"
}

for stage in $STAGES; do
    case $stage in
        tests)
            # the GPU-against-CPU tests honour PROBE_TEST_DEVICE; CUDA graphs exist on CUDA only
            tests=(tests/test_gpu.py "tests/test_attribution.py::test_gpu_matches_cpu"
                "tests/test_circuit.py::test_scores_and_circuits_are_the_same_on_the_gpu"
                "tests/test_qwen35.py::test_the_hybrid_on_the_device_is_transformers_there"
                "tests/test_state_space.py::test_the_state_space_model_on_the_device_is_transformers_there"
                "tests/test_falcon_h1.py::test_the_parallel_hybrid_on_the_device_is_transformers_there"
                "tests/test_lfm2.py::test_the_hybrid_on_the_device_is_transformers_there"
                "tests/test_rwkv.py::test_the_model_on_the_device_is_transformers_there"
                "tests/test_recurrent_gemma.py::test_the_hybrid_on_the_device_is_transformers_there"
                "tests/test_olmo_hybrid.py::test_the_hybrid_on_the_device_is_transformers_there"
                "tests/test_nemotron_h.py::test_the_model_on_the_device_is_transformers_there"
                "tests/test_zamba2.py::test_the_model_on_the_device_is_transformers_there"
                "tests/test_modernbert_decoder.py::test_the_model_on_the_device_is_transformers_there"
                "tests/test_latent_attention.py::test_the_latent_model_on_the_device_is_transformers_there"
                "tests/test_glm_moe_dsa.py::test_the_sparse_model_on_the_device_is_transformers_there"
                "tests/test_gemma4.py::test_gemma4_on_the_device_is_transformers_there"
                "tests/test_llama4.py::test_llama4_on_the_device_is_transformers_there"
                "tests/test_nanochat.py::test_nanochat_on_the_device_is_transformers_there"
                "tests/test_bitnet.py::test_bitnet_on_the_device_is_transformers_there"
                "tests/test_jamba.py::test_jamba_on_the_device_is_transformers_there"
                "tests/test_jetmoe.py::test_on_the_device_is_transformers_there"
                "tests/test_laguna.py::test_laguna_on_the_device_is_transformers_there"
                "tests/test_phimoe.py::test_longrope_on_the_device_is_transformers_there")
            [ "$DEVICE" = cuda ] && tests+=(
                "tests/test_compiled.py::test_cuda_graph_forwards_equal_eager_and_outlive_the_next_replay")
            PROBE_TEST_DEVICE=$DEVICE run_stage tests "${TESTS_S:-240}" \
                python3 -m pytest -q -p no:cacheprovider ${TESTS_K:+-k "$TESTS_K"} "${tests[@]}" ;;
        float32) bench_stage float32 "${F32_S:-300}" float32 float32 "${F32_WORKLOADS:-all}" ;;
        bfloat16) bench_stage bfloat16 "${BF16_S:-300}" bfloat16 bfloat16 "${BF16_WORKLOADS:-all}" ;;
        medium) bench_stage medium "${MEDIUM_S:-120}" medium-bfloat16 bfloat16 "${MEDIUM_WORKLOADS:-1,2,3}" \
                    --shape "$MEDIUM_SHAPE" ;;
    esac
done
echo "gpu_check: results in $OUT (stages.txt says what finished)" >&2
[ "$all_ok" = 1 ]
