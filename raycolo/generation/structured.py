"""Structured outputs: a request whose text must follow a JSON schema, a regular
expression, a list of choices or a grammar (vLLM's ``StructuredOutputsParams``, same
names and meanings; OpenAI's ``response_format`` maps onto it).

This module is the request's side: the constraint as plain, frozen data that crosses
process boundaries, checked when the request is made (a schema that is not JSON, a regex
or grammar xgrammar cannot parse, is a clear error then, not a failed request later).
:mod:`.grammar_masks` turns it into the per-token masks the sampler applies.

The grammars are xgrammar's (the library vLLM's default structured-output backend uses),
built the way vLLM's ``XgrammarBackend`` builds them, so a greedy request gives the same
text on raycolo and on vLLM: JSON schemas with any whitespace between tokens unless
``disable_any_whitespace`` (then ``,`` and ``:`` with no space), ``json_object`` as the
schema ``{"type": "object"}``, choices as the EBNF alternation of the literal strings.
"""
from __future__ import annotations

import json as jsonlib
import re
from enum import Enum
from functools import cached_property
from typing import Annotated, Any, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_SCHEMA_CHARS = 1 << 16       # a JSON schema, as JSON text
MAX_REGEX_CHARS = 1 << 12
MAX_GRAMMAR_CHARS = 1 << 16
MAX_CHOICE_STRINGS = 256      # strings of one `choice` constraint (not `n`, the choices of an answer)
MAX_CHOICE_CHARS = 1 << 10
MAX_JSON_NESTING = 64           # objects and arrays in a JSON schema (vLLM's MAX_STRUCTURED_OUTPUT_JSON_NESTING)
MAX_REPEAT = 1000               # a counted repeat {n,m} in a regex, a schema's pattern or a grammar
JSON_OBJECT_SCHEMA = '{"type": "object"}'
COMPACT_SEPARATORS = (",", ":")


class ConstraintKind(str, Enum):
    """Which of :class:`StructuredOutputs`' constraints a request has."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


def _ebnf_literal(text: str) -> str:
    """``text`` as a quoted EBNF string literal (backslash, quote, CR, LF, tab and the
    other control characters escaped)."""
    escapes = {"\\": r"\\", '"': r"\"", "\n": r"\n", "\r": r"\r", "\t": r"\t"}
    return '"' + "".join(escapes.get(c) or (f"\\u{ord(c):04x}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
                         for c in text) + '"'


# a counted repeat, not escaped: an even run of backslashes (none included) before its brace
_COUNTED = re.compile(r"(?<!\\)(?:\\\\)*\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")


def _bounded_repeats(text: str, what: str) -> None:
    """Counted repeats (``{n}``, ``{n,}``, ``{n,m}``) in ``text`` at most :data:`MAX_REPEAT`:
    xgrammar unrolls them (``a{1000000}`` took 2 s to parse, and a schema's
    ``pattern`` of ``a{1,5000}`` 1 s)."""
    for m in _COUNTED.finditer(text):
        if max(int(g) for g in m.groups() if g) > MAX_REPEAT:
            raise ValueError(f"{what}: a counted repeat ({m.group(0)[:40]}) may count at most {MAX_REPEAT}")


def _depth(value, limit: int) -> int:
    """How deep objects and arrays nest in ``value`` (counting stops past ``limit``)."""
    stack, deepest = [(value, 1)], 0
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            deepest = max(deepest, d)
            if deepest > limit:
                break
            stack.extend((x, d + 1) for x in (v.values() if isinstance(v, dict) else v))
    return deepest


# JSON-schema keywords xgrammar parses and does not enforce (it would accept text that breaks
# them): the cases vLLM's xgrammar backend sends elsewhere (has_xgrammar_unsupported_json_features)
STRING_FORMATS = frozenset({"email", "date", "time", "date-time", "duration", "ipv4", "ipv6", "hostname", "uuid",
                            "uri", "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
UNENFORCED = {"integer": ("multipleOf",), "number": ("multipleOf",),
              "array": ("uniqueItems", "contains", "minContains", "maxContains")}


def _unenforced(value) -> Optional[str]:
    """The first keyword of a JSON schema xgrammar would not enforce (None: none)."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, list):
            stack.extend(v)
            continue
        if not isinstance(v, dict):
            continue
        stack.extend(v.values())
        types = v.get("type")
        types = {types} if isinstance(types, str) else set(t for t in types or () if isinstance(t, str))
        for t in types:
            hit = next((k for k in UNENFORCED.get(t, ()) if k in v), None)
            if hit:
                return f"{hit} on {t}"
        if "string" in types:
            if "format" in v and v["format"] not in STRING_FORMATS:
                return f"format {str(v['format'])[:40]!r}"
            if ("pattern" in v or "format" in v) and ("minLength" in v or "maxLength" in v):
                return "a pattern or format with minLength/maxLength"
        if "propertyNames" in v and "object" in types:
            names = v["propertyNames"]
            if "patternProperties" in v or (isinstance(names, dict) and ("pattern" in names or "format" in names)
                                             and ("minLength" in names or "maxLength" in names)):
                return "propertyNames with patternProperties or a bounded pattern"
    return None


def _schema_patterns(value):
    """Every ``pattern`` string of a JSON schema."""
    if isinstance(value, dict):
        for k, v in value.items():
            if k == "pattern" and isinstance(v, str):
                yield v
            else:
                yield from _schema_patterns(v)
    elif isinstance(value, list):
        for v in value:
            yield from _schema_patterns(v)


def choice_grammar(choices) -> str:
    """The EBNF grammar whose sentences are exactly ``choices``."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


Choice = Annotated[str, Field(min_length=1, max_length=MAX_CHOICE_CHARS)]


class StructuredOutputs(BaseModel):
    """Exactly one constraint on a request's text (vLLM's names; ``json`` may be a
    schema object or its JSON text, kept as text)."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    json_schema: Optional[str] = Field(default=None, alias="json", max_length=MAX_SCHEMA_CHARS,
                                       description="a JSON schema (an object, or its JSON text) the text must satisfy")
    regex: Optional[str] = Field(default=None, min_length=1, max_length=MAX_REGEX_CHARS,
                                 description="a regular expression the whole text must match")
    choice: Optional[tuple[Choice, ...]] = Field(default=None, min_length=1, max_length=MAX_CHOICE_STRINGS,
                                                 description="the text is exactly one of these")
    grammar: Optional[str] = Field(default=None, min_length=1, max_length=MAX_GRAMMAR_CHARS,
                                   description="an EBNF (GBNF) grammar with a 'root' rule the text must follow")
    json_object: Optional[bool] = Field(default=None, description="true: the text is a JSON object")
    disable_any_whitespace: bool = Field(default=False, description="JSON without whitespace between its "
                                                                    "tokens (else any whitespace may appear)")

    @field_validator("json_schema", mode="before")
    @classmethod
    def _schema_text(cls, schema: Any):
        if isinstance(schema, str):
            try:
                value = jsonlib.loads(schema)
            except ValueError as exc:
                raise ValueError(f"is not JSON: {exc}") from None
        elif isinstance(schema, dict):
            value, schema = schema, jsonlib.dumps(schema, ensure_ascii=False)
        elif isinstance(schema, bool):       # JSON Schema's true/false: vLLM's type (str or dict) refuses them
            raise ValueError("must be a JSON schema object (true and false are not taken)")
        else:
            return schema            # not a schema: the str type refuses it
        if not isinstance(value, dict):
            raise ValueError("a JSON schema is an object (true and false are not taken)")
        if _depth(value, MAX_JSON_NESTING) > MAX_JSON_NESTING:
            raise ValueError(f"the JSON schema is nested too deeply: objects and arrays may nest at most "
                             f"{MAX_JSON_NESTING} levels")
        for pattern in _schema_patterns(value):
            _bounded_repeats(pattern, "pattern")
        hit = _unenforced(value)
        if hit:
            raise ValueError(f"xgrammar would not enforce {hit}: refused rather than ignored")
        return schema

    @field_validator("json_object")
    @classmethod
    def _false_is_absent(cls, flag: Optional[bool]):
        return flag or None          # false asks for nothing (vLLM would count it as a constraint)

    @field_validator("regex", "grammar")
    @classmethod
    def _repeats(cls, text: Optional[str]):
        if text is not None:
            _bounded_repeats(text, "counted repeats")
        return text

    @model_validator(mode="after")
    def _one_constraint(self):
        given = [k.value for k in ConstraintKind if self._spec_of(k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json, regex, choice, grammar and json_object"
                             + (f" (got {', '.join(given)})" if given else ""))
        grammar(self)        # a constraint xgrammar cannot build is refused now, with its reason
        return self

    def _spec_of(self, kind: ConstraintKind):
        return {ConstraintKind.JSON: self.json_schema, ConstraintKind.JSON_OBJECT: self.json_object,
                ConstraintKind.REGEX: self.regex, ConstraintKind.CHOICE: self.choice,
                ConstraintKind.GRAMMAR: self.grammar}[kind]

    @cached_property
    def kind(self) -> ConstraintKind:
        return next(k for k in ConstraintKind if self._spec_of(k) is not None)

    @cached_property
    def key(self) -> tuple:
        """Equal for constraints that build the same grammar (the compiled grammars' cache key)."""
        return self.kind, self._spec_of(self.kind), self.disable_any_whitespace


def grammar(constraint: StructuredOutputs):
    """``constraint``'s xgrammar ``Grammar`` (no tokenizer needed). Raises ValueError
    with xgrammar's reason where it cannot be built."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError("structured outputs need the xgrammar package (pip install xgrammar)") from None
    kind = constraint.kind
    try:
        if kind in (ConstraintKind.JSON, ConstraintKind.JSON_OBJECT):
            schema = constraint.json_schema if kind is ConstraintKind.JSON else JSON_OBJECT_SCHEMA
            compact = constraint.disable_any_whitespace
            return xgr.Grammar.from_json_schema(schema, any_whitespace=not compact,
                                                separators=COMPACT_SEPARATORS if compact else None)
        if kind is ConstraintKind.REGEX:
            return xgr.Grammar.from_regex(constraint.regex)
        text = choice_grammar(constraint.choice) if kind is ConstraintKind.CHOICE else constraint.grammar
        return xgr.Grammar.from_ebnf(text)
    except (RuntimeError, ValueError, TypeError) as exc:
        reason = re.sub(r"^\[[0-9:]+\] \S+:[0-9]+: ", "", " ".join(str(exc).split()))[:300]   # no C++ source line
        raise ValueError(f"{kind.value}: xgrammar cannot build it: {reason}") from None
