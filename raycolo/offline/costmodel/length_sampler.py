"""Output-length sampler: inverse-transform sampling from a per-model empirical CDF.

The eCDF files live in ``raycolo/data/ecdf/<name>.csv`` (format in docs/data.md).
A sample is clipped by the node's output limit and by what the context window leaves
after the prompt, as in SamuLLM §4.1.
"""
from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import numpy as np

from raycolo.catalog import ModelSpec
from raycolo.errors import ConfigError


@functools.lru_cache(maxsize=None)
def load_ecdf(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Read ``output_tokens,cdf`` rows; returns (lengths, cdf) as numpy arrays."""
    try:
        lines = [ln.strip() for ln in Path(path).read_text().splitlines()]
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read eCDF file: {exc}") from None
    data = np.array([ln.split(",") for ln in lines if ln and not ln.startswith("#")], dtype=object)
    if data.ndim != 2 or data.shape[1] != 2 or data[0, 0] != "output_tokens":
        raise ConfigError(f"{path}: expected a header 'output_tokens,cdf' and two columns")
    try:
        lengths = data[1:, 0].astype(np.int64)
        cdf = data[1:, 1].astype(np.float64)
    except ValueError:
        raise ConfigError(f"{path}: non-numeric eCDF row") from None
    if len(lengths) == 0 or np.any(np.diff(lengths) <= 0) or np.any(np.diff(cdf) < 0) \
            or lengths[0] < 1 or cdf[0] <= 0 or abs(cdf[-1] - 1.0) > 1e-9:
        raise ConfigError(f"{path}: eCDF must have increasing lengths >= 1 and a "
                          "non-decreasing cdf ending at 1.0")
    return lengths, cdf


GREEDY_ECDF_SUFFIX = ".greedy"    # <model>.greedy.csv: the profile's greedy output lengths


def ecdf_path(name: str, ecdf_dir: str | Path | None = None) -> Path:
    if ecdf_dir is not None:
        return Path(ecdf_dir) / f"{name}.csv"
    return Path(str(resources.files("raycolo").joinpath("data", "ecdf", f"{name}.csv")))


def missing_ecdf(model: str, path: Path) -> str:
    """The error for a model with no output-length eCDF, and how to make one (docs/data.md,
    "A model without an eCDF")."""
    return (f"model '{model}': no output-length eCDF at {path}; measure one with `raycolo profile --model "
            f"{model} --out DIR` (or `--model CHECKPOINT_DIR --name {model}`), which writes DIR/ecdf/{model}.csv, "
            f"and plan with --profile DIR; or write that file by hand (docs/data.md, eCDF CSV files)")


class OutputLengthSampler:
    """Samples output lengths for one model from its eCDF. ``greedy``: the profile's greedy
    eCDF (``<model>.greedy.csv`` in ``ecdf_dir``, written by ``raycolo profile``) where it
    has one: a greedy node's real lengths, not those of sampling at temperature 1."""

    def __init__(self, model: ModelSpec, ecdf_dir: str | Path | None = None, greedy: bool = False):
        self.model = model
        path = ecdf_path(model.ecdf_name, ecdf_dir)
        if greedy and ecdf_dir is not None and ecdf_path(model.ecdf_name + GREEDY_ECDF_SUFFIX, ecdf_dir).exists():
            path = ecdf_path(model.ecdf_name + GREEDY_ECDF_SUFFIX, ecdf_dir)
        self.path = path
        if not path.exists() and ecdf_dir is not None:
            path = ecdf_path(model.ecdf_name)  # fall back to the shipped file
        if not path.exists():
            raise ConfigError(missing_ecdf(model.name, path))
        self.lengths, self.cdf = load_ecdf(str(path))

    def sample(self, input_lengths: np.ndarray, max_output: int, rng: np.random.Generator) -> np.ndarray:
        u = rng.random(len(input_lengths))
        idx = np.searchsorted(self.cdf, u, side="left")
        raw = self.lengths[np.minimum(idx, len(self.lengths) - 1)]
        room = self.model.context_length - np.asarray(input_lengths, dtype=np.int64)
        return np.maximum(1, np.minimum(np.minimum(raw, max_output), room)).astype(np.int64)

    @property
    def mean(self) -> float:
        pmf = np.diff(np.concatenate([[0.0], self.cdf]))
        return float(np.dot(pmf, self.lengths))


def write_ecdf(path: str | Path, lengths, comment: str) -> Path:
    """Write measured output lengths as an eCDF file (the format :func:`load_ecdf` reads)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    if len(values) == 0 or values[0] < 1:
        raise ValueError("output lengths must be positive and non-empty")
    cdf = np.cumsum(counts) / counts.sum()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [f"# {line}" for line in comment.splitlines()] + ["output_tokens,cdf"]
    lines += [f"{v},{c:.6f}" for v, c in zip(values[:-1], cdf[:-1])] + [f"{values[-1]},1.0"]
    path.write_text("\n".join(lines) + "\n")
    load_ecdf.cache_clear()
    return path
