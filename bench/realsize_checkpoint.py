"""Write a real-size checkpoint directory with seeded random weights (nothing downloaded),
for ``raycolo profile --model DIR --device cuda`` and ``raycolo validate --batches`` on a
lent GPU: config.json, generation_config.json and safetensors shards, in the model's own
dtype, and no tokenizer files (raycolo then uses its byte tokenizer).

    python3 bench/realsize_checkpoint.py --shape llama3-8b --out /tmp/llama3-8b
"""
from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from bench.realsize_models import SHAPES, build_model  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    help="where the weights are drawn (default: cuda when there is one)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    started = time.perf_counter()
    model, _ = build_model(args.shape, torch.device(args.device), DTYPES[args.dtype], args.seed)
    built = time.perf_counter() - started
    out = Path(args.out)
    partial = out.with_name(out.name + ".partial")      # renamed once whole: a cut-off write is never taken
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, safe_serialization=True, max_shard_size="5GB")
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(f"{args.shape}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters in {args.dtype} "
          f"on {args.device}, built in {built:.1f} s, {size / 2**30:.1f} GiB written to {out} "
          f"in {time.perf_counter() - started - built:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
