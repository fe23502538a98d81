"""The generation routes' structured-output fields: OpenAI's ``response_format`` and vLLM's
``structured_outputs`` (:class:`raycolo.generation.structured.StructuredOutputs`, whose checks
they reuse), as vLLM's OpenAI server takes them. ``response_format`` wins where both are
given, as in vLLM (``structured_outputs_from_response_format``); its ``text`` type means no
constraint."""
from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

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
        return self


def structured_outputs(response_format: Optional[ResponseFormat],
                       given: Optional[StructuredOutputs]) -> Optional[StructuredOutputs]:
    """The request's one constraint: ``response_format``'s where it asks for JSON (keeping
    ``disable_any_whitespace`` from ``given``), else ``given``."""
    if response_format is None or response_format.type == "text":
        return given
    compact = given.disable_any_whitespace if given is not None else False
    if response_format.type == "json_object":
        return StructuredOutputs(json_object=True, disable_any_whitespace=compact)
    return StructuredOutputs(json=response_format.json_schema.schema_, disable_any_whitespace=compact)
