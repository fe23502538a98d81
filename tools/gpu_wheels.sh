#!/usr/bin/env bash
# Wheels the lent GPU machines lack (they have torch, triton, transformers, peft, but not
# pydantic, nor nvidia-ml-py for gpu_check's NVML row): downloaded here for CPython 3.12
# x86-64 into .whl/ (git-ignored), to be carried to the device and installed there with
# --no-index (docs/benchmarks.md, "Real-size models on one GPU"). Versions: the ones this
# checkout's .venv resolved, else the newest.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
version() { [ -x .venv/bin/python ] && .venv/bin/python -c "import importlib.metadata as m; print('==' + m.version('$1'))" 2>/dev/null || true; }
# typing_extensions too: pydantic_core needs a recent one, and the machines' version is not known
for pkg in pydantic pydantic_core annotated_types typing_inspection typing_extensions nvidia_ml_py; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "$pkg$(version "${pkg//_/-}")"
done
ls .whl
