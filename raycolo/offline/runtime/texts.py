"""The text an application starts from: prompts of request files, or seeded synthetic text.

A source that gives only counts and lengths (``count`` plus ``input_tokens`` or
``chunks``) gets deterministic pseudo-English of the sampled lengths, so a run needs no
dataset. A document (``chunks``) is a list of parts; every part but the last is
``chunk_tokens`` long. A request-file row with ``chunks: k`` has its prompt split into
``k`` parts of nearly equal word counts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from raycolo.rng import seeded_rng
from raycolo.offline.dag import AppSpec
from raycolo.errors import ConfigError
from raycolo.offline.workload import LAST_CHUNK_MIN_FRACTION, Workload, read_request_rows, source_path

_WORDS = ("the of and to in is was that for on with as by at from his her they it this which "
          "story river night city garden letter morning voice window history silence winter "
          "old small quiet bright distant early strange careful open green heavy long "
          "walked found opened wrote carried remembered watched asked heard turned followed").split()


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...


def synthetic_text(tokens: int, rng: np.random.Generator, tokenizer: Tokenizer) -> str:
    """Seeded words whose encoding is as close to ``tokens`` long as whole words allow."""
    words = [_WORDS[i] for i in rng.integers(0, len(_WORDS), max(1, tokens))]
    lo, hi = 1, len(words)
    while lo < hi:  # fewest words reaching the length (encodings grow with words)
        mid = (lo + hi) // 2
        if len(tokenizer.encode(" ".join(words[:mid]))) >= tokens:
            hi = mid
        else:
            lo = mid + 1
    return " ".join(words[:lo])


def split_words(text: str, parts: int) -> list[str]:
    words = text.split()
    bounds = np.linspace(0, len(words), parts + 1).round().astype(int)
    return [" ".join(words[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


@dataclass
class SourceTexts:
    """Text of every source item, as parts (one part unless the item is a document)."""

    parts: dict[int, list[str]]   # global item id -> parts
    source_of: dict[int, str]     # global item id -> source name
    row_ids: dict[int, object]    # global item id -> the row's own 'id' where a file gives one

    def text(self, item: int) -> str:
        return " ".join(self.parts[item])


def build_source_texts(app: AppSpec, workload: Workload, tokenizer: Tokenizer) -> SourceTexts:
    """Texts for ``workload``'s source items, in its item numbering."""
    parts: dict[int, list[str]] = {}
    source_of: dict[int, str] = {}
    row_ids: dict[int, object] = {}
    for name, items in workload.sources.items():
        spec = app.sources[name]
        rows = (read_request_rows(source_path(spec, app.base_dir), len(items.item_ids))
                if spec.file is not None else None)
        rng = seeded_rng(workload.seed, "text", name)
        for k, item in enumerate(items.item_ids.tolist()):
            source_of[item] = name
            chunks = int(items.chunks[k])
            prompt = rows[k].get("prompt") if rows is not None else None
            if rows is not None and "id" in rows[k]:
                row_ids[item] = rows[k]["id"]
            if isinstance(prompt, str):
                if chunks > len(prompt.split()):
                    raise ConfigError(f"{spec.file}: row {k + 1}: chunks ({chunks}) exceeds the "
                                      "prompt's word count")
                parts[item] = split_words(prompt, chunks) if chunks > 1 else [prompt]
            elif chunks > 1:
                last = max(1, int(rng.uniform(LAST_CHUNK_MIN_FRACTION, 1.0) * items.chunk_tokens))
                sizes = [items.chunk_tokens] * (chunks - 1) + [last]
                parts[item] = [synthetic_text(n, rng, tokenizer) for n in sizes]
            else:
                parts[item] = [synthetic_text(int(items.input_tokens[k]), rng, tokenizer)]
    return SourceTexts(parts, source_of, row_ids)
