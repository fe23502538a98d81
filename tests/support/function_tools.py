"""Functions to call (OpenAI's tool shape) shared by the HTTP and vLLM-parity tests, and
vLLM's schema of "required" calls over them, written out (vllm/tool_parsers/utils.py)."""
from __future__ import annotations

import json

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}}
ZONE = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"]}}}
REQUIRED_SCHEMA = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
    {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                    "parameters": t["function"]["parameters"]}, "required": ["name", "parameters"]}
    for t in (WEATHER, ZONE)]}}


def complete_calls(text: str) -> list:
    """The whole objects of a JSON array cut anywhere (brute force: the longest prefix that
    ends an object and parses once the array is closed)."""
    for end in range(len(text), 0, -1):
        if text[end - 1] == "}":
            try:
                return json.loads(text[:end] + "]")
            except ValueError:
                continue
    return []
