"""SIRIUS's memory handover between inference and training on one device (SIRIUS §4).

One :class:`MemoryBroker` per stage (GPU) keeps a ledger of its memory: the weights, the
inference KV cache, the training activations of the micro-batch in flight, an inference
reserve, and what is free. Inference comes first:

* ``require(nbytes)`` (SIRIUS's REQUIRE(M)): inference claims memory *now*. It is taken
  from free memory, then from the reserve, then from training: the trainer gives up its
  micro-batch in flight (aborted and retried smaller; gradient accumulation keeps the
  effective batch, so the training result does not change) and shrinks its micro-batch.
  Inside the optimizer step the trainer cannot give memory back: inference waits until
  that step ends (SIRIUS: model updating is atomic and takes a few ms).
* ``release(nbytes)`` (RELEASE(M)): inference gives memory back. It goes to the reserve up
  to the watermark ``2 W`` and is then released down to ``W`` for training, which grows
  its micro-batch at its next one: coarse steps, so memory does not thrash (SIRIUS
  Algorithm 1's watermark; its idle-model timeout ``T_idle`` is not modelled yet).

The broker decides and counts; who frees what is the caller's (the live stage frees the
training tensors: torch's allocator on GPU, the process's tensors on CPU). Each handover
is recorded with its reason, so the live runtime can measure its latency (SIRIUS reports
5 ms average, 11 ms p99). ``check()`` verifies that the ledger adds up. Pure Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

LEDGER = ("weights", "kv", "training", "reserve", "free")


class OutOfMemory(Exception):
    """Inference asked for more than the device can give even with training stopped."""


@dataclass
class Handover:
    """What one ``require`` did: bytes taken from each source, and what the trainer must do
    (``"none"``, ``"abort_microbatch"`` or ``"wait_optimizer"``)."""

    nbytes: int
    from_free: int = 0
    from_reserve: int = 0
    from_training: int = 0
    trainer: str = "none"
    microbatch: Optional[int] = None     # the trainer's micro-batch size after the handover


@dataclass
class MemoryBroker:
    capacity: int
    weights: int
    watermark: int                        # SIRIUS's W: the reallocation granularity
    bytes_per_sample: int                 # training activations per micro-batch sample
    max_microbatch: int                   # the effective batch, reached by accumulation
    kv: int = 0
    training: int = 0                     # activations of the micro-batch in flight
    reserve: int = 0
    microbatch: int = 0                   # the trainer's micro-batch size now (0: paused)
    in_optimizer: bool = False
    handovers: list = field(default_factory=list)

    def __post_init__(self) -> None:
        if min(self.capacity, self.weights, self.watermark, self.bytes_per_sample, self.max_microbatch) < 0 \
                or self.weights > self.capacity or self.bytes_per_sample == 0:
            raise ValueError("memory broker: capacity >= weights >= 0, watermark >= 0, "
                             "bytes_per_sample > 0, max_microbatch >= 0")
        self.microbatch = self.microbatch or self._fits(self.free)

    @property
    def free(self) -> int:
        return self.capacity - self.weights - self.kv - self.training - self.reserve

    def ledger(self) -> dict[str, int]:
        return {"weights": self.weights, "kv": self.kv, "training": self.training,
                "reserve": self.reserve, "free": self.free}

    def check(self) -> None:
        """The ledger adds up to the capacity, with nothing negative."""
        parts = self.ledger()
        if any(v < 0 for v in parts.values()) or sum(parts.values()) != self.capacity:
            raise AssertionError(f"memory ledger does not balance: {parts} != capacity {self.capacity}")
        if self.training > self.microbatch * self.bytes_per_sample:
            raise AssertionError(f"training holds {self.training} bytes for a micro-batch of {self.microbatch}")

    def _fits(self, nbytes: int) -> int:
        return max(0, min(self.max_microbatch, nbytes // self.bytes_per_sample))

    # -- inference ----------------------------------------------------------------------------
    def require(self, nbytes: int) -> Handover:
        """Inference needs ``nbytes`` more for its KV cache now."""
        if nbytes < 0:
            raise ValueError("require: nbytes must be >= 0")
        if nbytes > self.capacity - self.weights - self.kv:
            raise OutOfMemory(f"require {nbytes} bytes: the device has "
                               f"{self.capacity - self.weights - self.kv} outside weights and KV")
        h = Handover(nbytes)
        h.from_free = min(nbytes, self.free)
        h.from_reserve = min(nbytes - h.from_free, self.reserve)
        self.reserve -= h.from_reserve
        need = nbytes - h.from_free - h.from_reserve
        if need > 0:
            if self.in_optimizer:
                h.trainer = "wait_optimizer"     # the caller retries once the step is done
                self.reserve += h.from_reserve   # nothing moves yet
                h.from_reserve = h.from_free = 0
                self.handovers.append(h)
                return h
            h.from_training = need
            self.training = 0                    # the micro-batch in flight is aborted
            h.trainer = "abort_microbatch"
        self.kv += nbytes
        # the next micro-batch fits what is left, its predecessor's activations included
        self.microbatch = self._fits(self.free + self.training)
        h.microbatch = self.microbatch
        self.handovers.append(h)
        return h

    def release(self, nbytes: int) -> int:
        """Inference gives ``nbytes`` of KV back; returns the bytes that went to training
        (the rest stays in the inference reserve)."""
        if not 0 <= nbytes <= self.kv:
            raise ValueError(f"release: {nbytes} bytes, but inference holds {self.kv}")
        self.kv -= nbytes
        self.reserve += nbytes
        if self.reserve < 2 * self.watermark:
            return 0
        given = self.reserve - self.watermark
        self.reserve = self.watermark
        self.microbatch = self._fits(self.free + self.training)   # from the next micro-batch on
        return given

    # -- training -------------------------------------------------------------------------------
    def start_microbatch(self) -> int:
        """The trainer starts a micro-batch: its size (0: no memory, training waits);
        its activations are now held."""
        size = min(self.microbatch, self._fits(self.free))
        self.training = size * self.bytes_per_sample
        return size

    def end_microbatch(self) -> None:
        self.training = 0

    def begin_optimizer(self) -> None:
        self.in_optimizer = True

    def end_optimizer(self) -> None:
        self.in_optimizer = False
