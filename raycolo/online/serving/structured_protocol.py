"""The generation routes' structured-output fields: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (:class:`raycolo.generation.structured.StructuredOutputs`, whose checks
they reuse), as vLLM's OpenAI server takes them: a JSON ``response_format`` and
``structured_outputs`` together are refused; ``text`` means no constraint."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from raycolo.generation.structured import StructuredOutputs


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's named schema."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: Optional[str] = Field(default=None, max_length=4096)
    schema_: Optional[dict[str, Any]] = Field(default=None, alias="schema")
    strict: Optional[bool] = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        try:                   # the schema checked now, as structured_outputs' (a 400, not a failure later)
            self.constraint()
        except ValidationError as exc:
            raise ValueError(f"json_schema.schema: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self

    def constraint(self) -> Optional[StructuredOutputs]:
        """The constraint this format asks for (None: ``text``)."""
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        if self.type == "json_schema":
            return StructuredOutputs(json=self.json_schema.schema_)
        return None


def structured_outputs(response_format: Optional[ResponseFormat],
                       given: Optional[StructuredOutputs]) -> Optional[StructuredOutputs]:
    """The request's one constraint: ``response_format``'s where it asks for JSON, else
    ``given`` (both at once is refused when the request is read: :func:`one_constraint`)."""
    fmt = response_format.constraint() if response_format is not None else None
    return fmt if fmt is not None else given


def one_constraint(response_format: Optional[ResponseFormat], given: Optional[StructuredOutputs]) -> None:
    """``response_format`` asking for JSON and ``structured_outputs`` are one constraint too
    many (vLLM's server refuses them too)."""
    if given is not None and response_format is not None and response_format.type != "text":
        raise ValueError("structured_outputs: give it or a JSON response_format, not both")
