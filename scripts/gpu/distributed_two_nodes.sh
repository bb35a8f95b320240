#!/usr/bin/env bash
# Ray placement over two machines, in one go per machine: node 0 is the Ray head and runs the
# check (the fsdp ranks PACK onto node 0's GPUs first, the engines take the rest); node 1 joins.
#
#   node 1 (first):  bash scripts/gpu/distributed_two_nodes.sh worker HEAD_IP [PORT]   # waits for the head
#   node 0:          bash scripts/gpu/distributed_two_nodes.sh head OUT_DIR [PORT]
#   node 1 (after):  bash scripts/gpu/distributed_two_nodes.sh stop
#
# The head starts Ray, waits until a second node joined, runs scripts/gpu/distributed_check.py with
# node 0's GPUs as fsdp ranks and as many engines as node 1 has GPUs (NCCL pushes across the
# machines), writes OUT_DIR/two_nodes.json and stops its own Ray processes. Both machines need the
# same Python environment and this repository at the same path (SKIP_INSTALL=1 skips pip), and must
# reach each other (set NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME if the default interface is wrong).
set -euo pipefail
cd "$(dirname "$0")/../.."
ROLE=${1:?usage: distributed_two_nodes.sh head OUT_DIR [PORT] | worker HEAD_IP [PORT] | stop}
export TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
ID_FILE=/tmp/skyrl-gpu-two-nodes.id
install() {
    if [ "${SKIP_INSTALL:-0}" != 1 ]; then
        python -m pip install -q -e ".[all]" -e plugins/skyrl-sdk-ray -e "plugins/skyrl-sdk-fsdp[ray]" \
            -e "plugins/skyrl-sdk-vllm[gpu,ray]"
    fi
}
GPUS() { python -c "import torch; print(torch.cuda.device_count())"; }
case "$ROLE" in
    worker)
        HEAD=${2:?HEAD_IP}; PORT=${3:-6390}; install
        ID="skyrl-gpu-worker-$$"; echo "$ID" > "$ID_FILE"
        until SKYRL_RAY_LOCAL_CLUSTER=$ID ray start --address "$HEAD:$PORT" --num-gpus "$(GPUS)" \
                --disable-usage-stats; do
            echo "waiting for the head at $HEAD:$PORT"; sleep 10
        done
        echo "joined; stop this node's Ray processes afterwards with: $0 stop" ;;
    stop)
        python -m skyrl_sdk_ray.local_cluster stop "$(cat "$ID_FILE")" ;;
    head)
        OUT=${2:?OUT_DIR}; PORT=${3:-6390}; mkdir -p "$OUT"; install
        ID="skyrl-gpu-head-$$"
        HEAD_IP=$(hostname -I | awk '{print $1}')
        SKYRL_RAY_LOCAL_CLUSTER=$ID ray start --head --node-ip-address "$HEAD_IP" --port "$PORT" --num-gpus "$(GPUS)" \
            --include-dashboard false --disable-usage-stats > "$OUT/ray_start.log" 2>&1
        trap 'python -m skyrl_sdk_ray.local_cluster stop "$ID" >> "$OUT/ray_start.log" 2>&1 || true' EXIT
        export RAY_ADDRESS="$HEAD_IP:$PORT"
        echo "head at $RAY_ADDRESS: start the worker with: $0 worker $HEAD_IP $PORT"
        python - <<'PY'
import time, ray
ray.init()
while len([n for n in ray.nodes() if n["Alive"]]) < 2:
    time.sleep(5)
print("nodes:", [(n["NodeManagerAddress"], n["Resources"].get("GPU", 0)) for n in ray.nodes() if n["Alive"]])
PY
        MINE=$(GPUS)
        TOTAL=$(python -c "import ray; ray.init(); print(int(ray.cluster_resources().get('GPU', 0)))")
        python scripts/gpu/distributed_check.py --world-size "$MINE" --engines $((TOTAL - MINE)) \
            --out "$OUT/two_nodes.json" 2> "$OUT/two_nodes.log"
        echo "results in $OUT" ;;
    *) echo "unknown role $ROLE" >&2; exit 2 ;;
esac
