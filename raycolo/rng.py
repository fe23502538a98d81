"""Seeded random generators: every random choice in raycolo takes one."""
from __future__ import annotations

import zlib

import numpy as np


def seeded_rng(seed: int, *names: str) -> np.random.Generator:
    """A generator keyed by the run seed and stable names (crc32, not Python's salted hash)."""
    keys = [int(seed) & 0xFFFFFFFF] + [zlib.crc32(n.encode()) for n in names]
    return np.random.default_rng(keys)


def random_prompts(rng: np.random.Generator, count: int, lengths, vocab: int) -> list[list[int]]:
    """``count`` prompts of uniform random token ids in [3, vocab) (past the usual special
    ids), of ``lengths`` tokens (one length for all, or one each)."""
    lengths = np.broadcast_to(np.asarray(lengths), (count,))
    return [rng.integers(3, vocab, int(n)).tolist() for n in lengths]
