#!/usr/bin/env bash
# One prepared run on a lent GPU machine (its own python3: torch, triton, transformers,
# peft; no network): install the carried wheels (.whl/, from tools/gpu_wheels.sh), then the
# phases in $PHASES (default "check bench"), each under a time limit, writing their JSON
# and logs into ${OUT:-out}:
#   check    what make gpu-check runs (every CUDA path against its reference), under the
#            machine's python3 (make's targets would build .venv, which needs a network)
#   bench    what make gpu-bench runs (real-size decode, prefill and LoRA against the card's
#            limits)
#   profile  a random Llama-3-8B-shaped checkpoint on local disk, `raycolo profile` of it
#            as llama-3-8b-instruct, then `raycolo validate --batches 1,16,64,256` of it
#            against that profile (the cost model's GPU check); the profile comes back as
#            $OUT/profiles.tgz (one file: the device tool returns at most 8)
# Called from the repository root, e.g. through the device tool (one call fits 600 s):
#   run(command="tools/device_run.sh", carry=[".whl"], timeout_s=600)
#   run(command="PHASES=profile tools/device_run.sh", carry=[".whl"], timeout_s=600)
set -uo pipefail
OUT="${OUT:-out}"
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}"
# without pydantic every phase fails on its first import: stop before the card's minutes go
python3 -c "import pydantic" 2>/dev/null || { echo "error: pydantic is missing: run tools/gpu_wheels.sh here and carry .whl" | tee "$OUT/error.txt"; exit 3; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/card.txt"
date -u | tee -a "$OUT/card.txt"
PHASES=" ${PHASES:-check bench} "
if [[ "$PHASES" == *" check "* ]]; then
  timeout -k 10 "${GPU_CHECK_S:-200}" python3 -m raycolo.gpu_check --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
fi
if [[ "$PHASES" == *" bench "* ]]; then
  # --time-limit: the script skips its optional rows rather than be cut off by the limit
  GPU_BENCH_S="${GPU_BENCH_S:-330}"
  timeout -k 10 "$GPU_BENCH_S" python3 bench/gpu_realsize.py --json "$OUT/gpu_realsize.json" \
    --time-limit "$(( GPU_BENCH_S - 15 ))" ${GPU_BENCH_ARGS:-} 2>&1 | tee "$OUT/gpu_realsize.log"
fi
if [[ "$PHASES" == *" profile "* ]]; then
  # a dry run on a CPU: CKPT=<a tiny-llama-s checkpoint> PROFILE_NAME=tiny-llama-s DEVICE=cpu
  #   PROFILE_ARGS=--quick BATCHES=1,8 VALIDATE_ARGS="--prompt-len 64 --output-len 16"
  CKPT="${CKPT:-/tmp/raycolo-llama3-8b}"
  NAME="${PROFILE_NAME:-llama-3-8b-instruct}"
  DEVICE="${DEVICE:-cuda}"
  PROFILES="${PROFILES:-/tmp/raycolo-profiles}"
  # limits 120 + 300 + 150 s: each a cap on a hung step (expected about 30, 200 and 70 s)
  [ -f "$CKPT/config.json" ] || timeout -k 10 "${CKPT_S:-120}" python3 bench/realsize_checkpoint.py --shape llama3-8b --out "$CKPT" 2>&1 | tee "$OUT/checkpoint.log"
  timeout -k 10 "${PROFILE_S:-300}" python3 -m raycolo.cli profile --model "$CKPT" --name "$NAME" --device "$DEVICE" \
    --out "$PROFILES" ${PROFILE_ARGS:-} 2>&1 | tee "$OUT/profile.log"
  tar czf "$OUT/profiles.tgz" -C "$(dirname "$PROFILES")" "$(basename "$PROFILES")"
  timeout -k 10 "${VALIDATE_S:-150}" python3 -m raycolo.cli validate --profile "$PROFILES" --models "$CKPT" --name "$NAME" \
    --device "$DEVICE" --batches "${BATCHES:-1,16,64,256}" --repeats 1 ${VALIDATE_ARGS:-} --json \
    > "$OUT/validate.json" 2> "$OUT/validate.log"
  python3 -c "import json,sys; from raycolo.offline.calibration import format_report; print(format_report(json.load(open(sys.argv[1]))))" \
    "$OUT/validate.json" 2>&1 | tee -a "$OUT/validate.log"
fi
