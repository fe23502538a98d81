#!/usr/bin/env bash
# Before a GPU lease, on the CPU: does what tools/device_run.sh runs work on the lent
# machines' own library versions? They run their python3 (torch 2.11.0+cu130, transformers
# 5.17.0, peft 0.21.0, triton 3.6.0, no Ray: docs/benchmarks.md, "Machines"), not .venv
# (torch 2.13, a newer transformers). This builds a venv of those versions (torch from
# PyPI with its CUDA libraries, about 3 GB; reused on a second run) and runs, without Ray:
#   1. python -m raycolo.gpu_check --device cpu, then again under TRITON_INTERPRET=1
#      (the Triton kernels through triton 3.6's interpreter)
#   2. bench/gpu_realsize.py's dry run (tiny shape) and bench/realsize_checkpoint.py
#   3. tools/device_run.sh PHASES=profile's dry run (profile + validate --batches)
#   4. pytest tests/engine and the stage tests (every test that needs no Ray)
# numpy stays below 2.3 there: triton 3.6's interpreter converts 1-element arrays with
# int(), which numpy 2.3+ refuses; the compiled kernels on a GPU never go through it.
# Usage: tools/gpu_stack_check.sh   (GPU_STACK_VENV=dir to place the venv elsewhere)
set -euo pipefail
cd "$(dirname "$0")/.."
V="${GPU_STACK_VENV:-/tmp/raycolo-gpu-stack}"
TMP="$(mktemp -d)"
[ -x "$V/bin/python" ] || python3 -m venv "$V"
"$V/bin/pip" install -q --disable-pip-version-check torch==2.11.0 transformers==5.17.0 peft==0.21.0 \
  safetensors "numpy<2.3" pandas pyarrow pydantic pytest hypothesis
PY="$V/bin/python"
export PYTHONPATH=. PYTHONUNBUFFERED=1
"$PY" -c "import torch, transformers, peft, triton; print('stack: torch', torch.__version__, '| transformers',
transformers.__version__, '| peft', peft.__version__, '| triton', triton.__version__)"
step() { echo; echo "== $*"; }
step "gpu_check --device cpu"
"$PY" -m raycolo.gpu_check --device cpu | tail -1
step "gpu_check --device cpu, TRITON_INTERPRET=1"
TRITON_INTERPRET=1 "$PY" -m raycolo.gpu_check --device cpu | grep -E "^executor.triton|rows passed"
step "bench/gpu_realsize.py dry run"
"$PY" bench/gpu_realsize.py --shapes tiny --device cpu --dtype float32 --batches 1,4 --prompt 32 --output 8 \
  --eager-output 4 --stage-steps 4 --train-rows 2 | tail -3
step "bench/realsize_checkpoint.py + PHASES=profile tools/device_run.sh dry run"
"$PY" bench/realsize_checkpoint.py --shape tiny --out "$TMP/ckpt" --device cpu --dtype float32 | tail -1
OUT="$TMP/device" PROFILES="$TMP/profiles" PATH="$V/bin:$PATH" CKPT="$TMP/ckpt" PROFILE_NAME=tiny-llama-s DEVICE=cpu PROFILE_ARGS=--quick \
  BATCHES=1,8 VALIDATE_ARGS="--prompt-len 64 --output-len 16" PHASES=profile tools/device_run.sh | grep "^MAPE"
step "pytest: the engine and stage tests that need no Ray"
TRITON_INTERPRET=1 "$PY" -m pytest -q -p no:cacheprovider tests/engine tests/online/test_stage.py \
  tests/online/test_stage_rules.py tests/online/test_row_versions.py -k "not vllm_engine_actor" | tail -1
rm -rf "$TMP"
