"""The parts of a chat request: messages and their content, tools and tool choices, template inputs."""
import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

from slora.api.field_types import (
    MAX_CONTENT_PARTS,
    MAX_DOCUMENT_FIELDS,
    MAX_NAME_CHARS,
    MAX_TEMPLATE_KWARGS,
    MAX_TOOL_CALLS,
    VALID_UNICODE,
    JsonObject,
    Name,
    Text,
    bounded_json,
    keys_matching,
    not_supported,
    string_or_list,
)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: Text


class RefusalPart(BaseModel):
    """An assistant message's refusal, rendered as its text."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["refusal"]
    refusal: Text


def _part_kind(value: Any) -> str | None:  # noqa: ANN401 - the raw JSON value
    kind = value.get("type") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if kind in ("text", "refusal") else None


ContentPart = Annotated[
    Annotated[TextPart, Tag("text")] | Annotated[RefusalPart, Tag("refusal")],
    Discriminator(_part_kind, custom_error_type="not_supported",
                  custom_error_message='not supported: only "text" (and "refusal") content parts are accepted; '
                                       "this server reads text only (no images, audio or files)")]
Content = Annotated[
    Annotated[Text, Tag("string")]
    | Annotated[list[ContentPart], Tag("list"), Field(max_length=MAX_CONTENT_PARTS)],
    Discriminator(string_or_list, custom_error_type="invalid_content",
                  custom_error_message="must be a string or a list of text parts")]


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name
    arguments: Text = Field("", description="JSON text, as the model wrote it.")


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    # Extra fields that some clients send with messages are ignored.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Content | None = None
    name: Name | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOL_CALLS)] | None = None   # assistant
    tool_call_id: Name | None = None                                                         # tool
    function_call: FunctionCall | None = None                                                # legacy assistant

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text if isinstance(part, TextPart) else part.refusal for part in self.content)

    @property
    def text_chars(self) -> int:
        chars = sum(len(call.function.arguments) for call in self.tool_calls or ())
        if self.content is None or isinstance(self.content, str):
            return chars + len(self.content or "")
        return chars + sum(len(part.text if isinstance(part, TextPart) else part.refusal) for part in self.content)

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates take it. Tool-call arguments become objects where they are JSON (the
        form Hugging Face templates expect, as vLLM passes them)."""
        message: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name:
            message["name"] = self.name
        calls = list(self.tool_calls or [])
        if not calls and self.function_call is not None:
            calls = [ToolCall(function=self.function_call)]
        if calls:
            message["tool_calls"] = [{**({"id": call.id} if call.id else {}), "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": _arguments(call.function.arguments)}}
                                     for call in calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


def _arguments(text: str) -> Any:  # noqa: ANN401 - JSON
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        return text


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), VALID_UNICODE]
    description: Text | None = None
    parameters: JsonObject | None = None
    strict: bool | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Annotated[Literal["function"], not_supported('"function" tools')] = "function"
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: Name


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("string")] | Annotated[NamedToolChoice, Tag("object")],
    Discriminator(lambda v: "string" if isinstance(v, str) else "object" if isinstance(v, (dict, BaseModel)) else None,
                  custom_error_type="invalid_tool_choice",
                  custom_error_message='must be "none", "auto", "required" or {"type": "function", "function": '
                                       '{"name": ...}}')]
FunctionChoice = Annotated[
    Annotated[Literal["none", "auto"], Tag("string")] | Annotated[NamedFunction, Tag("object")],
    Discriminator(lambda v: "string" if isinstance(v, str) else "object" if isinstance(v, (dict, BaseModel)) else None,
                  custom_error_type="invalid_function_call",
                  custom_error_message='must be "none", "auto" or {"name": ...}')]
Document = Annotated[dict[Annotated[str, Field(max_length=MAX_NAME_CHARS)], Text],
                     Field(max_length=MAX_DOCUMENT_FIELDS)]
TEMPLATE_NAME = r"^[A-Za-z_][A-Za-z0-9_]{0,63}$"
TemplateKwargs = Annotated[dict[Annotated[str, Field(pattern=TEMPLATE_NAME)], Any],
                           Field(max_length=MAX_TEMPLATE_KWARGS, json_schema_extra=keys_matching(TEMPLATE_NAME)),
                           AfterValidator(bounded_json)]


class Prediction(BaseModel):
    """OpenAI's predicted output: only a speed hint, accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["content"] = "content"
    content: Content
