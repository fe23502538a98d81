"""What a decode step asks of the device: aten operations and matrix products per step.

On a GPU every one of these is a kernel launch (or a node of a CUDA graph), and the
short ones of a batch-1 step are over before they reach the card's bandwidth; so the
count is what LoRA on the online stage path adds to the engine's step, whatever the card.
Counted with a ``TorchDispatchMode`` over one decode step of a :class:`ModelExecutor`
(views not counted), for the plain model and for the model with rank-8 LoRA on q/k/v/o
(``lora_B`` random), in float32 and in bfloat16 (whose adapters peft keeps in float32).
On the CPU the attention and pointwise kernels differ from the GPU's (native C, Triton),
so compare the *difference* LoRA makes, which runs the same aten products on both.

    .venv/bin/python bench/step_ops.py [--model tiny-llama-l] [--batch 1] [--json out/step_ops.json]
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from raycolo.batching.blocks import BlockAllocator
from raycolo.engine.executor import ModelExecutor, SeqChunk
from raycolo.engine.models import build_tiny_model
from common import write_json
from realsize_models import add_active_lora   # bench/: the LoRA the GPU bench serves with

PRODUCTS = {"mm", "addmm", "addmm_", "bmm", "baddbmm", "linear", "matmul", "_linear_pointwise"}  # last: oneDNN packed


class Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def step_ops(model, batch: int) -> Counter:
    """The operations of the second decode step of ``batch`` 32-token prompts."""
    blocks = batch * 4 + 1
    ex = ModelExecutor(model, blocks, 16)
    alloc = BlockAllocator(blocks)
    g = torch.Generator().manual_seed(batch)
    seqs = [torch.randint(3, model.config.vocab_size, (32,), generator=g).tolist() for _ in range(batch)]
    for i in range(batch):
        alloc.allocate(i, 4)
    out = ex.execute(ex.batch([SeqChunk(p, 0, alloc.tables[i]) for i, p in enumerate(seqs)]))
    counter = None
    for step in range(2):
        for s, t in zip(seqs, out.argmax(-1).tolist()):
            s.append(t)
        chunks = [SeqChunk([s[-1]], len(s) - 1, alloc.tables[i]) for i, s in enumerate(seqs)]
        with torch.no_grad(), Ops() as counter:
            out = ex.execute(ex.batch(chunks))
    return counter.ops


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama-l")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    rows = []
    for dtype in ("float32", "bfloat16"):
        plain = step_ops(build_tiny_model(args.model, 0, dtype)[0].eval(), args.batch)
        lora = step_ops(add_active_lora(build_tiny_model(args.model, 0, dtype)[0], seed=3).eval(), args.batch)
        for name, ops in (("plain", plain), ("LoRA q/k/v/o", lora)):
            rows.append({"dtype": dtype, "model": name, "ops": sum(ops.values()),
                         "products": sum(n for op, n in ops.items() if op in PRODUCTS),
                         "top": ops.most_common(6)})
    layers = build_tiny_model(args.model, 0, "float32")[0].config.num_hidden_layers
    print(f"{args.model} ({layers} layers), batch {args.batch}, one decode step, "
          f"`python bench/step_ops.py {' '.join(argv if argv is not None else sys.argv[1:])}`")
    print("| dtype | model | aten ops | matrix products | LoRA adds, per layer |")
    print("|---|---|---:|---:|---|")
    for i, r in enumerate(rows):
        extra = ""
        if i % 2:
            p = rows[i - 1]
            extra = (f"{(r['ops'] - p['ops']) / layers:.1f} ops, "
                     f"{(r['products'] - p['products']) / layers:.1f} products")
        print(f"| {r['dtype']} | {r['model']} | {r['ops']} | {r['products']} | {extra} |")
    for r in rows:
        print(f"  {r['dtype']:<9} {r['model']:<13} most: {', '.join(f'{k} {v}' for k, v in r['top'])}")
    if args.json:
        write_json(args.json, {"args": vars(args), "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
