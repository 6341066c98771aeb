"""Request bodies of the OpenAI-compatible routes (pydantic) and builders of the response objects.

Unknown fields are refused (as OpenAI does) so that a misspelt parameter is a 400, not silently ignored.
Fields that OpenAI has but slora does not implement are accepted only at their neutral value, and their schema
admits only that value.

Every field is bounded here, so that a hostile body is refused while it is validated, before any work is done
for it, and /openapi.json shows the bounds. The caps are hard ones, far above the server's defaults; its
settings (max_n, max_choices, max_stop_sequences, max_stop_length, max_prompt_chars) tighten them at run time.
"""
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
)
from pydantic_core import PydanticCustomError

from slora.sampling_params import MAX_SEED, MAX_TOP_K, MIN_SEED

INT64_MIN, INT64_MAX = MIN_SEED, MAX_SEED     # seeds: the sampler's int64
INT32_MAX = MAX_TOP_K                         # token ids and top_k: the sampler and kernels index in int32
MAX_N = 128                                 # samples per prompt
MAX_PROMPTS = 1024                          # prompts in one completion request
MAX_TEXT_CHARS = 2 ** 24                    # characters of one prompt, message or content part
MAX_PROMPT_TOKEN_IDS = 2 ** 20              # token ids of one prompt
MAX_MESSAGES = 1024
MAX_CONTENT_PARTS = 1024                    # text parts of one message
MAX_TOKENS = 2 ** 24                        # max_tokens / max_completion_tokens
MAX_STOP_SEQUENCES = 16
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024                   # enough to list every token of a small vocabulary
MAX_NAME_CHARS = 256                        # model, user, message and adapter names
MAX_PATH_CHARS = 4096


def _valid_unicode(value: Any) -> Any:  # noqa: ANN401 - the raw JSON value, checked before its type
    """Refuse lone surrogates, naming where: JSON's \\ud800 escapes decode to them, and no tokenizer and no
    UTF-8 encoder accepts them (pydantic's own refusal of them does not say why)."""
    if isinstance(value, str) and not value.isascii():   # the common case costs one pass in C, no copy
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ValueError(f"must be valid Unicode, but character {exc.start} is a lone surrogate "
                             f"(U+{ord(value[exc.start]):04X})") from None
    return value


def _not_supported(accepted: str) -> WrapValidator:
    """Keeps the field's own validation and schema (which admit only its neutral value) but words the refusal:
    the value is not wrong, slora does not implement it yet."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401 - any JSON value
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("not_supported", "not supported yet: only {accepted} is accepted",
                                      {"accepted": accepted}) from None
    return WrapValidator(validate)


VALID_UNICODE = BeforeValidator(_valid_unicode)
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), VALID_UNICODE]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), VALID_UNICODE]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), VALID_UNICODE]
# What an adapter may be called (declared here so the schema says it; the admin routes check the same).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AdapterName = Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN,
                                   description="1-128 letters, digits, '.', '_' or '-', starting with a letter "
                                               "or digit.")]
AdapterPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), VALID_UNICODE]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS), VALID_UNICODE]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), VALID_UNICODE]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
NEUTRAL_ONLY = "Not supported yet: only the neutral value shown is accepted."


def _string_or_list(value: Any) -> str | None:  # noqa: ANN401 - the raw JSON value
    """The form of a field that is a string or a list, so that only that form is validated and its error,
    not the other form's, is the one reported."""
    if isinstance(value, str):
        return "string"
    return "list" if isinstance(value, list) else None


def _prompt_kind(value: Any) -> str | None:  # noqa: ANN401 - the raw JSON value
    """Which form a prompt has, from its first item, so that only that form is validated (a plain union
    would validate a long list once per form, and report every form's errors)."""
    if isinstance(value, str):
        return "text"
    if not isinstance(value, list):
        return None
    if not value or isinstance(value[0], str):
        return "texts"
    return "token_id_lists" if isinstance(value[0], list) else "token_ids"


Prompt = Annotated[
    Annotated[PromptText, Tag("text")]
    | Annotated[list[PromptText], Tag("texts"), Field(min_length=1, max_length=MAX_PROMPTS)]
    | Annotated[TokenIds, Tag("token_ids"), Field(min_length=1)]
    | Annotated[list[TokenIds], Tag("token_id_lists"), Field(min_length=1, max_length=MAX_PROMPTS)],
    Discriminator(_prompt_kind, custom_error_type="invalid_prompt",
                  custom_error_message="must be a string, a list of strings, a list of token ids or a list of "
                                       "lists of token ids")]
Stop = Annotated[
    Annotated[StopString, Tag("string")]
    | Annotated[list[StopString], Tag("list"), Field(max_length=MAX_STOP_SEQUENCES)],
    Discriminator(_string_or_list, custom_error_type="invalid_stop",
                  custom_error_message="must be a string or a list of strings")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(extra="forbid")

    model: ModelName
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: Stop | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="Sample i of n uses seed + i, so seed + n - 1 must fit in int64 too.")
    user: Name | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=0, le=0, description=NEUTRAL_ONLY), _not_supported("0")] = 0.0
    frequency_penalty: Annotated[float, Field(ge=0, le=0, description=NEUTRAL_ONLY), _not_supported("0")] = 0.0
    logit_bias: Annotated[dict[str, float] | None, Field(max_length=0, description=NEUTRAL_ONLY),
                          _not_supported("an empty object or null")] = None
    # Extensions shared with vLLM.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: no top-k filter.")
    ignore_eos: bool = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    return_token_ids: bool = False           # add `token_ids` (and `prompt_token_ids`) to the choices

    @field_validator("seed")
    @classmethod
    def _last_sample_seed_fits(cls, seed: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")           # absent when n itself was refused
        if seed is not None and n is not None and seed + n - 1 > INT64_MAX:
            raise ValueError(f"seed + n - 1 must be at most {INT64_MAX} (sample i uses seed + i)")
        return seed

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    echo: Annotated[Literal[False], Field(description=NEUTRAL_ONLY), _not_supported("false")] = False
    logprobs: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="Not supported yet: only equal to n.")
    suffix: Annotated[Literal[""] | None, Field(description=NEUTRAL_ONLY), _not_supported("an empty string or null")] \
        = None

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        if best_of is not None and best_of != info.data.get("n"):
            raise ValueError("best_of is not supported yet (it may only equal n)")
        return best_of

    @property
    def num_prompts(self) -> int:
        single = isinstance(self.prompt, str) or isinstance(self.prompt[0], int)
        return 1 if single else len(self.prompt)

    @property
    def text_chars(self) -> int:
        """Characters of text to tokenize (none for token ids)."""
        if isinstance(self.prompt, str):
            return len(self.prompt)
        return sum(len(p) for p in self.prompt if isinstance(p, str))


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: Text


Content = Annotated[
    Annotated[Text, Tag("string")]
    | Annotated[list[TextPart], Tag("list"), Field(max_length=MAX_CONTENT_PARTS)],
    Discriminator(_string_or_list, custom_error_type="invalid_content",
                  custom_error_message="must be a string or a list of text parts")]


class ChatMessage(BaseModel):
    # Extra fields (tool_call_id, ...) that some clients send with plain messages are ignored.
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant"]
    content: Content | None = None
    name: Name | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    @property
    def text_chars(self) -> int:
        if self.content is None or isinstance(self.content, str):
            return len(self.content or "")
        return sum(len(part.text) for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: Annotated[Literal[False], Field(description=NEUTRAL_ONLY), _not_supported("false")] = False
    top_logprobs: Annotated[int | None, Field(ge=0, le=0, description=NEUTRAL_ONLY), _not_supported("0 or null")] \
        = None
    add_generation_prompt: bool = True       # vLLM extension

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def text_chars(self) -> int:
        return sum(m.text_chars for m in self.messages)


class AdapterLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: AdapterName
    path: AdapterPath
    public: bool = False
    owner: Name | None = None                # admins: load into another tenant's namespace


class LoadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/load_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: AdapterName
    lora_path: AdapterPath


class UnloadLoraAdapterRequest(BaseModel):
    """vLLM's `POST /v1/unload_lora_adapter` body."""

    model_config = ConfigDict(extra="ignore")
    lora_name: Name
    lora_int_id: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX)


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
