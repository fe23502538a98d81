"""Qwen3-Coder's XML tool calls (vLLM's ``qwen3_coder`` parser, also named ``qwen3_xml``):
the call blocks, and their parameters typed by the tool's JSON schema. Pure: no Ray, no
torch. :class:`raycolo.online.serving.tool_calls.ToolCallReader` finds the blocks in a
streamed reply; this module reads one::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

As vLLM 0.32 reads them (``vllm/parser/qwen3.py``, ``vllm/tool_parsers/utils.py``):

* a value loses one leading and one trailing newline (the template's markup); a
  parameter may end where the next ``<parameter=`` begins, or (where vLLM drops it)
  where the function ends;
* a value is typed by its property in the tool's ``parameters`` schema (``type``, a list
  of types, ``enum`` values, ``anyOf``/``oneOf``/``allOf``), trying null, integer, number
  (integral values as integers), boolean (``true``/``1``, ``false``/``0``), object, array,
  then string; a value that fits none of its types is JSON if it parses as JSON, else
  text. A parameter the schema does not name stays text, and so does every value of a
  tool with no schema. Infinite and NaN numbers are never produced (they are not JSON).
"""
from __future__ import annotations

import json
import math
import re
from typing import Any, Optional

from raycolo.online.serving.tool_protocol import FUNCTION_NAME

XML_CALL_OPEN, XML_FUNCTION_OPEN, XML_FUNCTION_CLOSE, XML_CALL_CLOSE = ("<tool_call>", "<function=", "</function>",
                                                                        "</tool_call>")
_FUNCTION_NAME = re.compile(FUNCTION_NAME)     # a tool's name, as a request may give it
_PARAMETER = re.compile(r"<\s*parameter\s*=\s*([^>]*)>(.*?)(?:<\s*/\s*parameter\s*>|(?=<\s*parameter\s*=)|$)", re.S)
_TYPE_ALIASES = {"str": "string", "text": "string", "varchar": "string", "char": "string", "enum": "string",
                 "int": "integer", "int32": "integer", "int64": "integer", "uint": "integer", "uint32": "integer",
                 "uint64": "integer", "long": "integer", "short": "integer", "unsigned": "integer",
                 "float": "number", "float32": "number", "float64": "number", "double": "number",
                 "bool": "boolean", "dict": "object", "arr": "array", "list": "array", "sequence": "array"}
_ORDER = ("null", "integer", "number", "boolean", "object", "array", "string")
_ENUM_TYPES = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "array"),
               (dict, "object"))


def schema_types(schema: Any) -> set[str]:
    """The JSON types a property's schema allows (``{"string"}`` where it says none)."""
    if not isinstance(schema, dict):
        return {"string"}
    types: set[str] = set()
    given = schema.get("type")
    types.update([given] if isinstance(given, str) else [t for t in given if isinstance(t, str)]
                 if isinstance(given, list) else [])
    for value in schema.get("enum") if isinstance(schema.get("enum"), list) else ():
        types.add("null" if value is None else next((name for kind, name in _ENUM_TYPES if isinstance(value, kind)),
                                                    "string"))
    for key in ("anyOf", "oneOf", "allOf"):
        for choice in schema.get(key) if isinstance(schema.get(key), list) else ():
            types |= schema_types(choice)
    return {_TYPE_ALIASES.get(t.strip().lower(), t.strip().lower()) for t in types} or {"string"}


def _finite(value: Any) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(map(_finite, value))
    if isinstance(value, dict):
        return all(map(_finite, value.values()))
    return True


def _as(kind: str, text: str):
    """``text`` as JSON type ``kind``; a ValueError where it is not one."""
    if kind == "null":
        if text.lower() == "null":
            return None
    elif kind == "string":
        return text
    elif kind == "integer":
        return int(text)
    elif kind == "number":
        number = float(text)
        if math.isfinite(number):
            return int(number) if number == int(number) else number
    elif kind == "boolean":
        flag = text.lower().strip()
        if flag in ("true", "1", "false", "0"):
            return flag in ("true", "1")
    else:         # object, array
        value = json.loads(text)
        if _finite(value):
            return value
    raise ValueError(kind)


def typed_value(text: str, schema: Any) -> Any:
    """A parameter's text as its schema types it (see the module docstring)."""
    allowed = schema_types(schema)
    for kind in _ORDER:
        if kind in allowed:
            try:
                return _as(kind, text)
            except (ValueError, RecursionError):
                continue
    try:
        value = json.loads(text)
        return value if _finite(value) else text
    except (ValueError, RecursionError):
        return text


def _trim(value: str) -> str:
    """One leading and one trailing newline off (the template's markup)."""
    return value.removeprefix("\n").removesuffix("\n")


def xml_call(block: str, schemas: dict) -> Optional[tuple[str, str]]:
    """(name, arguments as JSON text) of ``<function=NAME>...</function>`` (the block from
    ``<function=`` to its close), or None where it is not a call. ``schemas``: each
    tool's ``parameters`` schema, by name."""
    head, sep, body = block[len(XML_FUNCTION_OPEN):].partition(">")
    name = head.strip()
    if not sep or not _FUNCTION_NAME.fullmatch(name):
        return None
    properties = (schemas.get(name) or {}).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    args = {}
    for match in _PARAMETER.finditer(body.removesuffix(XML_FUNCTION_CLOSE)):
        key, text = match.group(1).strip(), _trim(match.group(2))
        args[key] = typed_value(text, properties[key]) if key in properties else text
    return name, json.dumps(args, ensure_ascii=False)
