"""Host memory a tensor-parallel rank takes to load its shard: the whole model loaded and
then cut, against only the shard read from the files (raycolo/engine/executor/shard_load.py).

Writes a Llama-shaped checkpoint with random weights (``--hidden``, ``--layers``, ...; bf16,
safetensors in 1 GB files as large checkpoints are), then loads rank 0 and rank ``tp - 1``
of it each way in a fresh process, and prints each process's peaks of anonymous memory
and of the checkpoint's file pages mapped (sampled every 2 ms) above those of a process
that imported the same libraries and loaded nothing, beside what the rank holds once
loaded. Medians of ``--repeats``.

    .venv/bin/python bench/shard_load.py
    .venv/bin/python bench/shard_load.py --hidden 4096 --layers 8 --tp 2,4 --json out/shard_load.json

A measured benchmark, not a test.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from common import int_list, write_json


class _Peaks:
    """The largest anonymous resident memory (``RssAnon``: what a load holds itself) and
    file-backed resident memory (``RssFile``: the checkpoint's pages mapped, which are the
    page cache's, shared by a node's ranks and reclaimable, and read from disk once) of
    this process, in MiB, sampled every 2 ms by a thread."""

    FIELDS = ("RssAnon", "RssFile")

    def __init__(self):
        self.peak, self.running = dict.fromkeys(self.FIELDS, 0.0), True
        self.thread = threading.Thread(target=self._watch, daemon=True)
        self.thread.start()

    def _sample(self) -> None:
        for line in Path("/proc/self/status").read_text().splitlines():
            name = line.split(":")[0]
            if name in self.peak:
                self.peak[name] = max(self.peak[name], int(line.split()[1]) / 1024)

    def _watch(self) -> None:
        while self.running:
            self._sample()
            time.sleep(0.002)

    def stop(self) -> dict:
        self.running = False
        self.thread.join()
        self._sample()
        return self.peak


def _child(path: str, way: str, rank: int, tp: int, dtype: str) -> None:
    """One load in this process; prints its peak RSS (MiB) and seconds as JSON."""
    from raycolo.engine.executor.shard_load import load_shard
    from raycolo.engine.executor.tensor_parallel import TensorParallel, shard_layers
    from raycolo.engine.models import load_model

    watch = _Peaks()
    started = time.perf_counter()
    model = None
    if way == "whole, then cut":
        model, _ = load_model(path, 0, dtype, "cpu")
        shard_layers(model.model.layers, model.config, TensorParallel(rank, tp))
    elif way == "shard only":
        model = load_shard(path, dtype, TensorParallel(rank, tp))
        assert model is not None
    held = sum(p.numel() * p.element_size() for p in model.parameters()) if model is not None else 0
    peak = watch.stop()
    print(json.dumps({"anon_mib": peak["RssAnon"], "file_mib": peak["RssFile"],
                      "seconds": time.perf_counter() - started, "held_mib": held / 2**20}))


def _measure(path: str, way: str, rank: int, tp: int, dtype: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", path, way, str(rank), str(tp), dtype],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _write_checkpoint(path: Path, args) -> float:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.save_pretrained(path, max_shard_size="1GB")
    return sum(f.stat().st_size for f in path.glob("*.safetensors")) / 2**20


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        _child(argv[1], argv[2], int(argv[3]), int(argv[4]), argv[5])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--tp", default="2,4")
    parser.add_argument("--dtypes", default="bfloat16,float32",
                        help="dtypes to load the bf16 checkpoint in (float32: converted as it loads)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    tps = int_list(args.tp, least=2)
    if tps is None:
        print(f"error: --tp: comma-separated integers >= 2, got '{args.tp}'", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("error: --repeats: at least 1", file=sys.stderr)
        return 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ckpt"
        size = _write_checkpoint(path, args)
        base = {k: statistics.median(_measure(str(path), "nothing", 0, 2, "bfloat16")[k] for _ in range(args.repeats))
                for k in ("anon_mib", "file_mib")}
        print(f"{platform.node()}, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, "
              f"`{' '.join(['bench/shard_load.py'] + list(argv))}`; checkpoint {size:.0f} MiB bf16 "
              f"(hidden {args.hidden}, {args.layers} layers); a process that loads nothing holds "
              f"{base['anon_mib']:.0f} MiB anonymous, {base['file_mib']:.0f} MiB file-backed; medians of {args.repeats}")
        print("| load as | way | tp | rank | parameters held, MiB | peak anonymous, MiB | peak file pages mapped, "
              "MiB | load s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|")
        for dtype in args.dtypes.split(","):
            for tp in tps:
                for rank in (0, tp - 1):
                    for way in ("whole, then cut", "shard only"):
                        runs = [_measure(str(path), way, rank, tp, dtype) for _ in range(args.repeats)]
                        row = {"dtype": dtype, "way": way, "tp": tp, "rank": rank, "checkpoint_mib": size,
                               "held_mib": runs[0]["held_mib"],
                               "anon_mib": statistics.median(r["anon_mib"] for r in runs) - base["anon_mib"],
                               "file_mib": statistics.median(r["file_mib"] for r in runs) - base["file_mib"],
                               "seconds": statistics.median(r["seconds"] for r in runs)}
                        rows.append(row)
                        print(f"| {dtype} | {way} | {tp} | {rank} | {row['held_mib']:.0f} | {row['anon_mib']:.0f} | "
                              f"{row['file_mib']:.0f} | {row['seconds']:.2f} |", flush=True)
    if args.json:
        write_json(args.json, {"args": vars(args), "baseline": base, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
