"""What structured outputs cost the torch engine: decode throughput under a JSON schema, a
regex and a choice list against the same requests unconstrained, and the share of the
run spent filling the grammar masks (xgrammar's ``fill_next_token_bitmask``, on the
sampling thread, raycolo.generation.grammar_masks).

The checkpoint is tests/support/hf_checkpoints.py's Llama 3-style one (a trained byte-level
BPE, 2,048 ids), built in a temporary directory. Every request generates ``--tokens``
tokens (EOS ignored; a grammar that completes leaves its row unconstrained, as vLLM
does). Medians of ``--repeats`` runs after one untimed run.

    python bench/structured.py [--batches 1,8,32] [--tokens 64] [--repeats 3] [--json PATH]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from common import write_json  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array", "items": {
    "type": "string"}}, "score": {"type": "number"}}, "required": ["name", "tags", "score"]}
CONSTRAINTS = {"free": None, "free, full sampler": None, "json schema": {"json": SCHEMA},
               "regex [A-Za-z ,.]+": {"regex": r"[A-Za-z ,.]+"},
               "regex [A-Za-z ,.]{1,400}": {"regex": r"[A-Za-z ,.]{1,400}"},
               "choice (3)": {"choice": ["yes", "no", "maybe not"]}}
# "free, full sampler": unconstrained rows through the sampler's general path (a zero logit bias
# makes them not plain greedy), which every constrained row takes: what is the sampler's, not the masks'.


class TimedMasks:
    """The engine's GrammarMasks (held by its VocabRules) with the time its ``bitmask``
    calls take counted."""

    def __init__(self, masks):
        self.masks, self.seconds = masks, 0.0

    def bitmask(self, rows):
        started = time.perf_counter()
        try:
            return self.masks.bitmask(rows)
        finally:
            self.seconds += time.perf_counter() - started


def run(engine, prompts, params, repeats: int):
    engine.generate(prompts, params)                       # untimed: compiles the grammar, warms the cache
    rules = engine.rules
    walls, masks = [], []
    for _ in range(repeats):
        timed = TimedMasks(rules.grammar) if params.structured_outputs is not None else None
        if timed:
            rules._grammar = timed
        started = time.perf_counter()
        outs = engine.generate(prompts, params)
        walls.append(time.perf_counter() - started)
        masks.append(timed.seconds if timed else 0.0)
        if timed:
            rules._grammar = timed.masks
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens, statistics.median(walls), statistics.median(masks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    from tests.support.hf_checkpoints import build_checkpoint

    from raycolo.engine import create_engine
    from raycolo.generation import SamplingParams
    from raycolo.generation.structured import StructuredOutputs

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        path = build_checkpoint("llama3", Path(tmp) / "llama3", seed=0)
        engine = create_engine({"model_loading_config": {"model_id": str(path)},
                                "engine_kwargs": {"kv_cache_tokens": 32768}})
        for batch in (int(b) for b in args.batches.split(",")):
            prompts = [[100 + i, 200 + i, 300 + i, 400] for i in range(batch)]
            free_rate = None
            for name, c in CONSTRAINTS.items():
                params = SamplingParams(max_tokens=args.tokens, ignore_eos=True,
                                        structured_outputs=StructuredOutputs(**c) if c else None,
                                        logit_bias=((0, 0.0),) if name == "free, full sampler" else ())
                tokens, wall, masks = run(engine, prompts, params, args.repeats)
                rate = tokens / wall
                free_rate = free_rate or rate
                rows.append(dict(batch=batch, constraint=name, tokens=tokens, seconds=wall, tokens_per_s=rate,
                                 vs_free=rate / free_rate, mask_share=masks / wall,
                                 mask_ms_per_row_step=1e3 * masks / tokens if masks else 0.0))
        engine.release()
    print("| batch | constraint | tokens/s | vs free | time filling masks | ms per row and step |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['constraint']} | {r['tokens_per_s']:,.0f} | {r['vs_free']:.2f} | "
              f"{100 * r['mask_share']:.0f} % | {r['mask_ms_per_row_step']:.3f} |")
    if args.json:
        write_json(args.json, {"rows": rows, "tokens": args.tokens, "repeats": args.repeats})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
