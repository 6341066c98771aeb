"""Request bodies of the OpenAI-compatible routes (pydantic) and builders of the response objects.

Unknown fields are refused (as OpenAI does) so that a misspelt parameter is a 400, not silently ignored.
Fields that OpenAI has but slora does not implement are accepted only at their neutral value.
"""
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(min_length=1)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = Field(default=None, max_length=256)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Extensions shared with vLLM.
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False           # add `token_ids` (and `prompt_token_ids`) to the choices

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for a parameter set to a value slora does not implement."""
        if self.presence_penalty or self.frequency_penalty:
            return ("presence_penalty" if self.presence_penalty else "frequency_penalty",
                    "presence_penalty and frequency_penalty are not supported; leave them at 0")
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        return None


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def unsupported(self) -> tuple[str, str] | None:
        if self.echo:
            return "echo", "echo is not supported"
        if self.logprobs is not None:
            return "logprobs", "logprobs are not supported"
        if self.best_of is not None and self.best_of != self.n:
            return "best_of", "best_of is not supported (it may only equal n)"
        if self.suffix:
            return "suffix", "suffix is not supported"
        return super().unsupported()


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # Extra fields (tool_call_id, ...) that some clients send with plain messages are ignored.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True       # vLLM extension

    def unsupported(self) -> tuple[str, str] | None:
        if self.logprobs or self.top_logprobs:
            return "logprobs", "logprobs are not supported"
        return super().unsupported()

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class AdapterLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    path: str
    public: bool = False
    owner: str | None = None                 # admins: load into another tenant's namespace


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


# ---- responses ---------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_choice(index: int, text: str, finish_reason: str | None,
                      token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                              "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_delta_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      token_ids: list[int] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response_object(kind: str, response_id: str, created: int, model: str, choices: list[dict],
                    usage_value: dict | None, include_usage_key: bool = True) -> dict:
    body: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model,
                            "choices": choices}
    if include_usage_key:
        body["usage"] = usage_value
    return body


def model_card(model_id: str, created: int, owned_by: str, parent: str | None, max_model_len: int | None) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by, "root": model_id,
            "parent": parent, "max_model_len": max_model_len}
