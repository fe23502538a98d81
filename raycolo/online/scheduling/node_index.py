"""Nodes kept in order of what LeMix ranks them on, so a decision need not plan every node.

LeMix (Algorithm 1 and eq. 3) plans an arriving task on every node and keeps the best
score: linear in nodes (1 ms per decision at 256 nodes of 2 stages). Most nodes cannot
win. Eq. 3 rewards a node that leaves little idle time (IP), answers soon (R) and has
run tasks of this length before (LC); all three are read from a few numbers per node:

* ``start``: when stage 0 finishes its last planned forward (or the node went idle).
  Nodes free just before the task's start leave the least idle time of those that can
  start it at once; nodes free just after it leave none and answer soonest among the
  busy ones. The node idle longest is there too: nodes idle past the SLO all score alike
  (their idle time is capped), so it stands for all of them.
* ``finish``: when the last stage finishes its last planned forward: eq. 4's "when the
  next inference could be answered" is the smallest of these.
* ``arrival``: when the last task placed on the node arrived. Eq. 1 forgives idle time
  up to the gap Δa since then, so a free node whose last task came long ago scores the
  best IP (-τ) at the least R: the node with the oldest last arrival is a candidate.
* ``free_lengths``: the mean allocated length of the nodes with two or more tasks whose
  planned forwards and backwards all end by the time the task's forward could reach the
  last stage (the pipeline overlaps a node's last task with the new one). Where IP ties
  (every node whose idle gap is under τ plus the arrival gap scores IP = -τ) and R is the
  least (the node can start at once), LC decides: the free nodes with the highest
  density N(ℓ; μ, σ), found by walking out from ℓ in mean order until no node further
  out can beat them (a node at distance d has N <= 1 / (d·√(2πe)), at σ = d), looking
  at ``LC_SCAN_LIMIT`` nodes at most. A node
  joins this order when the decisions' start time passes the end of its planned work (a
  heap of those times), and leaves it when its trace changes.

:class:`NodeIndex` keeps ``start`` and ``free_lengths`` as sorted lists (read around a
key) and ``finish`` and ``arrival`` as heaps with stale entries (only their smallest is
read), updated only for nodes whose trace changed since the last decision
(:meth:`NodeIndex.touch`); a decision then plans
O(window) candidates found by bisection. Keys are absolute times, so time passing
changes no key. With no more placeable nodes than :attr:`LemixParams.scan_nodes`,
LeMix plans them all as before (``raycolo/online/policies/lemix.py``).
"""
from __future__ import annotations

import heapq
from bisect import bisect_left, bisect_right
import math
from typing import Callable, Iterable, Optional

from raycolo.online.scheduling.allocation import length_consistency

NEG_INF = float("-inf")
LC_SCAN_LIMIT = 32           # free nodes a search for the best LC looks at, at most
DENSITY_AT_DISTANCE = 1 / math.sqrt(2 * math.pi * math.e)   # max over σ of N(d; 0, σ)·d


class SortedKeys:
    """Nodes in (key, node) order, one key per node, updated one node at a time (parallel
    lists: bisection compares floats, not tuples; among equal keys, by node, so a node is
    found in O(log n) even when many share a key, as every node does at the start)."""

    def __init__(self) -> None:
        self.keys: list[float] = []
        self.nodes: list[int] = []
        self.key: dict[int, float] = {}

    def _at(self, key: float, node: int) -> int:
        keys = self.keys
        lo = bisect_left(keys, key)
        return bisect_left(self.nodes, node, lo, bisect_right(keys, key, lo))

    def set(self, node: int, key: Optional[float]) -> None:
        """Node ``node`` now has ``key`` (None: leaves the order)."""
        old = self.key.get(node)
        if old == key:
            return
        keys, nodes = self.keys, self.nodes
        if old is not None:
            i = self._at(old, node)
            del keys[i], nodes[i]
            del self.key[node]
        if key is not None:
            self.key[node] = key
            i = self._at(key, node)
            keys.insert(i, key)
            nodes.insert(i, node)

    def __len__(self) -> int:
        return len(self.keys)


class LazyMin:
    """Nodes by a key, smallest first, where only the first few are ever read: a heap
    whose entries go stale when a node's key changes (found stale on the way out), so a
    change costs one push rather than a removal and an insertion in a sorted list."""

    def __init__(self, keys: Optional[dict] = None) -> None:
        self.key: dict[int, float] = dict(keys or {})
        self.heap: list[tuple[float, int]] = sorted((k, n) for n, k in self.key.items())

    def set(self, node: int, key: Optional[float]) -> None:
        """Node ``node`` now has ``key`` (None: leaves the order)."""
        if key is None:
            self.key.pop(node, None)
            return
        if self.key.get(node) == key:
            return
        self.key[node] = key
        heapq.heappush(self.heap, (key, node))
        if len(self.heap) > 4 * len(self.key) + 64:          # stale entries of re-keyed nodes
            self.heap = sorted((k, n) for n, k in self.key.items())

    def first(self, ok: Callable[[int], bool], exclude: Optional[int] = None) -> Optional[tuple[float, int]]:
        """The (key, node) with the smallest key among nodes passing ``ok``, ``exclude``
        left out (None: no such node); ties go to the lowest node, as in a sorted list."""
        heap, key = self.heap, self.key
        passed: list = []                 # valid entries that ``ok`` or ``exclude`` turned away
        found = None
        while heap:
            k, n = heap[0]
            if key.get(n) != k:
                heapq.heappop(heap)       # stale
                continue
            if n != exclude and ok(n):
                found = heap[0]
                break
            passed.append(heapq.heappop(heap))
        for entry in passed:
            heapq.heappush(heap, entry)
        return found


def _walk(nodes: list, start: int, step: int, ok: Callable[[int], bool], want: int, out: set) -> None:
    """Add to ``out`` up to ``want`` nodes that pass ``ok``, from ``nodes[start]`` in
    direction ``step``."""
    i, found, end = start, 0, len(nodes)
    while 0 <= i < end and found < want:
        node = nodes[i]
        if ok(node):
            out.add(node)
            found += 1
        i += step


class NodeIndex:
    def __init__(self, nodes: int) -> None:
        self.start = SortedKeys()
        self.finish = LazyMin(dict.fromkeys(range(nodes), NEG_INF))   # read for its smallest only
        self.arrival = LazyMin()
        self.free_lengths = SortedKeys()
        self.freeing: list[tuple[float, int]] = []     # (free key, node) of nodes not yet free
        self.free_key: dict[int, float] = {}            # when the node's planned work ends
        self.spread: dict[int, tuple] = {}              # node -> (count, mean, std) of its lengths
        # every node starts idle from 0 with no task: keyed so without a refresh each
        self.start.keys, self.start.nodes = [0.0] * nodes, list(range(nodes))
        self.start.key = dict.fromkeys(range(nodes), 0.0)
        self.free_key = dict.fromkeys(range(nodes), 0.0)
        self.spread = dict.fromkeys(range(nodes), (0, 0.0, 0.0))
        self.dirty: set[int] = set()

    def touch(self, node: int) -> None:
        """Node ``node``'s trace changed (a task committed or reset, a path calibrated)."""
        self.dirty.add(node)

    def refresh(self, traces, at: float) -> None:
        """Re-key the nodes touched since the last refresh from their traces, and move
        the nodes free by ``at`` into ``free_lengths`` (``at``: when the task's forward
        could reach the last stage, so a node still finishing its last task there as the
        task starts counts as free: the pipeline overlaps them)."""
        free_lengths = self.free_lengths
        for n in self.dirty:
            trace = traces[n]
            last = trace.last
            if last is not None:
                self.start.set(n, last.stages[0].end_f)
                self.finish.set(n, last.stages[-1].end_f)
                self.arrival.set(n, last.arrival_s)
            else:
                self.start.set(n, trace.idle_since)
                self.finish.set(n, NEG_INF)
                self.arrival.set(n, None)
            if n in free_lengths.key:
                free_lengths.set(n, None)
            self.free_key[n] = free = trace.busy_until()
            self.spread[n] = (trace.count, trace.length_mean, trace.length_std)
            if trace.count >= 2:
                heapq.heappush(self.freeing, (free, n))
        self.dirty.clear()
        while self.freeing and self.freeing[0][0] <= at:
            key, n = heapq.heappop(self.freeing)
            if self.free_key.get(n) == key and n not in self.free_lengths.key:   # not re-keyed since
                self.free_lengths.set(n, self.spread[n][1])
        if len(self.freeing) > 4 * len(self.start) + 64:    # stale entries of re-keyed nodes
            self.freeing = [(k, n) for k, n in self.freeing
                            if self.free_key.get(n) == k and n not in self.free_lengths.key]
            heapq.heapify(self.freeing)

    def candidates(self, at: float, length: int, ok: Callable[[int], bool], window: int,
                   near: int) -> set[int]:
        """The nodes worth planning for a task that could start at ``at`` with ``length``
        tokens (after :meth:`refresh` with the same ``at``): ``window`` freed last before
        ``at`` and ``window`` freed first after it, the one idle longest, the one whose
        last task arrived longest ago, and the ``near`` free ones with the best LC. Only nodes that pass ``ok``
        (placeable)."""
        nodes = self.start.nodes
        cut = bisect_right(self.start.keys, at)
        found: set[int] = set()
        _walk(nodes, cut - 1, -1, ok, window, found)
        _walk(nodes, cut, +1, ok, window, found)
        _walk(nodes, 0, +1, ok, 1, found)
        oldest = self.arrival.first(ok)
        if oldest is not None:
            found.add(oldest[1])
        found.update(self._nearest(length, ok, near))
        return found

    def _nearest(self, length: int, ok: Callable[[int], bool], want: int) -> Iterable[int]:
        """The ``want`` free nodes with the highest LC for ``length`` (see the module)."""
        if want <= 0:
            return []
        means, nodes = self.free_lengths.keys, self.free_lengths.nodes
        hi = bisect_left(means, length)
        lo = hi - 1
        end = len(means)
        best: list[tuple[float, int]] = []          # (LC, node), the top ``want``
        for _ in range(LC_SCAN_LIMIT):
            if lo < 0 and hi >= end:
                break
            take_hi = lo < 0 or (hi < end and means[hi] - length <= length - means[lo])
            i = hi if take_hi else lo
            mean, node = means[i], nodes[i]
            hi, lo = (hi + 1, lo) if take_hi else (hi, lo - 1)
            distance = abs(mean - length)
            if len(best) == want and distance > 0 and DENSITY_AT_DISTANCE / distance <= best[0][0]:
                break                  # nobody this far out (or further) beats the top ``want``
            if not ok(node):
                continue
            count, mean, std = self.spread[node]
            lc = length_consistency(length, count, mean, std)
            if len(best) < want:
                heapq.heappush(best, (lc, node))
            elif lc > best[0][0]:
                heapq.heapreplace(best, (lc, node))
        return [node for _, node in best]

    def earliest_finish(self, ok: Callable[[int], bool], exclude: int) -> Optional[float]:
        """The smallest ``finish`` key among nodes passing ``ok``, ``exclude`` left out
        (None: no such node)."""
        first = self.finish.first(ok, exclude)
        return first[0] if first is not None else None
