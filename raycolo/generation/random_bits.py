"""Counter-based random numbers for the sampler's seeded draws: a pure function of a
63-bit seed and a vocabulary index, computed with int64 tensor ops on any device.

For a seed ``s`` (``0 <= s < 2**63``) and an index ``i``, with ``fmix32`` murmur3's
32-bit finalizer and every step reduced modulo ``2**32``::

    k1 = fmix32((s & 0xFFFFFFFF) ^ 0x9E3779B9)
    k2 = fmix32((s >> 32) ^ 0x7F4A7C15)
    bits = fmix32(fmix32((i * 0x9E3779B1) ^ k1) ^ k2)

``i -> bits`` is a bijection for a fixed seed (no two tokens of a row share their bits)
and ``s -> (k1, k2)`` is one (no two seeds share a row). The bits are the same on every
device and whatever else is in the batch: each element depends on its own (seed, index).
The keys are derived independently: ``k2 = fmix32(hi ^ k1)``, say, would cancel, giving
``bits == 0`` at index 0 of every seed below ``2**32``.

The draw's Exp(1) variables are ``q = -log1p(-u)`` with ``u = (bits + 0.5) / 2**32``
in float32, strictly inside (0, 1). All 32 bits are used, and ``-log1p(-u)`` rather than
``-log(u)``, because the small ``q`` decide an exponential race: with a 24-bit ``u``
and ``q = -log(u)``, ``q`` would step by ``2**-24`` near 0, misweighting every token
less likely than about that (up to ``vocab * 2**-24`` of probability mass in all, near 1%
at a 128k vocabulary); here the step is ``2**-32``.

int64 arithmetic that never overflows: every intermediate lies in ``[0, 2**32)``. A
product ``h * c`` of such an ``h`` by a 32-bit constant ``c >= 2**31`` is computed as
``h * (c - 2**32)``, which has the same residue modulo ``2**32`` and lies in
``(-2**63, 0]``; ``& 0xFFFFFFFF`` of its two's complement is that residue. Shifts only
ever see non-negative values.
"""
from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF
GOLDEN = 0x9E3779B1          # odd: multiplying by it permutes the residues modulo 2**32
SEED_SALT = 0x9E3779B9        # k1's
HIGH_SALT = 0x7F4A7C15        # k2's
FMIX_C1 = 0x85EBCA6B
FMIX_C2 = 0xC2B2AE35
# The largest float32 below 1: where the rounding of (bits + 0.5) / 2**32 would reach 1.0.
BELOW_ONE = 1.0 - 2.0 ** -24


def _mul32(h: torch.Tensor, c: int) -> torch.Tensor:
    """``h * c`` modulo ``2**32``, in place (``0 <= h < 2**32``, ``0 < c < 2**32``)."""
    return h.mul_(c - (1 << 32) if c >= 1 << 31 else c).bitwise_and_(MASK32)


def fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finalizer of 32-bit values held in int64, in place."""
    h.bitwise_xor_(h >> 16)
    _mul32(h, FMIX_C1)
    h.bitwise_xor_(h >> 13)
    _mul32(h, FMIX_C2)
    return h.bitwise_xor_(h >> 16)


def row_keys(seeds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The two 32-bit keys of each seed (int64, ``0 <= seed < 2**63``)."""
    k1 = fmix32((seeds & MASK32) ^ SEED_SALT)
    k2 = fmix32((seeds >> 32) ^ HIGH_SALT)
    return k1, k2


def hash_bits(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """32 random bits (int64 in ``[0, 2**32)``) for each seed (rows) and index ``0..n-1``."""
    k1, k2 = row_keys(seeds.to(torch.int64))
    h = _mul32(torch.arange(n, dtype=torch.int64, device=seeds.device), GOLDEN)
    h = fmix32(h.unsqueeze(0) ^ k1.unsqueeze(1))       # (rows, n): a fresh tensor
    return fmix32(h.bitwise_xor_(k2.unsqueeze(1)))


def to_uniform(bits: torch.Tensor) -> torch.Tensor:
    """32-bit values (int64) as float32 uniforms strictly inside (0, 1):
    ``(bits + 0.5) / 2**32``, each step correctly rounded (so the same on every device),
    the top few capped below 1. The grid is ``2**-32`` fine near 0, where
    :func:`exponentials` needs it."""
    return bits.to(torch.float32).add_(0.5).mul_(2.0 ** -32).clamp_(max=BELOW_ONE)


def uniforms(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """float32 uniforms strictly inside (0, 1) for each seed (rows) and index ``0..n-1``."""
    return to_uniform(hash_bits(seeds, n))


def exponentials(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """Exp(1) variables ``-log(1 - u)``: the same law as ``-log(u)``, and small values
    (the ones that decide an exponential race) keep the uniforms' fine resolution near 0."""
    return uniforms(seeds, n).neg_().log1p_().neg_()
