"""gpu-check's shared pieces: the row and its failure, the tiny models and prompts, the
tolerance, and the chain of executors every executor row drives."""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Optional

PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
MODEL = "tiny-llama-m"
CUTS = (0, 2, 4)


@dataclass
class Row:
    path: str
    result: str
    figures: dict = field(default_factory=dict)
    detail: str = ""
    seconds: float = 0.0

    def figures_text(self) -> str:
        parts = [f"{k}={_fmt(v)}" for k, v in self.figures.items()]
        if self.detail:
            parts.append(self.detail)
        return ", ".join(parts)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e-2 and v else f"{v:.4g}"
    return str(v)


class CheckFailed(AssertionError):
    pass


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise CheckFailed(message)


# -- shared pieces ---------------------------------------------------------------------------
def _prompts(lengths, seed: int = 1) -> list[list[int]]:
    from raycolo.engine.models import BOS_ID, BYTE_OFFSET

    rng = random.Random(seed)
    return [[BOS_ID] + [rng.randrange(BYTE_OFFSET, BYTE_OFFSET + 256) for _ in range(n - 1)]
            for n in lengths]


def _model(model_id: str, dtype: str, device):
    from raycolo.engine.models import build_tiny_model

    return build_tiny_model(model_id, 0, dtype)[0].to(device)


def _logits_tol(device) -> float:
    """How close float64 logits must be to transformers' own on the same device. Its
    Llama/Qwen2/Mistral RMSNorm computes in float32 whatever the model's dtype. A CPU's
    float32 row reduction does not depend on how many rows the batch has; CUDA's does, so a
    token's norm in a packed batch of prompts and in one prompt alone round differently
    (9e-8 in the logits, seen on an H100). On CUDA the bound is float32's rounding; the
    greedy tokens must still be equal."""
    return 1e-8 if device.type == "cpu" else 1e-6


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Chain:
    """Executors (or one) over shared block tables: prefill, then greedy decode steps."""

    def __init__(self, executors, num_blocks: int, block_size: int):
        from raycolo.batching.blocks import BlockAllocator

        self.executors, self.block_size = executors, block_size
        self.alloc = BlockAllocator(num_blocks)
        self.lens: dict[int, int] = {}

    def step(self, rids, toks):
        import math

        from raycolo.engine.executor import SeqChunk

        chunks = []
        for rid, t in zip(rids, toks):
            start = self.lens.get(rid, 0)
            need = math.ceil((start + len(t)) / self.block_size) - self.alloc.blocks_of(rid)
            if need > 0:
                self.alloc.allocate(rid, need)
            chunks.append(SeqChunk(list(t), start=start, table=self.alloc.tables[rid]))
            self.lens[rid] = start + len(t)
        hidden = None
        for ex in self.executors:
            hidden = ex.execute(ex.batch(chunks), hidden)
        return hidden

    def greedy(self, prompts, steps: int, timer: Optional[list] = None):
        rids = list(range(len(prompts)))
        first = self.step(rids, prompts)
        outs = [[int(t)] for t in first.argmax(-1).tolist()]
        device = first.device
        for _ in range(steps - 1):
            _sync(device)
            t0 = time.perf_counter()
            logits = self.step(rids, [[o[-1]] for o in outs])
            nxt = logits.argmax(-1).tolist()         # .tolist() waits for the device
            if timer is not None:
                timer.append(time.perf_counter() - t0)
            for o, t in zip(outs, nxt):
                o.append(int(t))
        return first, outs


def _random_lora_b(stage) -> None:
    """Seeded random ``lora_B`` matrices in a stage's model (peft starts them at zero, so
    the adapter would change nothing)."""
    import torch

    with torch.no_grad():
        for name, p in stage.model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.1)


def _train_chain(stages, batch, device, task: int) -> None:
    """One pipelined training step of ``batch`` (ids, labels, lengths) through ``stages``."""
    ids, labels, lengths = batch
    x = ids.to(device)
    for st in stages[:-1]:
        x = st.train_forward(task, x, lengths)
    stages[-1].train_forward(task, x, lengths, labels.to(device))
    grad = None
    for st in reversed(stages):
        grad = st.train_backward(task, grad)
