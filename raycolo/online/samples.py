"""The training-sample store: append-only, fsynced before a sample is acknowledged.

A sample is a prompt plus a reference completion (token ids), or a preference pair: a
prompt, the chosen completion and the rejected one (trained with the DPO loss; the
chosen one is kept as ``completion``). :meth:`SampleStore.append`
writes a batch to ``samples.jsonl`` and fsyncs it before returning the samples' sequence
numbers, so an acknowledged sample survives any process's death. Training reads samples
in sequence order, one pass (epoch) at a time, each sample exactly once per epoch.

What has been trained is a *cursor* (epoch, next sequence number), saved with every
adapter checkpoint, not per sample: after a restart from a checkpoint the samples since
that checkpoint are trained again, and none is lost (the store keeps them all).

Several processes may write one store: the controller, and an HTTP replica while the
controller restarts (docs/online-live.md). Each append holds an exclusive ``flock`` on
``samples.lock`` in the store's directory, reads what others appended since (so sequence
numbers stay dense and in file order), then writes and fsyncs; readers take what others
wrote when they next look (:meth:`SampleStore.pending`, :meth:`SampleStore.take`). A
batch may carry a *post key*: appending a key the store holds already returns the
sequence numbers stored under it and stores nothing, so a writer that does not know
whether its batch was stored (its call to the controller failed) can send it again.

Pure Python (json, os, fcntl): no Ray, no torch.
"""
from __future__ import annotations

import fcntl
import json
import os
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence

from raycolo.errors import ConfigError, StoreFull  # noqa: F401  (StoreFull: raised by append)
from raycolo.journal import Journal

SAMPLES_FILE = "samples.jsonl"
LOCK_FILE = "samples.lock"
MAX_SAMPLE_TOKENS = 1 << 16


@dataclass(frozen=True)
class Sample:
    seq: int
    prompt: tuple[int, ...]
    completion: tuple[int, ...]          # the reference completion; of a pair, the chosen one
    rejected: tuple[int, ...] = ()       # a preference pair's rejected completion; () otherwise

    @property
    def is_pair(self) -> bool:
        return bool(self.rejected)

    def ids(self) -> tuple:
        """(prompt, completion) or (prompt, chosen, rejected): what training takes."""
        return (self.prompt, self.completion, self.rejected) if self.rejected else (self.prompt, self.completion)


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


def _check_sample(sample, index: int) -> tuple:
    if not isinstance(sample, (list, tuple)) or len(sample) not in (2, 3):
        raise ConfigError(f"samples[{index}]: must be (prompt, completion) or (prompt, chosen, rejected)")
    names = ("prompt", "completion") if len(sample) == 2 else ("prompt", "chosen", "rejected")
    ids = tuple(_check_ids(name, part, index) for name, part in zip(names, sample))
    if len(ids) == 3 and ids[1] == ids[2]:
        raise ConfigError(f"samples[{index}].rejected: must differ from chosen")
    return ids


def _row(sample: Sample, post: Optional[str]) -> dict:
    row = {"seq": sample.seq, "prompt": list(sample.prompt), "completion": list(sample.completion)}
    if sample.rejected:
        row["rejected"] = list(sample.rejected)
    if post is not None:
        row["post"] = post
    return row


def training_rows(samples: Sequence[Sequence[Sequence[int]]]) -> tuple[list[tuple], bool]:
    """A micro-batch's rows (prompt, completion), and whether it is preference pairs:
    ``(prompt, completion)`` samples are one row each; ``(prompt, chosen, rejected)`` pairs
    give the chosen rows, then the rejected rows. A micro-batch is all of one kind."""
    kinds = {len(s) for s in samples}
    if kinds == {2}:
        return [(p, c) for p, c in samples], False
    if kinds == {3}:
        return [(p, c) for p, c, _ in samples] + [(p, r) for p, _, r in samples], True
    raise ValueError("a training micro-batch holds (prompt, completion) samples or "
                     "(prompt, chosen, rejected) pairs, not both")


def clip_sample(sample: Sequence[Sequence[int]], max_len: int) -> tuple[list[int], ...]:
    """A sample cut to ``max_len`` tokens per row: the prompt first, then each completion."""
    prompt = list(sample[0])[:max_len]
    return (prompt, *[list(c)[:max(0, max_len - len(prompt))] for c in sample[1:]])


class SampleStore:
    def __init__(self, directory):
        self.directory = Path(directory)
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._lock_file = open(self.directory / LOCK_FILE, "a")
        except OSError as exc:
            raise ConfigError(f"sample_store: cannot create {self.directory}: {exc.strerror}") from None
        self.path = self.directory / SAMPLES_FILE
        self._lock = threading.Lock()
        self._samples: list[Sample] = []
        self._posts: dict[str, list[int]] = {}     # post key -> the seqs stored under it
        self._read = 0                             # bytes of the file in _samples
        self.path.touch()
        with self._lock, self._locked(fcntl.LOCK_EX):
            self._catch_up(repair=True)
        self._journal = Journal(self.path, "sample_store")

    @contextmanager
    def _locked(self, kind: int):
        fcntl.flock(self._lock_file.fileno(), kind)
        try:
            yield
        finally:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)

    def _catch_up(self, repair: bool) -> None:
        """Read the rows appended since this instance last looked (under the file lock). A
        last line without its newline was never acknowledged (its writer died mid-write):
        with ``repair`` (the exclusive lock) it is cut, so the next append starts a line of
        its own."""
        with open(self.path, "rb") as f:
            f.seek(self._read)
            text = f.read()
        whole = text[:text.rfind(b"\n") + 1]
        for line in whole.splitlines():
            row = json.loads(line)
            sample = Sample(len(self._samples), tuple(row["prompt"]), tuple(row["completion"]),
                            tuple(row.get("rejected", ())))
            self._samples.append(sample)
            if "post" in row:
                self._posts.setdefault(row["post"], []).append(sample.seq)
        self._read += len(whole)
        if repair and len(text) > len(whole):
            try:
                os.truncate(self.path, self._read)
            except OSError as exc:
                raise ConfigError(f"sample_store: cannot repair {self.path}: {exc.strerror}") from None

    def _refresh(self) -> None:
        """Take what other writers appended (a stat when there is nothing new)."""
        if self.path.stat().st_size > self._read:
            with self._locked(fcntl.LOCK_SH):
                self._catch_up(repair=False)

    def __len__(self) -> int:
        with self._lock:
            self._refresh()
            return len(self._samples)

    def append(self, samples: Iterable[Sequence[Sequence[int]]], post: Optional[str] = None) -> list[int]:
        """Validate, persist (fsync) and return the sequence numbers of ``samples``: each
        ``(prompt, completion)`` or a preference pair ``(prompt, chosen, rejected)``. With a
        ``post`` key stored already, the sequence numbers it got then (nothing is stored)."""
        checked = [_check_sample(sample, i) for i, sample in enumerate(samples)]
        with self._lock, self._locked(fcntl.LOCK_EX):
            self._catch_up(repair=True)
            if post is not None and post in self._posts:
                return list(self._posts[post])
            if not checked:
                return []
            first = len(self._samples)
            rows = [Sample(first + i, *ids) for i, ids in enumerate(checked)]
            text = "".join(json.dumps(_row(s, post)) + "\n" for s in rows)
            self._journal.append(text, self._read)     # or StoreFull, with nothing of it kept
            self._samples.extend(rows)
            self._read += len(text.encode())
            if post is not None:
                self._posts[post] = [s.seq for s in rows]
            return [s.seq for s in rows]

    def take(self, cursor: Cursor, count: int) -> tuple[list[Sample], Cursor]:
        """Up to ``count`` samples from ``cursor`` on, and the cursor after them. An epoch
        ends at the last stored sample; the next call starts the next epoch."""
        with self._lock:
            self._refresh()
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
        return max(0, len(self) - cursor.next_seq)

    def close(self) -> None:
        self._journal.close()
        self._lock_file.close()


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


class TrainingLedger:
    """Which acknowledged samples the nodes' adapters keep, across checkpoints and
    worker-group restarts (pure: no Ray, no clock).

    A node trains samples in order. A checkpoint *reported* at some point holds everything
    the node trained before it; once *committed* (Ray Train may commit a report later, or
    never, if the group dies first) only what came after it can be lost. When the group
    restarts, the adapter rolls back to the checkpoint the new group restored: the samples
    that checkpoint does not hold are handed back to be trained again.
    """

    def __init__(self, nodes: int):
        self.trained: dict[int, int] = {}        # seq -> trainings the adapters keep
        self.since = [[] for _ in range(nodes)]  # seqs trained since the last committed checkpoint
        self.base = [0] * nodes                  # seqs the node trained before since[n][0]
        self.reported: dict[tuple[int, int], int] = {}   # (node, version) -> seqs trained it holds
        self.version = [0] * nodes               # last committed checkpoint per node
        self.kept = [[] for _ in range(nodes)]   # seqs in the node's last committed checkpoint
        self._lost: dict[int, tuple] = {}        # node -> (seqs, base, reported) until it restores

    def train(self, node: int, seqs: Iterable[int]) -> None:
        for seq in seqs:
            self.trained[seq] = self.trained.get(seq, 0) + 1
            self.since[node].append(seq)

    def report(self, node: int, version: int) -> None:
        """Checkpoint ``version`` of ``node`` was taken now (nothing trained meanwhile)."""
        self.reported[(node, version)] = self.base[node] + len(self.since[node])

    def uncommitted(self, node: int, version: int) -> None:
        """Ray Train did not commit checkpoint ``version`` of ``node``: it holds nothing for good."""
        self.reported.pop((node, version), None)

    def commit(self, node: int, version: int) -> None:
        """Ray Train committed checkpoint ``version``: what it holds is kept for good."""
        end = self.reported.pop((node, version), None)
        if end is None:
            return
        cut = end - self.base[node]
        if cut > 0:
            self.kept[node].extend(self.since[node][:cut])
            del self.since[node][:cut]
            self.base[node] = end
        self.version[node] = max(self.version[node], version)

    def lose(self, node: int) -> None:
        """The node's group is gone: what it trained since its last committed checkpoint no
        longer counts, until :meth:`restore` says which checkpoint came back."""
        seqs, base = self.since[node], self.base[node]
        self.since[node], self.base[node] = [], base + len(seqs)
        held = {v: end for (n, v), end in self.reported.items() if n == node}
        for v in held:
            del self.reported[(node, v)]
        for seq in seqs:
            self.trained[seq] -= 1
        earlier, earlier_base, earlier_held = self._lost.pop(node, ([], base, {}))  # a restart that never completed
        self._lost[node] = (earlier + seqs, earlier_base, {**earlier_held, **held})

    def restore(self, node: int, version: Optional[int]) -> list[int]:
        """The node's new group restored checkpoint ``version`` (normally the last
        committed; it may be a later one whose commit was not reported yet): returns the
        samples to train again, those that checkpoint does not hold."""
        seqs, base, held = self._lost.pop(node, ([], 0, {}))
        keep = max(0, min(len(seqs), held[version] - base)) if version in held else 0
        for seq in seqs[:keep]:
            self.trained[seq] += 1
        self.kept[node].extend(seqs[:keep])
        if version in held:
            self.version[node] = version
        return seqs[keep:]

    def abandon(self, node: int) -> list[int]:
        """The node is gone for good: everything lost on it is to be trained elsewhere."""
        return self._lost.pop(node, ([], 0, {}))[0]

    def restoring(self, node: int) -> bool:
        return node in self._lost

    def holds(self, node: int) -> list[int]:
        """The seqs the node's adapter holds now (what a checkpoint taken now keeps)."""
        return self.kept[node] + self.since[node]

    def resume(self, node: int, version: int, seqs: Sequence[int]) -> None:
        """A new deployment's node restored checkpoint ``version`` of an earlier one, which
        holds ``seqs``."""
        for seq in seqs:
            self.trained[seq] = self.trained.get(seq, 0) + 1
        self.kept[node], self.base[node], self.version[node] = list(seqs), len(seqs), version


def to_ranges(seqs: Iterable[int]) -> list[list[int]]:
    """Sorted distinct seqs as ``[start, end)`` runs (a checkpoint stores them so)."""
    runs: list[list[int]] = []
    for seq in sorted(set(seqs)):
        if runs and runs[-1][1] == seq:
            runs[-1][1] += 1
        else:
            runs.append([seq, seq + 1])
    return runs


def from_ranges(runs: Iterable[Sequence[int]]) -> list[int]:
    return [seq for start, end in runs for seq in range(int(start), int(end))]


@dataclass(frozen=True)
class Resumption:
    """What a deployment restarted on an earlier one's sample store and checkpoints takes
    up: the adapter version to count on from, where training stands, and the stored
    samples no restored checkpoint holds (to train now)."""

    adapter_version: int
    cursor: Cursor
    held: int
    pending: list[int]


def plan_resumption(restored: dict[int, tuple[int, list[int], Cursor]], stored: int) -> Resumption:
    """``restored``: node -> (adapter version, seqs its checkpoint holds, cursor saved with
    it) for the nodes that restored a checkpoint; ``stored``: samples in the store. In the
    first pass over the store every sample no node holds is pending; in a later pass, the
    samples from the newest checkpoint's cursor on."""
    version = max((v for v, _, _ in restored.values()), default=0)
    held = set()
    for _, seqs, _ in restored.values():
        held.update(seqs)
    epoch = max((c.epoch for _, _, c in restored.values()), default=0)
    if epoch == 0:
        pending = [seq for seq in range(stored) if seq not in held]
    else:
        newest = max(c.next_seq for _, _, c in restored.values() if c.epoch == epoch)
        pending = list(range(min(newest, stored), stored))
    return Resumption(version, Cursor(epoch, stored), len(held), pending)
