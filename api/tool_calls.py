"""Tool calls parsed out of a chat answer (`slora serve --enable-auto-tool-choice --tool-call-parser hermes`).

The hermes format, which Hermes, Qwen2.5 and other models write: each call is a block

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

anywhere in the answer. A block becomes a call when it holds a JSON object whose "name" is one of the request's
tools and whose "arguments" (if given) is an object; any other block (malformed JSON, an unknown name) stays in
the content as it was written. The content is the text outside the calls' blocks, None if that is only
whitespace. A last block left open (the answer stopped before `</tool_call>`) counts when its JSON is complete,
as vLLM's hermes parser reads it.

A forced tool choice (`tool_choice: "required"` or a named function), as vLLM does it, needs no parser flag:
the answer is made to match a JSON schema (structured output) and read back as calls. "required" is an array
of at least one `{"name", "parameters"}` object, one per call, each name one of the tools' and its parameters
matching that tool's; a named function's answer is its parameters object alone. `parallel_tool_calls: false`
caps the array at one call, which vLLM does not do, but OpenAI documents.

Pure functions: the chat routes call them on the final text (and, while streaming, `streamable` on the text
so far, which holds back everything from the first `<tool_call>` on, or all of a forced answer).
"""
import json
import re
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

START, END = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str              # JSON text of an object

    def as_openai(self, call_id: str | None = None) -> dict[str, Any]:
        """The call as OpenAI's `message.tool_calls` shows it."""
        return {"id": call_id or new_call_id(), "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ParsedAnswer:
    content: str | None
    tool_calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def parse_hermes(text: str, tool_names: Collection[str]) -> ParsedAnswer:
    """The calls in `text` to tools named in `tool_names`, and the text outside them. Without any call the
    content is `text` unchanged."""
    calls: list[ToolCall] = []
    outside: list[str] = []
    position = 0
    for block in _BLOCK.finditer(text):
        call = _call_of(block.group(1), tool_names)
        if call is None:            # left in the content as it was written
            continue
        outside.append(text[position:block.start()])
        position = block.end()
        calls.append(call)
    if not calls:
        return ParsedAnswer(text, ())
    outside.append(text[position:])
    content = "".join(outside)
    return ParsedAnswer(content if content.strip() else None, tuple(calls))


def _call_of(inner: str, tool_names: Collection[str]) -> ToolCall | None:
    try:
        value = json.loads(inner)
    except (ValueError, RecursionError):
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or value["name"] not in tool_names:
        return None
    arguments = value.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as JSON text: it must hold an object
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def streamable(text: str) -> str:
    """What may be streamed as content of an answer not yet finished: the text before the first `<tool_call>`,
    without an end that may be the start of one (the rest waits for the end of the answer)."""
    start = text.find(START)
    if start >= 0:
        return text[:start]
    for k in range(min(len(START) - 1, len(text)), 0, -1):
        if text.endswith(START[:k]):
            return text[:-k]
    return text


class FunctionName(Protocol):
    @property
    def name(self) -> str: ...


class NamesAFunction(Protocol):
    """A request's tool (protocol.Tool) or named tool_choice (protocol.NamedToolChoice): all this module
    reads of either is its function's name. (protocol imports this module, so not those classes.)"""

    @property
    def function(self) -> FunctionName: ...


def named_function(tool_choice: str | NamesAFunction | None) -> str | None:
    """The function a named tool_choice forces; None for "auto", "none", "required" or no tool_choice."""
    return None if tool_choice is None or isinstance(tool_choice, str) else tool_choice.function.name


def tool_names_of(tools: Sequence[NamesAFunction] | None,
                  tool_choice: str | NamesAFunction | None) -> frozenset[str] | None:
    """The names whose calls count for a request with `tools` and `tool_choice`: None when nothing is parsed
    (no tools, or tool_choice "none"); a named tool_choice counts only that tool."""
    if not tools or tool_choice == "none":
        return None
    names = frozenset(tool.function.name for tool in tools)
    forced = named_function(tool_choice)
    return names if forced is None else names & {forced}


# ---- forced tool choices --------------------------------------------------------------------------------------
ParserMode = Literal["hermes", "required", "named"]
# OpenAI: "omitting parameters defines a function with an empty parameter list", so its only arguments are {}.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def parameters_schema(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """The JSON schema of a function's arguments, as the request's tool gave it (`parameters`)."""
    return NO_PARAMETERS if parameters is None else parameters


def required_schema(functions: Sequence[tuple[str, dict[str, Any] | None]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of the answer to `tool_choice: "required"`: an array of calls, each `{"name": one of
    `functions`' names, "parameters": that function's arguments}`; at most one call unless `parallel`."""
    calls = [{"type": "object", "properties": {"name": {"const": name}, "parameters": parameters_schema(parameters)},
              "required": ["name", "parameters"], "additionalProperties": False}
             for name, parameters in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parse_required(text: str, tool_names: Collection[str]) -> ParsedAnswer:
    """The calls of an answer to `tool_choice: "required"` (required_schema's array); the text as content, with
    no call, when it is not that array (cut short by max_tokens or a stop string)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ParsedAnswer(text, ())
    if not isinstance(value, list) or not value:
        return ParsedAnswer(text, ())
    calls = []
    for item in value:
        if not isinstance(item, dict) or item.get("name") not in tool_names or \
                not isinstance(item.get("parameters"), dict):
            return ParsedAnswer(text, ())
        calls.append(ToolCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return ParsedAnswer(None, tuple(calls))


def parse_named(text: str, name: str) -> ParsedAnswer:
    """The one call of an answer to a named tool_choice (the function's arguments object); the text as content,
    with no call, when it is not a JSON object (cut short)."""
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        return ParsedAnswer(text, ())
    if not isinstance(value, dict):
        return ParsedAnswer(text, ())
    return ParsedAnswer(None, (ToolCall(name, json.dumps(value, ensure_ascii=False)),))


@dataclass(frozen=True)
class ToolParser:
    """How one request's answers are read for calls: the hermes blocks of --tool-call-parser hermes, or the JSON
    of a forced tool choice (`names` then holds the named function alone)."""

    names: frozenset[str]
    mode: ParserMode

    def parse(self, text: str) -> ParsedAnswer:
        if self.mode == "required":
            return parse_required(text, self.names)
        if self.mode == "named":
            return parse_named(text, next(iter(self.names)))
        return parse_hermes(text, self.names)

    def streamable(self, text: str) -> str:
        """What may be streamed as content before the answer ends: nothing of a forced answer, which is all
        calls (sent whole at the end)."""
        return "" if self.mode != "hermes" else streamable(text)


def parser_for(tools: Sequence[NamesAFunction] | None, tool_choice: str | NamesAFunction | None,
               hermes: bool) -> ToolParser | None:
    """The parser of a request's answers (None: its answers are not read for calls): a forced tool choice
    always has one, "auto" (or no tool_choice) only with `hermes` (--enable-auto-tool-choice)."""
    names = tool_names_of(tools, tool_choice)
    if names is None:
        return None
    if tool_choice == "required":
        return ToolParser(names, "required")
    if named_function(tool_choice) is not None:
        return ToolParser(names, "named") if names else None   # a name outside tools: the route refuses it
    return ToolParser(names, "hermes") if hermes else None
