"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with a status.

The body's shape is OpenAI's (and vLLM's): clients such as the official ``openai`` package
raise ``BadRequestError``, ``NotFoundError``, ``RateLimitError``... from the status and show
``message``. Validation errors name the parameter; none ever leaks a raw pydantic dump.
"""
from __future__ import annotations

import re
from typing import Optional

from pydantic import ValidationError

_NAMED = re.compile(r"([A-Za-z_][A-Za-z0-9_.]*): (.+)", re.DOTALL)

# status -> OpenAI's error type
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
               503: "service_unavailable", 507: "insufficient_storage"}


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, param: Optional[str] = None,
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": ERROR_TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


def param_path(loc) -> str:
    """A pydantic error location as a parameter path: ``messages[0].content``."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("body",) and not out:
            continue
        elif "[" in str(part) or str(part).startswith(("function-", "union[", "{")):
            continue       # pydantic's union-branch tags (ours spell a body's form), not parameter names
        else:
            out += f".{part}" if out else str(part)
    return out


def from_error(err: dict) -> OpenAIError:
    """400 naming the invalid parameter of one pydantic (or FastAPI) error, in words."""
    if err.get("type") == "json_invalid":
        return OpenAIError(400, "the body is not valid JSON", code="invalid_json")
    param = param_path(err.get("loc", ())) or None
    msg = str(err.get("msg", "invalid request")).removeprefix("Value error, ")
    kind = err.get("type", "")
    if kind == "missing":
        msg = "is required"
    elif kind == "extra_forbidden":
        msg = "is not a supported parameter"
    named = _NAMED.fullmatch(msg) if param is None else None
    if named:          # a rule across fields (a model validator) names its parameter first
        param, msg = named.group(1), named.group(2)
    text = f"{param}: {msg}" if param else msg
    return OpenAIError(400, text, param=param, code="invalid_parameter")


def from_validation(exc: ValidationError) -> OpenAIError:
    """400 naming the first invalid parameter, in words (not pydantic's dump)."""
    return from_error(exc.errors(include_url=False)[0])
