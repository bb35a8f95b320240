#!/usr/bin/env bash
# Ray placement on one machine with N GPUs, in one go: the fsdp ranks and the vLLM engines as Ray
# actors on a Ray cluster this script starts (and stops, by the pids of its own processes), weights
# pushed through vLLM's weight-transfer API. JSON results and logs go to OUT_DIR.
#
#   bash scripts/gpu/distributed_one_node.sh OUT_DIR [split|colocated|all]     # default: all
#
#   split:      N/2 GPUs train (fsdp), N/2 run engines (one GPU each; NCCL pushes from rank 0);
#               with 4 GPUs or more also 2 engines of tensor parallel 2 (needs N >= 2)
#   colocated:  N ranks and N engines share the N GPUs (sleep level 1; gloo pushes through host memory)
#
# Needs: CUDA GPUs, the packages installed (SKIP_INSTALL=1 skips pip). A mode that needs more GPUs
# than the machine has is reported as not run (status 0 for it), never silently.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:?usage: distributed_one_node.sh OUT_DIR [split|colocated|all]}
MODE=${2:-all}
mkdir -p "$OUT"
export TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python -m pip install -q -e ".[all]" -e plugins/skyrl-sdk-ray -e "plugins/skyrl-sdk-fsdp[ray]" \
        -e "plugins/skyrl-sdk-vllm[gpu,ray]" 2>&1 | tee "$OUT/install.log"
fi
GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $GPUS" | tee "$OUT/environment.txt"
ID="skyrl-gpu-$$"
PORT=${RAY_PORT:-6390}
IP=$(hostname -I | awk '{print $1}')
SKYRL_RAY_LOCAL_CLUSTER=$ID ray start --head --node-ip-address "$IP" --port "$PORT" --num-gpus "$GPUS" \
    --include-dashboard false --disable-usage-stats > "$OUT/ray_start.log" 2>&1
trap 'python -m skyrl_sdk_ray.local_cluster stop "$ID" >> "$OUT/ray_start.log" 2>&1 || true' EXIT
export RAY_ADDRESS="$IP:$PORT"
status=0
run() {  # name, then the check's arguments
    local name=$1; shift
    echo "== $name: $*"
    python scripts/gpu/distributed_check.py "$@" --out "$OUT/$name.json" 2> "$OUT/$name.log" || status=1
    tail -n 1 "$OUT/$name.log" || true
}
if [ "$MODE" = split ] || [ "$MODE" = all ]; then
    if [ "$GPUS" -ge 2 ]; then
        HALF=$((GPUS / 2))
        run split --world-size "$HALF" --engines "$HALF"
        if [ "$GPUS" -ge 4 ]; then run split_tp2 --world-size "$HALF" --engines $((HALF / 2)) --tp 2; fi
    else
        echo "== split: not run (needs 2 GPUs or more; this machine has $GPUS)" | tee "$OUT/split.not_run"
    fi
fi
if [ "$MODE" = colocated ] || [ "$MODE" = all ]; then
    run colocated --world-size "$GPUS" --engines "$GPUS" --colocate
fi
echo "results in $OUT (status $status)"
exit $status
