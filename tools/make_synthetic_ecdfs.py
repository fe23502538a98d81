#!/usr/bin/env python3
"""Write SYNTHETIC output-length eCDFs, one CSV per catalog model, into raycolo/data/ecdf/.

These files are stand-ins, not measurements: nobody ran the models to make them. Each is the
empirical CDF of N seeded random draws from a hand-picked distribution whose range and mean
follow the numbers the SamuLLM paper quotes for the datasets of its experiments (MixInstruct for
LLM ensembling, RouterBench for LLM routing, No Robots for chat models). Rerunning the script
gives byte-identical files (numpy default_rng keyed by SEED and crc32 of the model name; no
timestamps). The format is described in docs/data.md.

Replacing them with measured eCDFs (what SamuLLM does, and what `raycolo profile` will do):
  1. Run the model (e.g. with vLLM) on a large request set whose prompts do not ask for a given
     length, with no output cap below the context window (the paper used 10,000 No Robots
     prompts), and record the number of generated tokens of every request, one integer per line.
  2. Convert that list into the same CSV format with this script:
         python tools/make_synthetic_ecdfs.py --from-lengths lengths.txt --name <model-name>
     which writes raycolo/data/ecdf/<model-name>.csv with a "# MEASURED" header (edit the
     --note text to say which request set, engine and sampling settings were used).
  3. Keep the file name equal to the model's catalog name (or set `ecdf:` in models.yaml).

Usage:
    python tools/make_synthetic_ecdfs.py              # (re)write every synthetic file
    python tools/make_synthetic_ecdfs.py --out DIR    # write elsewhere
"""
from __future__ import annotations

import argparse
import math
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from raycolo.catalog import load_catalog  # noqa: E402

SEED = 20240917          # base seed; each model also mixes in crc32(name)
N_DRAWS = 20_000         # synthetic "requests" per model
HEADER = "output_tokens,cdf"

# Probability grid used to thin the draws to at most ~250 support points: every 0.5% up to the
# 95th percentile, every 0.1% up to 99.9%, then a few points into the far tail and the maximum.
PROB_GRID = np.concatenate([
    np.arange(1, 190) * 0.005,
    0.95 + np.arange(0, 49) * 0.001,
    [0.9993, 0.9996, 0.9998, 1.0],
])


@dataclass(frozen=True)
class Profile:
    family: str   # "ensemble" | "routing" | "chat" | "tiny"
    mean: float   # target mean output length in tokens (before thinning)
    shape: float  # Beta 'a' for ensemble, lognormal sigma for routing/chat; unused for tiny


# Per-model choices. The means are made up but stay inside the ranges the paper quotes, and the
# per-family averages land on the quoted dataset means (MixInstruct ~180; RouterBench ~199 when
# weighted by SamuLLM Table 1's request counts).
PROFILES: dict[str, Profile] = {
    # LLM ensembling, MixInstruct-like
    "vicuna-13b-v1.5": Profile("ensemble", 205, 1.8),
    "oasst-sft-4-pythia-12b-epoch-3.5": Profile("ensemble", 170, 1.5),
    "alpaca-13b": Profile("ensemble", 150, 1.4),
    "baize-v2-13b": Profile("ensemble", 185, 1.7),
    "koala-13b-hf": Profile("ensemble", 175, 1.6),
    "dolly-v2-12b": Profile("ensemble", 160, 1.3),
    "mpt-7b-chat": Profile("ensemble", 195, 1.7),
    "chatglm3-6b": Profile("ensemble", 210, 1.9),
    "stablelm-tuned-alpha-7b": Profile("ensemble", 165, 1.4),
    # LLM routing, RouterBench-like
    "llama-2-70b-chat-hf": Profile("routing", 235, 0.95),
    "mixtral-8x7b-instruct-v0.1": Profile("routing", 215, 1.00),
    "wizardlm-13b-v1.2": Profile("routing", 205, 0.90),
    "codellama-34b-instruct-hf": Profile("routing", 180, 1.05),
    "mistral-7b-instruct-v0.2": Profile("routing", 185, 0.95),
    # Chat models, No-Robots-like
    "llama-2-13b-chat-hf": Profile("chat", 255, 0.85),
    "llama-2-7b-chat-hf": Profile("chat", 245, 0.85),
    "llama-3-8b-instruct": Profile("chat", 250, 0.85),
}

ENSEMBLE_MAX = 490                 # SamuLLM §5.1: MixInstruct outputs max 490, mean 180
ROUTING_MIN, ROUTING_MAX = 3, 1585  # SamuLLM §5.2: RouterBench outputs 3..1585, mean 199
CHAT_MAX = 1500
TINY_MAX = 256


def profile_for(name: str) -> Profile:
    if name in PROFILES:
        return PROFILES[name]
    if name.startswith("tiny-"):
        return Profile("tiny", (TINY_MAX + 1) / 2, 0.0)
    raise SystemExit(f"no synthetic profile for catalog model '{name}': add it to PROFILES in {__file__}")


def rng_for(name: str) -> np.random.Generator:
    return np.random.default_rng([SEED, zlib.crc32(name.encode())])


def _phi(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


def _lognormal_mu_for_mean(mean: float, sigma: float, lo: float, hi: float) -> float:
    """mu such that LogNormal(mu, sigma) truncated to [lo, hi] has the given mean (bisection)."""
    a, b = math.log(lo), math.log(hi)

    def tmean(mu: float) -> float:
        mass = _phi((b - mu) / sigma) - _phi((a - mu) / sigma)
        part = _phi((b - mu - sigma ** 2) / sigma) - _phi((a - mu - sigma ** 2) / sigma)
        return math.exp(mu + sigma ** 2 / 2) * part / mass

    left, right = a - 5 * sigma, b + 5 * sigma
    for _ in range(200):
        mid = (left + right) / 2
        left, right = (mid, right) if tmean(mid) < mean else (left, mid)
    return (left + right) / 2


def _truncated_lognormal(rng, mean: float, sigma: float, lo: int, hi: int, n: int) -> np.ndarray:
    # lo - 0.5 .. hi + 0.5 so that the rounded draws keep the requested mean
    mu = _lognormal_mu_for_mean(mean, sigma, lo - 0.5, hi + 0.5)
    out = np.empty(0, dtype=np.int64)
    while len(out) < n:   # rejection keeps the shape inside [lo, hi] without a spike at hi
        x = np.rint(rng.lognormal(mu, sigma, size=2 * n)).astype(np.int64)
        out = np.concatenate([out, x[(x >= lo) & (x <= hi)]])
    return out[:n]


def draw(name: str, prof: Profile, n: int = N_DRAWS) -> tuple[np.ndarray, str]:
    """Return (integer output lengths, one-line description of the generator)."""
    rng = rng_for(name)
    if prof.family == "ensemble":
        a = prof.shape
        p = (prof.mean - 0.5) / ENSEMBLE_MAX
        b = a * (1 - p) / p
        x = 1 + np.floor(ENSEMBLE_MAX * rng.beta(a, b, size=n)).astype(np.int64)
        return np.minimum(x, ENSEMBLE_MAX), (
            f"1 + floor({ENSEMBLE_MAX} * Beta(a={a:g}, b={b:.3f})), i.e. support 1..{ENSEMBLE_MAX}, "
            f"target mean {prof.mean:g}")
    if prof.family == "routing":
        x = _truncated_lognormal(rng, prof.mean, prof.shape, ROUTING_MIN, ROUTING_MAX, n)
        return x, (f"round(LogNormal(sigma={prof.shape:g})) kept on {ROUTING_MIN}..{ROUTING_MAX} "
                   f"by rejection, mu set so the kept draws have mean {prof.mean:g}")
    if prof.family == "chat":
        x = _truncated_lognormal(rng, prof.mean, prof.shape, 1, CHAT_MAX, n)
        return x, (f"round(LogNormal(sigma={prof.shape:g})) kept on 1..{CHAT_MAX} by rejection, "
                   f"mu set so the kept draws have mean {prof.mean:g}")
    if prof.family == "tiny":
        return np.arange(1, TINY_MAX + 1), f"exact discrete uniform on 1..{TINY_MAX} (no draws)"
    raise ValueError(prof.family)


FAMILY_TEXT = {
    "ensemble": ("MixInstruct-like, for the LLM-ensembling models (SamuLLM §5.1 states MixInstruct "
                 "outputs have max 490 and mean 180 tokens); right-skewed, bounded at 490; "
                 "each model's mean differs a little (150-210)."),
    "routing": ("RouterBench-like, for the LLM-routing models (SamuLLM §5.2 states RouterBench "
                "outputs span 3..1585 tokens with mean 199); heavy right tail; each model's "
                "mean and spread differ a little."),
    "chat": ("No-Robots-chat-like (the dataset SamuLLM §2 uses to build its eCDFs; Figure 2 shows "
             "vicuna-13b-v1.5's); shape NOT digitised from the figure: mean ~250, max ~1500."),
    "tiny": "Test-only, for the tiny random-weight CPU models: uniform on 1..256.",
}


MAX_ROWS = 300


def thin(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Exact empirical CDF of `lengths`: at every distinct value if there are at most MAX_ROWS,
    otherwise at the minimum, the PROB_GRID quantiles and the maximum."""
    s = np.sort(np.asarray(lengths, dtype=np.int64))
    n = len(s)
    distinct = np.unique(s)
    if len(distinct) <= MAX_ROWS:
        return distinct, np.searchsorted(s, distinct, side="right") / n
    idx = np.clip(np.ceil(PROB_GRID * n).astype(np.int64) - 1, 0, n - 1)
    support = np.unique(np.concatenate([[s[0]], s[idx], [s[-1]]]))
    cdf = np.searchsorted(s, support, side="right") / n
    return support, cdf


def render(support: np.ndarray, cdf: np.ndarray, comments: list[str]) -> str:
    lines = [f"# {c}" for c in comments] + [HEADER]
    for i, (v, c) in enumerate(zip(support, cdf)):
        lines.append(f"{int(v)},{'1.0' if i == len(cdf) - 1 else f'{c:.6f}'}")
    return "\n".join(lines) + "\n"


def file_stats(support: np.ndarray, cdf: np.ndarray) -> tuple[float, int]:
    """Mean and max of the distribution the file encodes (what the sampler draws from)."""
    pmf = np.diff(np.concatenate([[0.0], cdf]))
    return float(np.dot(pmf, support)), int(support[-1])


def check(support: np.ndarray, cdf: np.ndarray) -> None:
    assert len(support) <= MAX_ROWS, len(support)
    assert support[0] >= 1 and np.all(np.diff(support) > 0)
    assert cdf[0] > 0 and np.all(np.diff(cdf) >= 0) and cdf[-1] == 1.0


def write_synthetic(out_dir: Path) -> None:
    catalog = load_catalog(REPO / "raycolo" / "data" / "models.yaml")
    out_dir.mkdir(parents=True, exist_ok=True)
    done: set[str] = set()
    print(f"{'file':40s} {'family':9s} {'rows':>4s} {'mean':>7s} {'max':>5s} {'draws mean':>10s}")
    for name in sorted(catalog):
        fname = catalog[name].ecdf_name
        if fname in done:
            continue
        done.add(fname)
        prof = profile_for(fname)
        lengths, gen = draw(fname, prof)
        support, cdf = thin(lengths)
        check(support, cdf)
        comments = [
            f"SYNTHETIC stand-in, NOT measured from the model: output-length eCDF for {fname}.",
            f"Shape: {FAMILY_TEXT[prof.family]}",
            (f"Generator: tools/make_synthetic_ecdfs.py, {gen}; {len(support)} rows."
             if prof.family == "tiny" else
             f"Generator: tools/make_synthetic_ecdfs.py, numpy default_rng([{SEED}, crc32('{fname}')]), "
             f"{len(lengths)} draws of {gen}; thinned to {len(support)} support points "
             "(exact eCDF of the draws there)."),
            "Replace with a measured eCDF (docs/data.md): same header, lengths strictly increasing, cdf ending at 1.0.",
        ]
        (out_dir / f"{fname}.csv").write_text(render(support, cdf, comments))
        mean, mx = file_stats(support, cdf)
        print(f"{fname + '.csv':40s} {prof.family:9s} {len(support):4d} {mean:7.1f} {mx:5d} "
              f"{lengths.mean():10.1f}")


def write_measured(lengths_path: Path, name: str, note: str, out_dir: Path) -> None:
    lengths = np.loadtxt(lengths_path, dtype=np.int64, ndmin=1)
    lengths = lengths[lengths >= 1]
    if len(lengths) == 0:
        raise SystemExit(f"{lengths_path}: no output lengths >= 1")
    support, cdf = thin(lengths)
    check(support, cdf)
    comments = [
        f"MEASURED output-length eCDF for {name}: {len(lengths)} requests from {lengths_path.name}.",
        note,
        f"Thinned by tools/make_synthetic_ecdfs.py to {len(support)} support points (exact eCDF there).",
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.csv").write_text(render(support, cdf, comments))
    mean, mx = file_stats(support, cdf)
    print(f"wrote {out_dir / (name + '.csv')}: {len(support)} rows, mean {mean:.1f}, max {mx} "
          f"(raw mean {lengths.mean():.1f})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=REPO / "raycolo" / "data" / "ecdf",
                    help="output directory (default: raycolo/data/ecdf)")
    ap.add_argument("--from-lengths", type=Path, metavar="FILE",
                    help="convert measured output lengths (one integer per line) instead")
    ap.add_argument("--name", help="model (file) name for --from-lengths")
    ap.add_argument("--note", default="Request set, engine and sampling settings: <fill in>.",
                    help="provenance line for --from-lengths")
    args = ap.parse_args(argv)
    if args.from_lengths:
        if not args.name:
            ap.error("--from-lengths needs --name")
        write_measured(args.from_lengths, args.name, args.note, args.out)
    else:
        write_synthetic(args.out)


if __name__ == "__main__":
    main()
