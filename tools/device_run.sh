#!/usr/bin/env bash
# One prepared run on a lent GPU machine (its own python3: torch, triton, transformers,
# peft; no network): install the carried wheels (.whl/, from tools/gpu_wheels.sh), then
# `make gpu-check` and `make gpu-bench`, each under a time limit, writing their JSON and
# logs into ${OUT:-out}. Called from the repository root, e.g. through the device tool:
#   run(command="tools/device_run.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
date -u | tee -a "$OUT/card.txt"
timeout "${GPU_CHECK_S:-200}" python3 -m raycolo.engine.gpu_check --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
timeout "${GPU_BENCH_S:-330}" python3 bench/gpu_realsize.py --json "$OUT/gpu_realsize.json" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_realsize.log"
