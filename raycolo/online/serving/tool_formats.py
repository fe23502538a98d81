"""The tool-call formats a reply is read whole in, and the call objects in them: pure
functions from text to ``(name, arguments as JSON text)`` pairs, None where the text is
not only calls (:class:`raycolo.online.serving.tool_calls.ToolCallReader` reads with them;
the formats are described there).

* ``llama3_json``: JSON call objects separated by ``;``.
* ``pythonic``: a Python list of calls with keyword arguments.
* ``mistral``: what follows the first ``[TOOL_CALLS]``, in either of Mistral's forms:
  before tokenizer v11 (Mistral 7B Instruct v0.3, Mistral Nemo) one JSON list of
  ``{"name", "arguments"}`` objects (or one object); from v11 on (Mistral Small 3.1,
  Magistral, Devstral) ``name[ARGS]{...}`` or ``name{...}``, one per ``[TOOL_CALLS]``.
  The first character tells them apart: a function name never begins with ``[`` or
  ``{``. As vLLM reads them (``vllm/parser/mistral.py``, 0.32), arguments are the first
  JSON value after the name, as written (text after it is dropped), and a JSON list's
  arguments given as a string are kept as written. Where that value is not a JSON
  object, raycolo shows the reply as content (vLLM returns the call with the raw text).
"""
from __future__ import annotations

import ast
import json
import re
import secrets
import string
from typing import Optional

from raycolo.online.serving.tool_protocol import FUNCTION_NAME

PYTHON_TAG = "<|python_tag|>"
MISTRAL_TAG, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
_FUNCTION_NAME = re.compile(FUNCTION_NAME)     # a tool's name, as a request may give it
_MISTRAL_ID_CHARS = string.ascii_letters + string.digits


def mistral_call_id() -> str:
    """A call id Mistral's chat templates take back in the history: nine letters and
    digits (mistral-common's rule; vLLM's ids for the mistral parser)."""
    return "".join(secrets.choice(_MISTRAL_ID_CHARS) for _ in range(9))


def call_object(text: str) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of a call's JSON object, or None if it is none."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError):       # deep nesting raises RecursionError
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj["arguments"] if "arguments" in obj else obj.get("parameters", {})
    return obj["name"], json.dumps(args, ensure_ascii=False)



def llama3_calls(body: str) -> Optional[list[tuple[str, str]]]:
    """JSON call objects separated by ``;`` (None: the text is not only that)."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(body) and body[at] in " \t\r\n;":
            at += 1
        if at == len(body):
            return calls or None
        try:
            obj, at = decoder.raw_decode(body, at)
        except (ValueError, RecursionError):
            return None
        call = call_object(json.dumps(obj)) if isinstance(obj, dict) else None
        if call is None:
            return None
        calls.append(call)


PYTHON_END = "<|python_end|>"
_NAMED_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr):
    """A call argument's value: a Python or JSON literal (a ValueError otherwise)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMED_LITERALS:
        return _NAMED_LITERALS[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant) \
            and isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
        return -node.operand.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) and isinstance(k.value, str) for k in node.keys):
        return {k.value: _literal(v) for k, v in zip(node.keys, node.values)}
    raise ValueError("not a literal")


_PYTHONIC_NAME = re.compile(r"[a-zA-Z]\w*")      # vLLM's pattern of a function's and an argument's name


def pythonic_calls(body: str) -> Optional[list[tuple[str, str]]]:
    """A Python list of calls with keyword arguments, ``[f(a=1), g(b="x")]`` (Llama 3.2
    and 4's form; Llama 4 wraps it in ``<|python_start|>...<|python_end|>``); None: the
    text is not only that."""
    body = body.removesuffix(PYTHON_END).strip()
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts or not all(isinstance(e, ast.Call) for e in tree.elts):
            return None
        calls = []
        for call in tree.elts:
            name = call.func.id if isinstance(call.func, ast.Name) else ""
            if not _PYTHONIC_NAME.fullmatch(name) or call.args \
                    or not all(k.arg is not None and _PYTHONIC_NAME.fullmatch(k.arg) for k in call.keywords):
                return None
            args = {k.arg: _literal(k.value) for k in call.keywords}
            calls.append((name, json.dumps(args, ensure_ascii=False)))
        return calls
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def _mistral_arguments(args) -> str:
    """A JSON list's ``arguments`` as vLLM keeps them: text as written, anything else as JSON."""
    if args is None:
        return "{}"
    return args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)


def mistral_calls(text: str) -> Optional[list[tuple[str, str]]]:
    """The calls after the first ``[TOOL_CALLS]`` of ``text`` (see the module docstring)."""
    segments = [seg.strip() for seg in text.split(MISTRAL_TAG)[1:]]
    segments = [seg for seg in segments if seg]          # repeated tags with nothing between: one
    if not segments:
        return None
    decoder = json.JSONDecoder()
    if segments[0][0] in "[{":           # before v11: one JSON list of call objects
        try:
            value, _ = decoder.raw_decode(segments[0])
        except (ValueError, RecursionError):
            return None
        items = value if isinstance(value, list) else [value]
        calls = [(item["name"], _mistral_arguments(item.get("arguments"))) for item in items
                 if isinstance(item, dict) and isinstance(item.get("name"), str)]
        return calls or None
    calls = []
    for seg in segments:                 # v11 on: name[ARGS]{...} or name{...}
        name, sep, args = seg.partition(MISTRAL_ARGS)
        if not sep:
            brace = seg.find("{")
            name, args = (seg[:brace], seg[brace:]) if brace >= 0 else (seg, "")
        name, args = name.strip(), args.strip()
        if not _FUNCTION_NAME.fullmatch(name):
            return None
        try:
            value, end = decoder.raw_decode(args) if args else ({}, 0)
        except (ValueError, RecursionError):
            return None
        if not isinstance(value, dict):
            return None
        calls.append((name, args[:end] if args else "{}"))     # the arguments as written (vLLM's)
    return calls
