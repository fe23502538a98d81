"""Passing outputs between the nodes of an application graph.

The request set is the planner's: request ``i`` of node ``n`` in the sampled workload is
request ``n:i`` at run time, with the same dependencies (``deps``), chain successors and
items. A request becomes ready when every upstream output it names exists and, in a
chain, when the previous part's output exists; its prompt is then rendered from the
node's template:

* ``{input}``: all of the request's inputs, joined by blank lines;
* ``{<name>}``: one input, by source or node name (several outputs of one node, e.g. a
  ``repeat``, are joined);
* in a chain: ``{chunk}``, the current part of the document, and ``{previous}``, the
  previous step's output (empty for the first part).

Inputs that would overflow the model's context are shortened, each in proportion to its
length, so that the template itself is kept. Pure Python: the Ray controller drives it.
"""
from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import numpy as np

from raycolo.offline.dag import PLACEHOLDER, AppSpec
from raycolo.generation import SamplingParams
from raycolo.generation.params import MAX_SEED
from raycolo.offline.runtime.texts import SourceTexts, Tokenizer
from raycolo.offline.workload import Workload

JOIN = "\n\n"
MIN_PROMPT_TOKENS = 1


def request_key(node: str, index: int) -> str:
    return f"{node}:{index}"


def request_seed(seed: int, node: str, index: int) -> int:
    """A per-request sampling seed that does not depend on batching or on which replica
    runs it, so a request that runs again (restart, resume) samples the same way."""
    return (zlib.crc32(f"{seed}/{node}/{index}".encode()) & 0x7FFFFFFF)


@dataclass
class ReadyRequest:
    key: str
    node: str
    index: int
    item: int
    prompt: str
    params: SamplingParams   # the node's sampling, its max_tokens and seed (raycolo.offline.dag.NodeSpec.sampling_params)

    def sampling(self, generated: int = 0) -> SamplingParams:
        """Its SamplingParams, continued after ``generated`` tokens ran elsewhere (a
        preempted or moved request; its draws then take seed + generated)."""
        if not generated:
            return self.params
        return self.params.remaining(generated).model_copy(
            update={"seed": (self.params.seed + generated) & MAX_SEED})


class Communicator:
    def __init__(self, app: AppSpec, workload: Workload, texts: SourceTexts,
                 tokenizers: dict[str, Tokenizer], seed: int, contexts: Optional[dict[str, int]] = None):
        """``contexts``: node -> its checkpoint's context, where shorter than its catalog model's."""
        self.app = app
        self.contexts = contexts or {}
        self.workload = workload
        self.texts = texts
        self.tokenizers = tokenizers
        self.seed = seed
        self.outputs: dict[str, dict[int, str]] = {n: {} for n in workload.nodes}
        # request -> the upstream outputs it consumes; upstream output -> its consumers
        self.inputs_of: dict[str, dict[int, list[tuple[str, int]]]] = {}
        self.consumers: dict[tuple[str, int], list[tuple[str, int]]] = defaultdict(list)
        self.unmet: dict[str, np.ndarray] = {}
        for name, w in workload.nodes.items():
            inputs: dict[int, list[tuple[str, int]]] = defaultdict(list)
            unmet = np.zeros(len(w), dtype=np.int64)
            for up, req, upi in w.deps:
                for i, j in zip(req.tolist(), upi.tolist()):
                    inputs[i].append((up, j))
                    self.consumers[(up, j)].append((name, i))
                    unmet[i] += 1
            self.inputs_of[name] = inputs
            self.unmet[name] = unmet
        self.position = {}  # chain nodes: each request's part number within its item
        for name, w in workload.nodes.items():
            if (w.successor >= 0).any():
                pos = np.zeros(len(w), dtype=np.int64)
                for i in range(1, len(w)):
                    pos[i] = 0 if w.chain_head[i] else pos[i - 1] + 1
                self.position[name] = pos

    # -- progress -------------------------------------------------------------------
    @property
    def total(self) -> int:
        return self.workload.total_requests

    @property
    def done(self) -> int:
        return sum(len(o) for o in self.outputs.values())

    def node_done(self, node: str) -> np.ndarray:
        mask = np.zeros(len(self.workload.nodes[node]), dtype=bool)
        mask[list(self.outputs[node])] = True
        return mask

    def node_finished(self, node: str) -> bool:
        return len(self.outputs[node]) == len(self.workload.nodes[node])

    def _is_ready(self, node: str, i: int) -> bool:
        w = self.workload.nodes[node]
        if i in self.outputs[node] or self.unmet[node][i]:
            return False
        return bool(w.chain_head[i]) or (i - 1) in self.outputs[node]

    # -- the data flow ----------------------------------------------------------------
    def _record(self, node: str, index: int, text: str) -> list[tuple[str, int]]:
        """Store an output; return the requests it may have made ready."""
        if index in self.outputs[node]:
            raise RuntimeError(f"request {request_key(node, index)} completed twice")
        self.outputs[node][index] = text
        woken = []
        for consumer in self.consumers.get((node, index), ()):
            self.unmet[consumer[0]][consumer[1]] -= 1
            woken.append(consumer)
        succ = int(self.workload.nodes[node].successor[index])
        if succ >= 0:
            woken.append((node, succ))
        return woken

    def restore(self, finished: Iterable[tuple[str, int, str]]) -> None:
        """Outputs of an earlier run of the same job (resume)."""
        for node, index, text in finished:
            self._record(node, index, text)

    def initial(self) -> list[ReadyRequest]:
        """Every request ready now (at the start, or after :meth:`restore`)."""
        return [self.render(n, i) for n, w in self.workload.nodes.items()
                for i in range(len(w)) if self._is_ready(n, i)]

    def complete(self, node: str, index: int, text: str) -> list[ReadyRequest]:
        """Record an output and return the requests it makes ready, rendered."""
        return [self.render(n, i) for n, i in self._record(node, index, text) if self._is_ready(n, i)]

    # -- prompts ----------------------------------------------------------------------
    def values(self, node: str, index: int, upstream_text: bool = True) -> dict[str, str]:
        """The placeholder values of one request (node inputs empty if not ``upstream_text``)."""
        w = self.workload.nodes[node]
        item = int(w.item[index])
        by_input: dict[str, list[str]] = defaultdict(list)
        for up, j in self.inputs_of[node].get(index, ()):
            by_input[up].append(self.outputs[up].get(j, "") if upstream_text else "")
        values = {}
        for name in self.app.inputs_of(node):
            if name in self.app.sources:
                if self.texts.source_of.get(item) == name:
                    values[name] = (self.texts.parts[item][self.position[node][index]]
                                    if node in self.position else self.texts.text(item))
            elif name in by_input:
                values[name] = JOIN.join(by_input[name])
        if node in self.position:
            values["chunk"] = JOIN.join(values.values())
            first = bool(w.chain_head[index])
            values["previous"] = "" if first or not upstream_text else self.outputs[node].get(index - 1, "")
        values["input"] = JOIN.join(v for k, v in values.items() if k not in ("chunk", "previous"))
        return values

    def fill(self, node: str, values: dict[str, str]) -> str:
        template = self.app.node(node).prompt
        return PLACEHOLDER.sub(lambda m: values.get(m.group(1), ""), template)

    def prompt_budget(self, node: str) -> tuple[int, int]:
        """(maximum prompt tokens, maximum output tokens) of a node's requests."""
        spec = self.app.node(node)
        context = min(self.workload.nodes[node].model.context_length, self.contexts.get(node, 1 << 62))
        max_tokens = min(spec.max_output_tokens, context - MIN_PROMPT_TOKENS)
        return context - max_tokens, max_tokens

    def render(self, node: str, index: int) -> ReadyRequest:
        values = self.values(node, index)
        tokenizer = self.tokenizers[node]
        limit, max_tokens = self.prompt_budget(node)
        prompt = self.fill(node, values)
        if len(tokenizer.encode(prompt)) > limit:
            prompt = self._shortened(node, values, limit)
        w = self.workload.nodes[node]
        spec = self.app.node(node)
        seed = request_seed(self.seed if spec.seed is None else spec.seed, node, index)
        return ReadyRequest(request_key(node, index), node, index, int(w.item[index]), prompt,
                            spec.sampling_params(max_tokens, seed))

    def _shortened(self, node: str, values: dict[str, str], limit: int) -> str:
        """The prompt with every input cut to the same fraction of its text, the largest
        fraction (to 1/4096) whose prompt fits ``limit`` tokens (any tokenizer: a search,
        not a guess of characters per token)."""
        def fill(keep: float) -> str:
            return self.fill(node, {k: v[: int(len(v) * keep)] for k, v in values.items()})

        tokenizer = self.tokenizers[node]
        low, high = 0.0, 1.0
        for _ in range(12):
            mid = (low + high) / 2
            if len(tokenizer.encode(fill(mid))) <= limit:
                low = mid
            else:
                high = mid
        return fill(low)

    def planned_input_lengths(self) -> dict[str, np.ndarray]:
        """Prompt lengths in tokens as the runtime will really build them: the template
        and source text measured with the node's tokenizer, plus the sampled output
        lengths of the upstream requests (and the previous chain step) it consumes."""
        lengths = {}
        for node, w in self.workload.nodes.items():
            tokenizer = self.tokenizers[node]
            limit, _ = self.prompt_budget(node)
            out = np.zeros(len(w), dtype=np.int64)
            for i in range(len(w)):
                base = len(tokenizer.encode(self.fill(node, self.values(node, i, upstream_text=False))))
                carried = sum(int(self.workload.nodes[up].output_len[j])
                              for up, j in self.inputs_of[node].get(i, ()))
                if node in self.position and not w.chain_head[i]:
                    carried += int(w.output_len[i - 1])
                out[i] = min(limit, base + carried)
            lengths[node] = out
        return lengths
