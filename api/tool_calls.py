"""Tool calls parsed out of a chat answer (`slora serve --enable-auto-tool-choice --tool-call-parser hermes`).

The hermes format, which Hermes, Qwen2.5 and other models write: each call is a block

    <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>

anywhere in the answer. A block becomes a call when it holds a JSON object whose "name" is one of the request's
tools and whose "arguments" (if given) is an object; any other block (malformed JSON, an unknown name) stays in
the content as it was written. The content is the text outside the calls' blocks, None if that is only
whitespace. A last block left open (the answer stopped before `</tool_call>`) counts when its JSON is complete,
as vLLM's hermes parser reads it.

Pure functions: the chat routes call them on the final text (and, while streaming, `streamable` on the text
so far, which holds back everything from the first `<tool_call>` on).
"""
import json
import re
import uuid
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

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


def tool_names_of(tools: list[Any] | None, tool_choice: Any) -> frozenset[str] | None:  # noqa: ANN401
    """The names whose calls count for a request with `tools` (protocol.Tool) and `tool_choice`: None when
    nothing is parsed (no tools, or tool_choice "none"); a named tool_choice counts only that tool."""
    if not tools or tool_choice == "none":
        return None
    names = frozenset(tool.function.name for tool in tools)
    function = getattr(tool_choice, "function", None)
    if function is not None:
        names = names & {function.name}
    return names
