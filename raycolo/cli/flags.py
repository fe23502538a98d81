"""Command-line flags generated from config fields (the way Vidur builds its CLI from its
config dataclasses): the flag's name, default, bounds and help come from the field, so
a default or a bound is declared once, in the model, and a bad value is refused by the
model's own rules, with the flag's name."""
from __future__ import annotations

import argparse
import enum
import typing
from typing import Any, Optional

from pydantic import BaseModel, TypeAdapter, ValidationError

from raycolo.bounds import STRICT_VALUES, describe, field_annotation, field_bounds

_UNSET: Any = object()


def _base_type(annotation) -> type:
    """int, float or str: what the flag's text is read as (Optional[X] reads as X)."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Union and len(args) == 1:
        return _base_type(args[0])
    if typing.get_origin(annotation) is typing.Annotated:
        return _base_type(args[0])
    return annotation if annotation in (int, float) else str


def field_type(model: type[BaseModel], name: str):
    """An argparse ``type``: the text read as the field's type, then validated by the
    field's own constraints (a bad value: argparse's one-line error naming the flag)."""
    info = model.model_fields[name]
    adapter = TypeAdapter(field_annotation(model, name), config=STRICT_VALUES)
    base = _base_type(info.annotation)

    def parse(text: str):
        try:
            value = base(text)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(base, "text")
            raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None
        try:
            return adapter.validate_python(value)
        except ValidationError as exc:
            raise argparse.ArgumentTypeError(describe(exc).split(": ", 1)[-1] + f", got {text!r}") from None

    parse.__name__ = base.__name__
    parse.field = (model, name)          # where the flag comes from (tests find hand-written flags)
    return parse


def _choices(annotation) -> tuple:
    if typing.get_origin(annotation) is typing.Literal:
        return typing.get_args(annotation)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return tuple(m.value for m in annotation)
    return tuple(c for a in typing.get_args(annotation) for c in _choices(a))


def field_help(model: type[BaseModel], name: str, text: Optional[str] = None, default: Any = _UNSET) -> str:
    """``text`` (default: the field's description) with its choices, default and bounds,
    as ``--help`` shows them."""
    info = model.model_fields[name]
    text = text or info.description or name.replace("_", " ")
    choices = _choices(info.annotation)
    if choices:
        text += ": " + ", ".join(map(str, choices))
    bounds = interval(model, name)
    if info.is_required() and default is _UNSET:
        return f"{text} (required{'; ' + bounds if bounds else ''})"
    value = info.default if default is _UNSET else default
    shown = "none" if value is None else _num(value) if isinstance(value, (int, float)) else value
    return f"{text} (default {shown}{'; ' + bounds if bounds else ''})"


def interval(model: type[BaseModel], name: str) -> str:
    """The field's bounds as ``[a, b]`` (``(`` or ``)`` where an end is excluded); "" if none."""
    lo, hi, lo_open, hi_open = field_bounds(model, name)
    if (lo, hi) == (float("-inf"), float("inf")):
        return ""
    return (f"{'(' if lo_open or lo == float('-inf') else '['}{_num(lo) if lo != float('-inf') else ''}, "
            f"{_num(hi) if hi != float('inf') else ''}{')' if hi_open or hi == float('inf') else ']'}")


def _num(x) -> str:
    if isinstance(x, int):
        return f"{x:,}"
    return f"{int(x):,}" if float(x).is_integer() and abs(x) < 1e16 else f"{x:g}"


def add_field_flag(parser: argparse.ArgumentParser, model: type[BaseModel], name: str, text: Optional[str] = None,
                   flag: Optional[str] = None, default: Any = _UNSET, metavar: Optional[str] = None) -> None:
    """``--<name>`` (or ``flag``) for field ``name`` of ``model``: its type, bounds and
    default (``default`` where a command's differs, e.g. None for "the config's")."""
    info = model.model_fields[name]
    required = info.is_required() and default is _UNSET
    value = None if required else info.default if default is _UNSET else default
    parser.add_argument(flag or "--" + name.replace("_", "-"), type=field_type(model, name), default=value,
                        required=required, metavar=metavar, help=field_help(model, name, text, default))


def add_model_flags(parser: argparse.ArgumentParser, model: type[BaseModel], skip: tuple = (),
                    **defaults: Any) -> None:
    """A flag per field of ``model`` but those in ``skip`` (``defaults``: a command's own
    default for a field, e.g. ``gpus=2``)."""
    for name in model.model_fields:
        if name not in skip:
            add_field_flag(parser, model, name, default=defaults.get(name, _UNSET))


def _type_name(annotation) -> str:
    choices = _choices(annotation)
    if choices:
        return " \\| ".join(f"`{c}`" for c in choices)
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        return _type_name(args[0])
    if typing.get_origin(annotation) is typing.Union:
        return " or ".join(_type_name(a) for a in args) + (" or none" if type(None) in typing.get_args(annotation)
                                                          else "")
    if typing.get_origin(annotation) in (list, dict):
        return f"{typing.get_origin(annotation).__name__} of " + ", ".join(_type_name(a) for a in args)
    return getattr(annotation, "__name__", str(annotation))


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, info in model.model_fields.items():
        key = prefix + name
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            rows += _rows(annotation, key + ".")
            continue
        bounds = interval(model, name)
        default = "required" if info.is_required() else (
            "computed" if info.default_factory is not None else
            f"`{(info.default.value if isinstance(info.default, enum.Enum) else info.default)!r}`")
        text = " ".join((info.description or "").split()).replace("|", "\\|")
        rows.append(f"| `{key}` | {_type_name(annotation)} | {default} | {bounds} | {text} |")
    return rows


REFERENCE_MODELS = (
    ("Online deployment config (`raycolo online run`, `raycolo serve`)", "raycolo.online.config", "OnlineConfig", ""),
    ("Application graph (`raycolo plan`, `compare`, `run`)", "raycolo.offline.dag", "AppSpec", ""),
    ("Application graph node (`nodes[i]`)", "raycolo.offline.dag", "NodeSpec", "nodes[i]."),
    ("Request source (`requests` or `sources.<name>`)", "raycolo.offline.dag", "SourceSpec", "sources.<name>."),
    ("Length distribution (`input_tokens`, `chunks`)", "raycolo.lengths", "LengthDistribution", ""),
    ("Offline run options (`raycolo run`, `jobs/run_dag.py`: each a `--flag`)", "raycolo.offline.runtime.setup", "RunConfig", ""),
    ("Request-file row (jsonl, parquet)", "raycolo.offline.workload", "RequestRow", ""),
    ("Trace CSV row", "raycolo.online.tasks", "TraceRow", ""),
    ("`raycolo plan` (each a `--flag`)", "raycolo.cli.options", "PlanOptions", ""),
    ("`raycolo compare` (each a `--flag`)", "raycolo.cli.options", "CompareOptions", ""),
    ("`raycolo simulate-online`, `sweep-online`: the simulated cluster (each a `--flag`)", "raycolo.cli.options",
     "SimulatedCluster", ""),
    ("`raycolo sweep-online`: the sweep (each a `--flag`)", "raycolo.cli.options", "SweepOptions", ""),
    ("`raycolo online run` (each a `--flag`; also `LiveReplay`'s below)", "raycolo.cli.options", "LiveOptions", ""),
    ("Arrivals (`--rate`, `--tasks` of `simulate-online`, `sweep-online`, `online run`)", "raycolo.online.tasks",
     "Arrivals", ""),
    ("`raycolo online run`: the replay (each a `--flag`)", "raycolo.online.tasks", "LiveReplay", ""),
    ("`raycolo online run`, `serve`: the cluster (each a `--flag`)", "raycolo.cli.options", "Attach", ""),
    ("`raycolo profile` (each a `--flag`)", "raycolo.cli.options", "ProfileOptions", ""),
    ("`raycolo validate` (each a `--flag`)", "raycolo.cli.options", "ValidateOptions", ""),
)


def config_reference() -> str:
    """docs/config-reference.md: every field of every user-facing model, with its type,
    default and bounds, read from the models (``python -m raycolo.cli.flags``)."""
    import importlib

    out = ["# Configuration reference", "",
           "Generated from the models by `python -m raycolo.cli.flags > docs/config-reference.md`; "
           "a test fails when this file and the models disagree. Bounds: `[a, b]` includes an end, "
           "`(a, b)` excludes it. Every number is finite and strictly typed (`true` is not a number, "
           "`2.0` is not a count); names are one printable line of at most 128 characters.", ""]
    for title, module, name, prefix in REFERENCE_MODELS:
        model = getattr(importlib.import_module(module), name)
        out += [f"## {title}", "", "| key | type | default | bounds | meaning |", "|---|---|---|---|---|",
                *_rows(model, prefix), ""]
    return "\n".join(out)


if __name__ == "__main__":
    print(config_reference(), end="")
