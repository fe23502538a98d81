"""The generation routes' structured-output fields: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (:class:`raycolo.generation.structured.StructuredOutputs`, whose checks
they reuse), as vLLM's OpenAI server takes them: a JSON ``response_format`` and
``structured_outputs`` together are refused; ``text`` means no constraint (:func:`one_constraint`)."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, model_validator

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

    _constraint: Optional[StructuredOutputs] = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema")
        try:                   # the schema checked now, as structured_outputs' (a 400, not a failure later)
            if self.type == "json_object":
                self._constraint = StructuredOutputs(json_object=True)
            elif self.type == "json_schema":
                self._constraint = StructuredOutputs(json=self.json_schema.schema_)
        except ValidationError as exc:
            raise ValueError(f"json_schema.schema: {exc.errors()[0]['msg'].removeprefix('Value error, ')}") from None
        return self

    @property
    def constraint(self) -> Optional[StructuredOutputs]:
        """The constraint this format asks for (None: ``text``), built once when it was read."""
        return self._constraint


def one_constraint(response_format: Optional[ResponseFormat],
                   given: Optional[StructuredOutputs]) -> Optional[StructuredOutputs]:
    """The request's one constraint: ``response_format``'s where it asks for JSON, else
    ``given``. Both at once is one constraint too many (vLLM's server refuses them too)."""
    fmt = response_format.constraint if response_format is not None else None
    if fmt is not None and given is not None:
        raise ValueError("structured_outputs: give it or a JSON response_format, not both")
    return fmt if fmt is not None else given
