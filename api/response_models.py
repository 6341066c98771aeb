"""The answers of the routes as pydantic models: FastAPI serializes them and documents them in /openapi.json.

A field that an answer leaves out, rather than sending null, has the default `absent()`: answers are serialized
with `exclude_unset`, so it appears only where it was set, in the constructor or by assignment (which is why no
other field has a default). Logprobs are TypedDicts, built as plain dicts and not validated again
(SkipValidation): an answer may carry tens of thousands of them, and a pydantic model of each would cost several
times the dicts on the event loop.
"""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SkipValidation
from pydantic.json_schema import SkipJsonSchema
from typing_extensions import TypedDict


def new_id(prefix: str) -> str:
    """An answer's id: `cmpl-...`, `chatcmpl-...`."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """An answer's `created`: seconds since the epoch."""
    return int(time.time())


def _drop_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


def absent(description: str | None = None) -> Any:  # noqa: ANN401 - a pydantic Field
    """A field that is left out rather than null: documented with its type alone, without `default: null`."""
    return Field(default=None, description=description, json_schema_extra=_drop_default)


# ---- logprobs ---------------------------------------------------------------------------------------------------
class CompletionLogprobs(TypedDict):
    """OpenAI's legacy logprobs, one entry per token (with echo, the prompt's first, whose logprob is null)."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class ChatTopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(TypedDict):
    content: list[ChatTokenLogprob]


class PromptLogprob(TypedDict):
    logprob: float
    rank: int
    decoded_token: str


# vLLM's prompt_logprobs: per prompt token, null (the first) or {token id: its logprob, rank and text}.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


# ---- completions and chat completions ------------------------------------------------------------------------------
class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: SkipValidation[CompletionLogprobs | None]
    finish_reason: str | None
    token_ids: list[int] | SkipJsonSchema[None] = absent("with return_token_ids")
    prompt_token_ids: list[int] | SkipJsonSchema[None] = absent("with return_token_ids")
    prompt_logprobs: SkipValidation[PromptLogprobs | None] = absent("with prompt_logprobs")


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class AssistantFunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="JSON text of an object")


class AssistantToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: AssistantFunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None = Field(description="null when the answer is only tool calls")
    tool_calls: list[AssistantToolCall] | SkipJsonSchema[None] = absent(
        'the calls the answer made: with tool_choice "required" or a named function, or parsed with '
        "--enable-auto-tool-choice")
    function_call: AssistantFunctionCall | SkipJsonSchema[None] = absent(
        "the first call again, for a request that gave the legacy functions")


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: SkipValidation[ChatLogprobs | None]
    finish_reason: str | None
    token_ids: list[int] | SkipJsonSchema[None] = absent("with return_token_ids")
    prompt_token_ids: list[int] | SkipJsonSchema[None] = absent("with return_token_ids")


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: SkipValidation[PromptLogprobs | None] = absent("with prompt_logprobs")


# ---- streamed chunks (the `data` of each server-sent event) -----------------------------------------------------
class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | SkipJsonSchema[None] = absent("with stream_options: null but in the last chunk")


class StreamedToolCall(AssistantToolCall):
    index: int


class ChatDelta(BaseModel):
    role: Literal["assistant"] | SkipJsonSchema[None] = absent("in the first chunk of a choice")
    content: str | SkipJsonSchema[None] = absent()
    tool_calls: list[StreamedToolCall] | SkipJsonSchema[None] = absent("all at once, in the last chunk")
    function_call: AssistantFunctionCall | SkipJsonSchema[None] = absent("the first call, for the legacy functions")


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: SkipValidation[ChatLogprobs | None]
    finish_reason: str | None
    token_ids: list[int] | SkipJsonSchema[None] = absent("with return_token_ids")


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | SkipJsonSchema[None] = absent("with stream_options: null but in the last chunk")


# ---- models, adapters and the small routes ----------------------------------------------------------------------
class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: str | None
    max_model_len: int | None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class AdapterInfo(BaseModel):
    # Fields the adapter service adds pass through as they are: this model documents them, it does not filter.
    model_config = ConfigDict(extra="allow")
    name: str
    version: str
    owner: str | None = Field(description="null for other tenants' public adapters and in single-user mode")
    public: bool
    residency: Literal["pool", "host", "disk"]
    rank: int | SkipJsonSchema[None] = absent()
    target_modules: list[str] | SkipJsonSchema[None] = absent()
    pages: int | SkipJsonSchema[None] = absent()
    bytes: int | SkipJsonSchema[None] = absent()
    loaded_at: str | SkipJsonSchema[None] = absent("when it was loaded, as ISO 8601 UTC")


class AdapterList(BaseModel):
    object: Literal["list"]
    data: list[AdapterInfo]


class TenantInfo(BaseModel):
    id: str
    role: str = Field(description="admin or tenant")
    weight: float = Field(description="its share of the engine under the vtc scheduling policy")
    virtual_tokens: float = Field(description="its virtual token counter: the weighted service charged so far; the "
                                              "waiting tenant with the smallest is admitted first")
    prompt_tokens: int = Field(description="prompt tokens computed for it (cache hits and recomputation not counted)")
    output_tokens: int = Field(description="tokens generated for it")
    adapter_pages: int = Field(description="pool pages its adapters were brought into")
    max_concurrent: int | None = Field(description="sequences it may run at once (null: no limit)")
    max_queued: int = Field(description="sequences it may queue for those seats")


class TenantList(BaseModel):
    object: Literal["list"]
    scheduling_policy: str = Field(description="fcfs, priority or vtc")
    data: list[TenantInfo]


class AdapterDeleted(BaseModel):
    name: str
    owner: str | None
    deleted: Literal[True]


class Tokenized(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | SkipJsonSchema[None] = absent("with return_token_strs")


class Detokenized(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    tokenizer_class: str
    model_max_length: int
    vocab_size: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    unk_token: str | None
    chat_template: str | dict[str, str] | None = Field(description="Hugging Face tokenizers may name several")


class Version(BaseModel):
    version: str


class Health(BaseModel):
    status: Literal["ok"]
