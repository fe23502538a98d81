"""Turn an application graph into concrete per-node request sets.

Input lengths come from the sources (distributions or files); output lengths are sampled
from each node's model eCDF (SamuLLM's sampling step). A downstream request's prompt
length is its template plus the sampled outputs it consumes, so nodes are built in
topological order. Everything is seeded: the same (app, seed) gives the same workload.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Optional

import numpy as np
from pydantic import ConfigDict, Field, ValidationError

from raycolo.catalog import ModelSpec, get_model
from raycolo.offline.costmodel.length_sampler import OutputLengthSampler
from raycolo.rng import seeded_rng
from raycolo.offline.dag import PLACEHOLDER, AppSpec, NodeSpec, SourceSpec
from raycolo.errors import ConfigError
from raycolo.lengths import sample_lengths
from raycolo.paths import check_input
from raycolo.bounds import MAX_CHUNKS, MAX_REQUESTS, MAX_TOKENS, Strict, Text, Tokens, describe

# Words-to-tokens ratio for text when no tokenizer is at hand (BPE tokenizers on English).
TOKENS_PER_WORD = 4 / 3
LAST_CHUNK_MIN_FRACTION = 0.3


def count_text_tokens(text: str) -> int:
    return int(round(len(text.split()) * TOKENS_PER_WORD))


def template_tokens(template: str) -> int:
    return count_text_tokens(PLACEHOLDER.sub(" ", template))


@dataclass
class SourceItems:
    """Items of one source: input tokens, and chunk counts for documents."""

    name: str
    input_tokens: np.ndarray
    chunks: np.ndarray
    chunk_tokens: int
    item_ids: np.ndarray  # global item ids


class RequestRow(Strict):
    """One row of a request file (jsonl or parquet): text, or a length, and chunks. Other
    columns (an ``id``, anything else) are the user's and pass through."""

    model_config = ConfigDict(extra="ignore")
    prompt: Optional[Text] = Field(default=None, description=(
        "The request's text. Where input_tokens is not given its length is counted as words × 4/3 tokens (no "
        "tokenizer is loaded); the runtime sends the text itself, split into chunks for a document."))
    input_tokens: Optional[Tokens] = Field(default=None, description=(
        "The request's prompt length in tokens; when given it is used instead of counting the prompt's words. "
        "Each row needs prompt or input_tokens."))
    chunks: Optional[Annotated[int, Field(ge=1, le=MAX_CHUNKS)]] = Field(default=None, description=(
        "Documents (chain summary): the number of chunks of the item, which a self-loop node processes one by "
        "one (empty: 1)."))


def _cell(value):
    """A cell as the row model reads it: empty (JSON null, a parquet NaN) is None, and a
    whole float (a parquet column with an empty cell is float) the integer it is."""
    if isinstance(value, (float, np.floating)) and not isinstance(value, bool):
        if math.isnan(value):
            return None
        if math.isfinite(value) and float(value).is_integer():
            return int(value)
        return float(value)
    return value.item() if isinstance(value, np.generic) else value


def request_row(row: dict, path: Path, number: int) -> RequestRow:
    """Row ``number`` (from 1) of ``path`` through :class:`RequestRow`; the error names the
    file, the row and the column."""
    try:
        return RequestRow.model_validate({k: _cell(row[k]) for k in RequestRow.model_fields if k in row})
    except ValidationError as exc:
        raise ConfigError(f"{path}: row {number}: {describe(exc)}") from None


def _not_json(name: str):
    raise ValueError(f"{name} is not a JSON number")


def read_request_rows(path: Path, limit: Optional[int] = None) -> list[dict]:
    """The rows of a jsonl or parquet request file, with clear errors for bad files."""
    check_input(path, "request file")
    rows: list[dict]
    if path.suffix == ".jsonl":
        rows = []
        try:
            raw_lines = path.read_bytes().splitlines()
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read request file: {exc.strerror}") from None
        for lineno, raw in enumerate(raw_lines, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise ConfigError(f"{path}:{lineno}: not UTF-8 text") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line, parse_constant=_not_json)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: {exc.msg}") from None
            except ValueError as exc:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: {exc}") from None
            except RecursionError:
                raise ConfigError(f"{path}:{lineno}: invalid JSON: nested too deeply") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{lineno}: each line must be a JSON object")
            rows.append(row)
    elif path.suffix == ".parquet":
        import pandas as pd
        try:
            rows = pd.read_parquet(path).to_dict("records")
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise ConfigError(f"{path}: cannot read parquet: {exc}") from None
    else:
        raise ConfigError(f"{path}: request files must be .jsonl or .parquet")
    if limit is not None:
        rows = rows[:limit]
    if not rows:
        raise ConfigError(f"{path}: no requests")
    return rows


def _read_request_file(path: Path, limit: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    rows = read_request_rows(path, limit)
    tokens, chunks = [], []
    for i, raw in enumerate(rows, 1):
        row = request_row(raw, path, i)
        if row.input_tokens is not None:
            tokens.append(row.input_tokens)
        elif row.prompt is not None:
            tokens.append(min(MAX_TOKENS, max(1, count_text_tokens(row.prompt))))
        else:
            raise ConfigError(f"{path}: row {i}: needs 'prompt' (text) or 'input_tokens'")
        chunks.append(row.chunks or 1)
    if sum(chunks) > MAX_REQUESTS:
        raise ConfigError(f"{path}: {sum(chunks)} chunks in all, more than the {MAX_REQUESTS} requests a run "
                          "may hold")
    return np.asarray(tokens, dtype=np.int64), np.asarray(chunks, dtype=np.int64)


def source_path(spec: SourceSpec, base_dir: Optional[str]) -> Path:
    """A source file's path; relative paths are relative to the application's YAML."""
    path = Path(spec.file)
    return Path(base_dir) / path if not path.is_absolute() and base_dir else path


def build_source(name: str, spec: SourceSpec, seed: int, first_id: int,
                 count_override: Optional[int], base_dir: Optional[str]) -> SourceItems:
    if spec.file is not None:
        tokens, chunks = _read_request_file(source_path(spec, base_dir), count_override)
    else:
        count = count_override or spec.count
        rng = seeded_rng(seed, "source", name)
        chunks = (sample_lengths(spec.chunks, count, rng) if spec.chunks is not None
                  else np.ones(count, dtype=np.int64))
        if spec.input_tokens is not None:
            tokens = sample_lengths(spec.input_tokens, count, rng)
        else:
            tokens = chunks * spec.chunk_tokens
    return SourceItems(name, tokens, chunks, spec.chunk_tokens,
                       np.arange(first_id, first_id + len(tokens), dtype=np.int64))


@dataclass
class NodeWorkload:
    """The requests one node will answer, with sampled output lengths.

    Requests are in FCFS order. ``successor[i]`` is the next chunk of a chain (-1 if
    none); ``chain_head[i]`` is false for requests that wait for a predecessor. ``deps``
    lists ``(upstream node, request index, upstream request index)`` arrays: a request is
    ready once every upstream request it names has finished.
    """

    name: str
    model: ModelSpec
    max_output: int
    input_len: np.ndarray
    output_len: np.ndarray
    item: np.ndarray
    successor: np.ndarray
    chain_head: np.ndarray
    terminal: np.ndarray
    deps: list[tuple[str, np.ndarray, np.ndarray]] = field(default_factory=list)
    plain_sampling: bool = True    # its requests take the plain argmax (DagNode.plain_sampling)

    def __len__(self) -> int:
        return len(self.input_len)

    @property
    def upstream(self) -> list[str]:
        return [d[0] for d in self.deps]

    @property
    def max_sequence(self) -> int:
        return int(min(self.model.context_length, (self.input_len + self.output_len).max()))

    @property
    def output_tokens(self) -> int:
        return int(self.output_len.sum())


@dataclass
class Workload:
    app: AppSpec
    seed: int
    sources: dict[str, SourceItems]
    nodes: dict[str, NodeWorkload]  # topological order

    @property
    def total_requests(self) -> int:
        return sum(len(n) for n in self.nodes.values())


@dataclass
class _Stream:
    """Inputs flowing into a node: one entry per upstream output (or source item)."""

    item: np.ndarray
    tokens: np.ndarray
    chunks: np.ndarray
    chunk_tokens: int
    upstream: Optional[str] = None
    upstream_index: Optional[np.ndarray] = None


def _route_partition(app: AppSpec, node: NodeSpec, items: np.ndarray, seed: int) -> np.ndarray:
    """Boolean mask of ``items`` routed to ``node`` among its 'route' siblings.

    Counts follow the weights exactly (largest remainder); which item goes where is a
    seeded permutation, identical for every sibling so that each item goes to one node.
    """
    inputs = app.inputs_of(node.name)
    siblings = [n for n in app.nodes if n.combine == "route" and app.inputs_of(n.name) == inputs]
    weights = np.array([s.route_weight for s in siblings], dtype=float)
    exact = weights / weights.sum() * len(items)
    counts = np.floor(exact).astype(int)
    for j in np.argsort(-(exact - counts), kind="stable")[: len(items) - counts.sum()]:
        counts[j] += 1
    order = seeded_rng(seed, "route", *inputs).permutation(len(items))
    k = [s.name for s in siblings].index(node.name)
    mine = order[counts[:k].sum(): counts[: k + 1].sum()]
    mask = np.zeros(len(items), dtype=bool)
    mask[mine] = True
    return mask


def _streams_for(app: AppSpec, node: NodeSpec, sources: dict[str, SourceItems],
                 built: dict[str, NodeWorkload]) -> list[_Stream]:
    streams = []
    for up in app.inputs_of(node.name):
        if up in sources:
            src = sources[up]
            streams.append(_Stream(src.item_ids, src.input_tokens, src.chunks, src.chunk_tokens))
        else:
            w = built[up]
            idx = np.flatnonzero(w.terminal)
            streams.append(_Stream(w.item[idx], w.output_len[idx], np.ones(len(idx), dtype=np.int64),
                                   0, up, idx))
    return streams


def _build_node(app: AppSpec, node: NodeSpec, sources: dict[str, SourceItems],
                built: dict[str, NodeWorkload], seed: int, ecdf_dir=None) -> NodeWorkload:
    model = get_model(node.model)
    fixed = template_tokens(node.prompt)
    streams = _streams_for(app, node, sources, built)

    # Requests before chain expansion: (item, input tokens, chunks, chunk tokens, deps).
    if node.combine == "concat":
        all_items = np.unique(np.concatenate([s.item for s in streams]))
        tokens = np.zeros(len(all_items), dtype=np.int64)
        chunks = np.ones(len(all_items), dtype=np.int64)
        chunk_tokens = 0
        dep_lists = []
        for s in streams:
            pos = np.searchsorted(all_items, s.item)
            np.add.at(tokens, pos, s.tokens)
            chunks[pos] = np.maximum(chunks[pos], s.chunks)
            chunk_tokens = max(chunk_tokens, s.chunk_tokens)
            if s.upstream is not None:
                dep_lists.append((s.upstream, pos, s.upstream_index))
        items = all_items
    else:
        parts = []
        for s in streams:
            keep = np.ones(len(s.item), dtype=bool)
            if node.combine == "route":
                keep = _route_partition(app, node, s.item, seed)
            parts.append((s, np.flatnonzero(keep)))
        items = np.concatenate([s.item[k] for s, k in parts])
        tokens = np.concatenate([s.tokens[k] for s, k in parts])
        chunks = np.concatenate([s.chunks[k] for s, k in parts])
        chunk_tokens = max(s.chunk_tokens for s, _ in parts)
        dep_lists, offset = [], 0
        for s, k in parts:
            if s.upstream is not None:
                dep_lists.append((s.upstream, np.arange(offset, offset + len(k)), s.upstream_index[k]))
            offset += len(k)

    try:
        sampler = OutputLengthSampler(model, ecdf_dir, greedy=node.greedy)
    except ConfigError as exc:          # the node names the field
        raise ConfigError(f"nodes[{node.name}].model: {exc}") from None
    rng = seeded_rng(seed, "output", node.name)
    room = model.context_length - 1
    if app.has_self_loop(node.name):
        return _build_chain(node, model, sampler, rng, items, tokens, chunks, chunk_tokens,
                            dep_lists, fixed, room, seed)

    reps = node.repeat
    base = len(items)
    items = np.tile(items, reps)
    input_len = np.minimum(np.tile(tokens, reps) + fixed, room)
    input_len = np.maximum(input_len, 1)
    output_len = sampler.sample(input_len, node.max_output_tokens, rng)
    deps = [(up, np.concatenate([req + r * base for r in range(reps)]), np.tile(upi, reps))
            for up, req, upi in dep_lists]
    n = len(items)
    return NodeWorkload(node.name, model, node.max_output_tokens, input_len, output_len, items,
                        np.full(n, -1, dtype=np.int64), np.ones(n, dtype=bool),
                        np.ones(n, dtype=bool), deps, node.plain_sampling)


def _build_chain(node, model, sampler, rng, items, tokens, chunks, chunk_tokens, dep_lists,
                 fixed, room, seed) -> NodeWorkload:
    """Expand a self-loop: item ``i`` becomes ``chunks[i]`` sequential requests."""
    chunk_tokens = chunk_tokens or int(max(1, tokens.max()))
    chunks = np.maximum(chunks, 1)
    size = int(chunks.sum())
    starts = np.concatenate([[0], np.cumsum(chunks)[:-1]])
    owner = np.repeat(np.arange(len(items)), chunks)
    position = np.arange(size) - starts[owner]
    last = position == chunks[owner] - 1
    # Document items: every chunk is full but the last, which is a seeded fraction of one.
    frac = seeded_rng(seed, "last-chunk", node.name).uniform(LAST_CHUNK_MIN_FRACTION, 1.0, len(items))
    doc = chunks > 1
    body = np.where(doc[owner], chunk_tokens, tokens[owner])
    body = np.where(last & doc[owner], np.maximum(1, (frac[owner] * chunk_tokens).astype(np.int64)), body)
    input_len = np.zeros(size, dtype=np.int64)
    output_len = np.zeros(size, dtype=np.int64)
    for step in range(int(chunks.max())):  # each step's prompt carries the previous summary
        at = np.flatnonzero(position == step)
        prev = output_len[at - 1] if step else 0
        input_len[at] = np.maximum(1, np.minimum(body[at] + fixed + prev, room))
        output_len[at] = sampler.sample(input_len[at], node.max_output_tokens, rng)
    successor = np.where(last, -1, np.arange(size) + 1).astype(np.int64)
    deps = [(up, starts[req], upi) for up, req, upi in dep_lists]  # inputs gate the first chunk
    return NodeWorkload(node.name, model, node.max_output_tokens, input_len, output_len,
                        items[owner], successor, position == 0, last, deps, node.plain_sampling)


def build_workload(app: AppSpec, seed: int = 0, requests: Optional[int] = None,
                   ecdf_dir: Optional[str | Path] = None) -> Workload:
    """Sample a concrete workload. ``requests`` overrides every source's count; eCDFs
    are read from ``ecdf_dir`` where it has one for a model (measured profiles)."""
    if requests is not None and requests <= 0:
        raise ConfigError(f"--requests: must be positive, got {requests}")
    sources, first = {}, 0
    for name, spec in app.sources.items():
        sources[name] = build_source(name, spec, seed, first, requests, app.base_dir)
        first += len(sources[name].input_tokens)
    built: dict[str, NodeWorkload] = {}
    for name in app.topological_order():
        built[name] = _build_node(app, app.node(name), sources, built, seed, ecdf_dir)
        if len(built[name]) == 0:
            raise ConfigError(f"nodes[{name}]: receives no requests")
    return Workload(app, seed, sources, built)
