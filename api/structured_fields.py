"""The request fields that ask for a structured output, and the StructuredOutput each one is."""
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from slora.api.field_types import NEUTRAL_ONLY, GuidedChoices, Name, SchemaValue, Spec, Text, not_supported, schema_text
from slora.api.schema_rules import given, implies
from slora.sampling.structured_output import StructuredOutput


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: Name = "response"
    description: Text | None = None
    schema_: SchemaValue | None = Field(None, alias="schema", description="Without it, any JSON object.")
    strict: bool | None = None


def _response_format_rules(schema: JsonDict) -> None:
    schema["allOf"] = [implies(given("type", {"const": "json_schema"}), given("json_schema"),
                               'type "json_schema" needs json_schema')]


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", json_schema_extra=_response_format_rules)
    type: Annotated[Literal["text", "json_object", "json_schema"],
                    not_supported('"text", "json_object" or "json_schema"')]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> "ResponseFormat":
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("missing", 'json_schema is required with type "json_schema"')
        return self


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: at most one of json, regex, choice, grammar and json_object (true), and not
    with another structured output of the request. Backend options (disable_any_whitespace, ...) are ignored."""

    model_config = ConfigDict(extra="ignore")
    json_: SchemaValue | None = Field(None, alias="json")
    regex: Spec | None = None
    choice: GuidedChoices | None = None
    grammar: Spec | None = None
    json_object: bool | None = None
    structural_tag: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    whitespace_pattern: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None


def structured_output(kind: str, spec: Any) -> StructuredOutput:  # noqa: ANN401 - as the request gave it
    if kind == "json_schema":
        return StructuredOutput("json_schema", schema_text(spec))
    if kind == "choice":
        return StructuredOutput("choice", tuple(spec))
    return StructuredOutput(kind, spec)  # type: ignore[arg-type]  # kind is one of STRUCTURED_KINDS here


STRUCTURED_FIELDS = ("response_format (json_object or json_schema), guided_json, guided_regex, guided_choice, "
                     "guided_grammar, structured_outputs' json, regex, choice, grammar or json_object (true)")
