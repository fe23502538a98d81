"""The training-sample store: append-only, fsynced before a sample is acknowledged.

A sample is a prompt plus a reference completion (token ids). :meth:`SampleStore.append`
writes a batch to ``samples.jsonl`` and fsyncs it before returning the samples' sequence
numbers, so an acknowledged sample survives any process's death. Training reads samples
in sequence order, one pass (epoch) at a time, each sample exactly once per epoch.

What has been trained is a *cursor* (epoch, next sequence number), saved with every
adapter checkpoint, not per sample: after a restart from a checkpoint the samples since
that checkpoint are trained again, and none is lost (the store keeps them all).

Pure Python (json, os): no Ray, no torch.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from raycolo.errors import ConfigError

SAMPLES_FILE = "samples.jsonl"
MAX_SAMPLE_TOKENS = 1 << 16


@dataclass(frozen=True)
class Sample:
    seq: int
    prompt: tuple[int, ...]
    completion: tuple[int, ...]


@dataclass(frozen=True)
class Cursor:
    """Where training stands: ``epoch`` (passes over the store so far) and ``next_seq``
    (the first sample of this epoch not yet handed to training)."""

    epoch: int = 0
    next_seq: int = 0


def _check_ids(name: str, ids, index: int) -> tuple[int, ...]:
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ConfigError(f"samples[{index}].{name}: must be a non-empty list of token ids")
    if len(ids) > MAX_SAMPLE_TOKENS:
        raise ConfigError(f"samples[{index}].{name}: at most {MAX_SAMPLE_TOKENS} tokens")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            raise ConfigError(f"samples[{index}].{name}: token ids must be non-negative integers")
    return tuple(ids)


class SampleStore:
    def __init__(self, directory):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"sample_store: cannot create {self.directory}: {exc.strerror}") from None
        self.path = self.directory / SAMPLES_FILE
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        if self.path.exists():
            self._load()
        try:
            self._file = open(self.path, "a", encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"sample_store: cannot write {self.path}: {exc.strerror}") from None

    def _load(self) -> None:
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                if not line.endswith("\n"):
                    break  # a torn last line was never acknowledged: drop it
                row = json.loads(line)
                self._samples.append(Sample(row["seq"], tuple(row["prompt"]), tuple(row["completion"])))

    def __len__(self) -> int:
        return len(self._samples)

    def append(self, samples: Iterable[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
        """Validate, persist (fsync) and return the sequence numbers of ``samples``."""
        checked = [(_check_ids("prompt", p, i), _check_ids("completion", c, i))
                   for i, (p, c) in enumerate(samples)]
        with self._lock:
            first = len(self._samples)
            rows = [Sample(first + i, p, c) for i, (p, c) in enumerate(checked)]
            text = "".join(json.dumps({"seq": s.seq, "prompt": list(s.prompt),
                                       "completion": list(s.completion)}) + "\n" for s in rows)
            try:
                self._file.write(text)
                self._file.flush()
                os.fsync(self._file.fileno())
            except OSError as exc:
                raise OSError(f"sample_store: {self.path}: {exc.strerror}; nothing was stored") from exc
            self._samples.extend(rows)
            return [s.seq for s in rows]

    def take(self, cursor: Cursor, count: int) -> tuple[list[Sample], Cursor]:
        """Up to ``count`` samples from ``cursor`` on, and the cursor after them. An epoch
        ends at the last stored sample; the next call starts the next epoch."""
        with self._lock:
            total = len(self._samples)
            if total == 0:
                return [], cursor
            if cursor.next_seq >= total:
                cursor = Cursor(cursor.epoch + 1, 0)
            end = min(total, cursor.next_seq + count)
            return self._samples[cursor.next_seq:end], Cursor(cursor.epoch, end)

    def get(self, seqs: Iterable[int]) -> list[Sample]:
        """The stored samples of ``seqs`` (to train again those a restart rolled back)."""
        with self._lock:
            return [self._samples[seq] for seq in seqs]

    def pending(self, cursor: Cursor) -> int:
        """Samples of the current epoch not yet handed to training."""
        return max(0, len(self._samples) - cursor.next_seq)

    def close(self) -> None:
        self._file.close()


def save_cursor(path, cursor: Cursor) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps({"epoch": cursor.epoch, "next_seq": cursor.next_seq}))
    os.replace(tmp, path)


def load_cursor(path) -> Optional[Cursor]:
    path = Path(path)
    if not path.exists():
        return None
    row = json.loads(path.read_text())
    return Cursor(int(row["epoch"]), int(row["next_seq"]))
