"""The bounds of everything users give raycolo, declared once.

Every model that reads user input (application graphs, request files, online configs,
traces, CLI options) derives from :class:`Strict` and types its fields with the aliases
here, so a value is refused at the schema, with the field's name, before any work:

* numbers are finite (no NaN or infinity) and strictly typed: a bool is not a number,
  a float is not a count;
* each bound means something: a token count fits a context (the catalog's largest is
  32,768 tokens; :data:`MAX_TOKENS` leaves room for longer checkpoints), a count fits in
  memory, a time fits in a day;
* names are one printable line of bounded length; paths have no NUL and a bounded length.

Models that need a tighter or a cross-field bound (a node's output within its model's
context) add it themselves; the CLI's flags and the docs quote these constants.
"""
from __future__ import annotations

import typing
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

MAX_TOKENS = 1 << 20              # tokens of one request (prompt, output, chunk)
MAX_REQUESTS = 10_000_000         # requests of one run (a source's items, a node's requests)
MAX_CHUNKS = 100_000              # chunks of one document
MAX_GPUS = 4096                   # GPUs of one run or node
MAX_REPEAT = 1024                 # times a node answers each input
MAX_WEIGHT = 1e12                 # a route weight (the sum of a few stays finite)
MAX_SECONDS = 86_400.0            # a time: one day
MAX_RATE = 1e6                    # arrivals per second
MAX_THREADS = 1024                # torch CPU threads of one process
MAX_NAME_CHARS = 128
MAX_LINE_CHARS = 4096             # a one-line option (a comma-separated list)
MAX_TEXT_CHARS = 1 << 20          # a prompt template
MAX_PATH_CHARS = 4096


STRICT_VALUES = ConfigDict(strict=True, allow_inf_nan=False)   # types strict, numbers finite


class Strict(BaseModel):
    """Base of every user-facing model: unknown keys refused, types strict, numbers finite."""

    model_config = ConfigDict(extra="forbid", **STRICT_VALUES)


def _one_line(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be one line of printable characters")
    return value


def _no_nul(value: str) -> str:
    if "\x00" in value:
        raise ValueError("must not contain a NUL character")
    return value


Tokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
Requests = Annotated[int, Field(ge=1, le=MAX_REQUESTS)]
Name = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), AfterValidator(_one_line)]
Line = Annotated[str, Field(min_length=1, max_length=MAX_LINE_CHARS), AfterValidator(_one_line)]
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS)]
PathText = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), AfterValidator(_no_nul)]
Seconds = Annotated[float, Field(ge=0, le=MAX_SECONDS)]
Threads = Annotated[int, Field(ge=1, le=MAX_THREADS)]
Fraction = Annotated[float, Field(ge=0, le=1)]


_PLAIN = (("Input should be less than or equal to ", "must be at most "),
          ("Input should be greater than or equal to ", "must be at least "),
          ("Input should be less than ", "must be below "),
          ("Input should be greater than ", "must be above "),
          ("Input should be a finite number", "must be a finite number"),
          ("Input should be a valid integer", "must be an integer"),
          ("Input should be a valid number", "must be a number"),
          ("Input should be a valid string", "must be a string"),
          ("Input should be a valid boolean", "must be true or false"),
          ("Input should be a valid list", "must be a list"),
          ("Input should be a valid dictionary", "must be a mapping"),
          ("Input should be ", "must be "),
          ("String should have ", "must have "),
          ("List should have ", "must have "),
          ("Dictionary should have ", "must have "),
          ("Extra inputs are not permitted", "unknown key"),
          ("Field required", "missing"),
          ("Value error, ", ""))


def field_path(loc) -> str:
    """``('nodes', 0, 'name')`` as ``nodes[0].name``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def describe(exc: ValidationError, flag: bool = False, whole: str = "(top level)") -> str:
    """A validation error as one line: the field (a flag's ``--name`` where ``flag``;
    ``whole`` for a check of the whole model) and what it must be, in plain words (the
    first error: one fix at a time)."""
    err = exc.errors()[0]
    msg = err["msg"]
    for old, new in _PLAIN:
        if msg.startswith(old):
            msg = new + msg[len(old):]
            break
    where = field_path(err["loc"])
    if flag:
        where = "--" + where.replace("_", "-").replace(".", "-")
    return f"{where or whole}: {msg}"


def _annotated_metadata(annotation) -> list:
    """Constraints inside an annotation (``Optional[Tokens]``: Tokens' own)."""
    out = []
    for arg in typing.get_args(annotation):
        if hasattr(arg, "__metadata__"):
            for m in arg.__metadata__:
                out += getattr(m, "metadata", [m])      # a FieldInfo carries its constraints
        out += _annotated_metadata(arg)
    return out


def field_bounds(model: type[BaseModel], name: str) -> tuple[float, float, bool, bool]:
    """(least, most, least excluded, most excluded) a numeric field of ``model`` allows,
    from its declared constraints (for checks that run over whole columns at once, and
    for help texts)."""
    lo, hi, lo_open, hi_open = float("-inf"), float("inf"), False, False
    info = model.model_fields[name]
    for c in [*info.metadata, *_annotated_metadata(info.annotation)]:
        for attr, is_lo, is_open in (("ge", True, False), ("gt", True, True), ("le", False, False),
                                     ("lt", False, True)):
            v = getattr(c, attr, None)
            if v is None:
                continue
            if is_lo:
                lo, lo_open = v, is_open
            else:
                hi, hi_open = v, is_open
    return lo, hi, lo_open, hi_open


def checked(where: str, annotation, value):
    """``value`` held to ``annotation`` (an alias here, or ``Model.model_fields[f]``'s
    annotation with its metadata) as strictly as a model holds it; a ``ValueError`` saying
    ``<where>: <what it must be>, got <value>`` otherwise (numpy scalars are read as
    Python numbers). For library calls that take a bounded value outside a model."""
    from pydantic import TypeAdapter

    if type(value).__module__ == "numpy" and hasattr(value, "item"):
        value = value.item()
    adapter = TypeAdapter(annotation, config=STRICT_VALUES)
    try:
        return adapter.validate_python(value)
    except ValidationError as exc:
        raise ValueError(f"{where}: {describe(exc).split(': ', 1)[-1]}, got {value!r}") from None


def field_annotation(model: type[BaseModel], name: str):
    """``model``'s field ``name`` as one annotation with its constraints (for :func:`checked`)."""
    info = model.model_fields[name]
    return Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
