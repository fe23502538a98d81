"""Application graphs: YAML specs of multi-LLM applications, validated with pydantic.

A graph has *sources* (the application's requests), *nodes* (LLM stages) and *edges*
(data flow). An edge from a node to itself is a chain: each item (e.g. a document) is
processed chunk by chunk, every step seeing the previous step's output (SamuLLM's chain
summary). See docs/dag.md for the full format.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Literal, Optional

from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from raycolo.bounds import (MAX_CHUNKS, MAX_REPEAT, MAX_REQUESTS, MAX_WEIGHT, Name, PathText, Requests, Strict, Text,
                            Tokens, describe)
from raycolo.catalog import get_model
from raycolo.errors import ConfigError
from raycolo.lengths import LengthDistribution
from raycolo.generation.structured import StructuredOutputs
from raycolo.generation.params import (ECDF_TEMPERATURE, GREEDY_EPS, MAX_STOP_STRINGS, SamplingParams, Seed,
                                       Temperature, TopP, bad_word_list, stop_strings)
from raycolo.yamlio import load_yaml

# ``{name}`` in a prompt template is a placeholder; other braces are literal text.
PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_\-]*)\}")
CHAIN_PLACEHOLDERS = ("chunk", "previous")


class SourceSpec(Strict):
    """Where requests come from: a count with distributions, or a jsonl/parquet file."""

    count: Optional[Requests] = Field(default=None, description=(
        "How many items (requests) the source generates, their lengths drawn from input_tokens and/or chunks; "
        "give either count or file. --requests N overrides it."))
    input_tokens: Optional[LengthDistribution] = Field(default=None, description=(
        "With count: the distribution of each item's prompt length in tokens (without it, an item's input is "
        "chunks × chunk_tokens)."))
    chunks: Optional[LengthDistribution] = Field(default=None, description=(
        "Documents (chain summary), with count: the distribution of the number of chunks per item, which a "
        f"self-loop node processes one by one. Its max must be at most {MAX_CHUNKS:,}, and count × max at most "
        f"{MAX_REQUESTS:,} requests."))
    chunk_tokens: Tokens = Field(default=2048, description=(
        "Documents (chain summary): tokens per chunk. Every chunk of a document is this long but the last, "
        "which is a seeded 30-100 % of it."))
    file: Optional[PathText] = Field(default=None, description=(
        "A request file to read the items from instead of count: .jsonl rows or a .parquet table with prompt "
        "(text) or input_tokens, and optionally chunks (each row is read through RequestRow). A relative path is "
        "taken from the application YAML's directory; --requests N keeps the first N rows."))

    @model_validator(mode="after")
    def _check(self) -> "SourceSpec":
        if self.file is None:
            if self.count is None:
                raise ValueError("give either 'count' or 'file'")
            if self.input_tokens is None and self.chunks is None:
                raise ValueError("give 'input_tokens' or 'chunks' with 'count'")
        elif self.count is not None:
            raise ValueError("give either 'count' or 'file', not both")
        if self.chunks is not None:
            if self.chunks.max > MAX_CHUNKS:
                raise ValueError(f"chunks: max must be at most {MAX_CHUNKS} chunks per item")
            if self.count is not None and self.count * self.chunks.max > MAX_REQUESTS:
                raise ValueError(f"count x chunks.max ({self.count} x {self.chunks.max}) must be at most "
                                 f"{MAX_REQUESTS} requests")
        return self


class NodeSpec(Strict):
    """One LLM stage of the application."""

    name: Name = Field(description=(
        "The node's name, unique among nodes and sources; edges and other nodes' prompt placeholders refer to "
        "the node by it."))
    model: Name = Field(description=(
        "The model the planner costs the node with: a name from the model catalog (raycolo/data/models.yaml)."))
    max_output_tokens: Tokens = Field(description=(
        "The most tokens one of the node's requests may generate: sampled output lengths are capped at it. It "
        "must lie within the model's context (checked by AppSpec.validate_graph)."))
    prompt: Text = Field(default="{input}", description=(
        "The prompt template. {input} is all of the node's inputs joined and {<name>} the input from that node "
        "or source; in a chain (self-loop) {chunk} is the current part and {previous} the last step's output. "
        "Other braces are literal text."))
    combine: Literal["each", "concat", "route"] = Field(default="each", description=(
        "How the node's inputs become requests. each: every input is its own request; concat: one request per "
        "item joining all of its inputs; route: each item goes to exactly one of the sibling 'route' nodes "
        "(those with the same inputs), by route_weight."))
    route_weight: float = Field(default=1.0, gt=0, le=MAX_WEIGHT, description=(
        "With combine route: the node's share of the items among its route siblings, in proportion to the "
        "weights (the counts are exact; which item goes where is seeded)."))
    repeat: int = Field(default=1, ge=1, le=MAX_REPEAT, description=(
        "How many requests the node makes of each input (e.g. 4: every input is answered 4 times)."))
    checkpoint: Optional[PathText] = Field(default=None, description=(
        "Where the runtime loads the model from: a local checkpoint directory (weights, tokenizer, chat "
        "template, EOS set); tiny catalog models need none. The planner only needs model."))
    temperature: Temperature = Field(default=ECDF_TEMPERATURE, description=(
        "The sampling temperature of the node's requests (raycolo.generation.SamplingParams, same bounds). The "
        "default is the temperature output-length eCDFs are measured at; 0 is greedy (deterministic, and "
        "planned with the profile's greedy eCDF where it has one)."))
    top_p: TopP = Field(default=1.0, description=(
        "Nucleus sampling of the node's requests (raycolo.generation.SamplingParams): each token is drawn from "
        "the smallest set of most likely tokens whose probabilities sum to top_p; 1.0 keeps every token."))
    seed: Optional[Seed] = Field(default=None, description=(
        "The seed the node's per-request sampling seeds derive from (none: the run's --seed), so a request "
        "samples the same way whenever it runs."))
    stop: list[str] = Field(default_factory=list, max_length=MAX_STOP_STRINGS, description=(
        "Strings that end an output; a matched stop string is cut from the text and the finish reason is "
        "stop."))

    structured_outputs: Optional[StructuredOutputs] = Field(default=None, description=(
        "A constraint the node's outputs follow (vLLM's structured_outputs: exactly one of json, regex, "
        "choice, grammar, json_object), e.g. a router's choice of names. Planned as if unconstrained: the "
        "output-length eCDF is the model's."))
    bad_words: list[str] = Field(default_factory=list, description=(
        "Words the node's outputs never contain (vLLM's bad_words: each word alone and after a space)."))

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: list[str]) -> list[str]:
        return list(stop_strings(stop))

    @field_validator("bad_words")
    @classmethod
    def _bad_words(cls, words: list[str]) -> list[str]:
        return list(bad_word_list(words))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def plain_sampling(self) -> bool:
        """Its requests take the plain argmax of the logits (no full sampler to cost)."""
        return self.sampling_params(1, 0).plain_greedy

    def sampling_params(self, max_tokens: int, seed: int) -> SamplingParams:
        """The SamplingParams of one of this node's requests."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=seed, stop=self.stop, bad_words=self.bad_words or None,
                              structured_outputs=self.structured_outputs)


class EdgeSpec(Strict):
    model_config = ConfigDict(populate_by_name=True)

    source: Name = Field(alias="from", description=(
        "The node or source the data flows from (YAML key `from`)."))
    target: Name = Field(alias="to", description=(
        "The node that receives the data (YAML key `to`; a source takes no inputs). An edge from a node "
        "to itself makes a chain: each item is processed chunk by chunk."))


class AppSpec(Strict):
    """A multi-LLM application."""

    name: Name = Field(default="app", description="The application's name, recorded in run reports.")
    sources: dict[Name, SourceSpec] = Field(min_length=1, max_length=1024, description=(
        "The application's request sources, by name (a top-level `requests` key instead is one source named "
        "input)."))
    nodes: list[NodeSpec] = Field(min_length=1, max_length=1024, description=(
        "The application's LLM stages, each with a unique name."))
    edges: list[EdgeSpec] = Field(min_length=1, max_length=1 << 16, description=(
        "The data flow between sources and nodes; every node needs an input edge, and cycles are refused "
        "except a node's edge to itself (a chain)."))
    base_dir: Optional[str] = Field(default=None, description=(
        "Set by the loader: the directory of the application's YAML file, from which relative request-file "
        "paths are taken."))

    def node(self, name: str) -> NodeSpec:
        return self._nodes_by_name[name]

    @property
    def _nodes_by_name(self) -> dict[str, NodeSpec]:
        return {n.name: n for n in self.nodes}

    def inputs_of(self, name: str) -> list[str]:
        """Upstream nodes or sources of ``name``, self-loops excluded, in edge order."""
        return [e.source for e in self.edges if e.target == name and e.source != name]

    def has_self_loop(self, name: str) -> bool:
        return any(e.source == e.target == name for e in self.edges)

    def node_inputs(self, name: str) -> list[str]:
        return [s for s in self.inputs_of(name) if s not in self.sources]

    def placeholders_allowed(self, name: str) -> list[str]:
        """What a node's prompt may name: ``input`` (all inputs joined), each input by
        name, and for a chain ``chunk`` (the current part) and ``previous`` (the last
        step's output)."""
        allowed = ["input", *self.inputs_of(name)]
        if self.has_self_loop(name):
            allowed += list(CHAIN_PLACEHOLDERS)
        return allowed

    def topological_order(self) -> list[str]:
        order, state = [], {}

        def visit(name: str, path: list[str]) -> None:
            if state.get(name) == "done":
                return
            if state.get(name) == "active":
                cycle = path[path.index(name):] + [name]
                raise ConfigError(f"edges: cycle {' -> '.join(cycle)} "
                                  "(only self-loops are allowed)")
            state[name] = "active"
            for up in self.node_inputs(name):
                visit(up, path + [name])
            state[name] = "done"
            order.append(name)

        for node in self.nodes:
            visit(node.name, [])
        return order

    def validate_graph(self) -> None:
        names = [n.name for n in self.nodes]
        for name in names:
            if names.count(name) > 1:
                raise ConfigError(f"nodes: duplicate node name '{name}'")
            if name in self.sources:
                raise ConfigError(f"nodes: '{name}' is also a source name")
        for i, node in enumerate(self.nodes):
            try:
                model = get_model(node.model)
            except ConfigError as exc:
                raise ConfigError(f"nodes[{node.name}].model: {exc}") from None
            if node.max_output_tokens > model.context_length:
                raise ConfigError(f"nodes[{node.name}].max_output_tokens: must be within {node.model}'s context "
                                  f"of {model.context_length} tokens, got {node.max_output_tokens}")
        known = set(names) | set(self.sources)
        for i, edge in enumerate(self.edges):
            for end, value in (("from", edge.source), ("to", edge.target)):
                if value not in known:
                    raise ConfigError(f"edges[{i}].{end}: unknown node or source '{value}'")
            if edge.target in self.sources:
                raise ConfigError(f"edges[{i}].to: '{edge.target}' is a source; sources take no inputs")
        for node in self.nodes:
            if not self.inputs_of(node.name):
                raise ConfigError(f"nodes[{node.name}]: has no input edge")
            allowed = self.placeholders_allowed(node.name)
            for placeholder in PLACEHOLDER.findall(node.prompt):
                if placeholder not in allowed:
                    raise ConfigError(f"nodes[{node.name}].prompt: unknown placeholder "
                                      f"'{{{placeholder}}}' (allowed: "
                                      + ", ".join(f"{{{a}}}" for a in allowed) + ")")
        self.topological_order()


def parse_app(data: object, origin: str = "<dict>") -> AppSpec:
    if not isinstance(data, dict):
        raise ConfigError(f"{origin}: expected a mapping at the top level")
    data = dict(data)
    if "requests" in data:
        if "sources" in data:
            raise ConfigError(f"{origin}: give 'requests' or 'sources', not both")
        data["sources"] = {"input": data.pop("requests")}
    try:
        app = AppSpec.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{origin}: {describe(exc)}") from None
    except RecursionError:
        raise ConfigError(f"{origin}: nested too deeply") from None
    try:
        app.validate_graph()
    except ConfigError as exc:
        raise ConfigError(f"{origin}: {exc}") from None
    return app


def load_app(path: str | Path) -> AppSpec:
    path = Path(path)
    data = load_yaml(path)
    app = parse_app(data, str(path))
    return app.model_copy(update={"base_dir": str(path.parent.resolve())})
