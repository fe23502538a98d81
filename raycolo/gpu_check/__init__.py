"""GPU readiness: run every raycolo path that has a CUDA branch, against independent references.

``make gpu-check`` (or ``python -m raycolo.gpu_check``; ``python -m raycolo.engine.gpu_check``,
the old spelling, still works) prints one row per path::

    path | result | figures

Each check does real work on the device and compares it with a reference that does not
use the code under test: transformers' own ``forward``/``generate()`` on CPU in float64
(the same seeded tiny model, built in code: nothing is downloaded), peft's own training
step, and for NVML the CUDA driver's own memory figures. Rows:

* ``executor.whole``     ModelExecutor, whole model (torch attention path, SDPA on CUDA), float64
* ``executor.slices``    two chained layer slices (hidden states between them), float64
* ``executor.windows``   Qwen2 (q/k/v biases, per-layer windows) and Mistral (sliding window)
* ``executor.decode``    float32 decode timing, batch 1 and a larger batch: ms/step, tok/s,
                         logits diff and greedy agreement (a mismatch only at a near-tie)
* ``torch_engine``       TorchEngine on the device: continuous batching, sleep/wake_up
* ``sampler``            24 decode steps of mixed rows (penalties, top-k/top-p, min-p, logit
                         bias, draws) sampled on the device with the penalty history kept
                         there, against the CPU with it built afresh; on a GPU, a step's ms
                         at batch 256 over Llama 3's vocabulary, history kept and afresh
* ``stage.inproc``       StageModel slices with LoRA: serving tokens, a pipelined training
                         step's losses and LoRA weights against peft's unsplit step
* ``stage.p2p``          two stage processes running online/stages/stage_process.StageProcess over a
                         real process group: NCCL with 2+ GPUs (one GPU each), gloo on one
                         GPU (NCCL refuses two ranks on one device) or on CPU
* ``device_stats``       raycolo/engine/device_stats.py: NVML figures against
                         ``torch.cuda.mem_get_info`` and a known allocation
* ``vllm``               the vllm backend, where ``import vllm`` works on this platform

* ``executor.graphs``    decode steps replayed as CUDA graphs (executor/graphs.py): float64
                         tokens vs generate(), whole and sliced; float32 ms/step eager vs graphs

* ``executor.triton``    the Triton paged attention kernel against dense float64 attention
                         (decode with split-K, prefill tiles, a window; float32 and bfloat16),
                         then a float32 executor on it with CUDA graphs, teacher-forced vs
                         transformers (SKIP without triton, or on the CPU without
                         ``TRITON_INTERPRET=1``)
* ``stage.graphs``       a LoRA stage chain decoding through CUDA graphs against the same chain
                         eagerly: latest-adapter and base rows, before and after a training step
* ``stage.versions``     a step mixing adapter versions (saved, latest, base) as one batched-LoRA
                         pass against one pass per version, float64
* ``tp``                 tensor parallelism, rank 1 a spawned process: NCCL with two GPUs, gloo
                         with one (both ranks on it) or on the CPU; float64 tokens vs tp=1 and
                         generate()

vLLM's own graphs are exercised by the ``vllm`` row (its default, compiled mode).

Without CUDA it prints ``skipped: no CUDA device`` and exits 0. ``--device cpu`` runs the
same checks on the CPU (a dry run of the comparison logic; the CPU takes the native-kernel
and packed-weight paths, not the CUDA branches). Exit status: 1 if any row failed.

The package, by role:

* ``common.py``          rows, failures, the tiny models and prompts, the executor chain
* ``references.py``      the references: transformers' generate()/forward, peft's training step
* ``executor_checks.py`` the ``executor.*`` rows
* ``engine_checks.py``   ``torch_engine``, ``device_stats`` and ``vllm``
* ``sampler_checks.py``  ``sampler``
* ``stage_checks.py``    ``stage.inproc``, ``stage.p2p`` and ``stage.versions``
* ``kernel_checks.py``   ``executor.triton``, ``stage.graphs`` and ``tp``
* ``cli.py``             the rows' registry (``CHECKS``), the table, ``main``
"""
from raycolo.gpu_check.cli import CHECKS, main, run_checks, table
from raycolo.gpu_check.common import FAIL, PASS, SKIP, CheckFailed, Row

__all__ = ["CHECKS", "FAIL", "PASS", "SKIP", "CheckFailed", "Row", "main", "run_checks", "table"]
