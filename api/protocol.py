"""Request bodies of the OpenAI-compatible routes (pydantic); the answers are api/response_models.py's.

Every documented field of OpenAI's completions and chat completions, and vLLM's extensions, is accepted. Unknown
fields are ignored with a warning naming them in the log (as vLLM does), so that a client sending a newer field
still works. A documented field that slora does not implement is accepted only at its neutral value, its schema
admits only that value, and any other value is a 400 naming the field ("not supported"). Fields that cannot change
the answer (store, metadata, service_tier, prompt_cache_key, ...) are accepted at any valid value and ignored.
Every field is bounded (api/field_types.py).
"""
import json
import logging
import reprlib
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from slora.api import tool_calls
from slora.api.chat_messages import (
    ChatMessage,
    Document,
    FunctionChoice,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    Prediction,
    TemplateKwargs,
    Tool,
    ToolChoice,
)
from slora.api.field_types import (
    IGNORED,
    IN_VOCABULARY,
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_DOCUMENTS,
    MAX_LENGTH_PENALTY,
    MAX_MESSAGES,
    MAX_N,
    MAX_PATH_CHARS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_REPETITION_PENALTY,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
    MAX_TOKENS_RULE,
    MAX_TOOLS,
    NEUTRAL_ONLY,
    VALID_UNICODE,
    GuidedChoices,
    JsonObject,
    LogitBias,
    Logprobs,
    Metadata,
    ModelName,
    Name,
    Penalty,
    Prompt,
    SchemaValue,
    Spec,
    Stop,
    Text,
    TokenId,
    not_supported,
)
from slora.api.schema_rules import (
    at_most_one,
    beam_search_rules,
    forced_tool_choice,
    given,
    implies,
    never_both,
    prompt_form_rules,
    stated_rules,
    tool_rules,
)
from slora.api.structured_fields import STRUCTURED_FIELDS, ResponseFormat, StructuredOutputs, structured_output
from slora.sampling.params import FLOAT32_MAX
from slora.sampling.structured_output import StructuredOutput

logger = logging.getLogger(__name__)
_NAMES = reprlib.Repr()                     # names of ignored fields, as the log shows them: bounded
_NAMES.maxlist, _NAMES.maxstring = 16, 64
# What an adapter may be called (declared here so the schema says it; the admin routes check the same).
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
AdapterName = Annotated[str, Field(pattern=ADAPTER_NAME_PATTERN,
                                   description="1-128 letters, digits, '.', '_' or '-', starting with a letter "
                                               "or digit.")]
AdapterPath = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS), VALID_UNICODE]


class Tolerant(BaseModel):
    """A request body whose unknown fields are ignored, with a warning naming them (as vLLM does): a client
    that sends a field newer than this server still works, and the log says what was not understood."""

    model_config = ConfigDict(extra="allow")

    @model_validator(mode="after")
    def _ignore_unknown_fields(self) -> "Tolerant":
        extra = self.__pydantic_extra__
        if extra:
            logger.warning("%s: ignoring unknown fields %s", type(self).__name__, _NAMES.repr(sorted(extra)))
            extra.clear()
        return self


class StreamOptions(Tolerant):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = Field(False, description="vLLM: every chunk carries the usage so far.")
    include_obfuscation: bool | None = Field(None, description="Accepted; no obfuscation field is sent.")


class SamplingRequest(Tolerant):
    """Fields shared by completions and chat completions."""

    # The allOf of the schema states the rules across fields (schema_rules).
    model_config = ConfigDict(json_schema_extra=stated_rules)
    model: ModelName
    max_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="0: the prompt only (with echo and "
                                                                          "logprobs, its loglikelihood). "
                                                                          + MAX_TOKENS_RULE)
    max_completion_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS,
                                              description="Wins over max_tokens. " + MAX_TOKENS_RULE)
    temperature: float | None = Field(None, ge=0, le=FLOAT32_MAX, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1, allow_inf_nan=False)
    n: int = Field(1, ge=1, le=MAX_N, description="At most the server's --max-n; the prompts times n (or best_of) at "
                                                  "most its --max-choices.")
    best_of: int | None = Field(None, ge=1, le=MAX_N, description="That many samples run; the n with the highest "
                                                                  "cumulative logprob are returned. With "
                                                                  "use_beam_search: the beam width, at most the "
                                                                  "server's --max-beam-width. At least n, at most "
                                                                  "the server's --max-n; with stream, at most n "
                                                                  "unless use_beam_search.")
    stop: Stop | None = Field(None, description="At most the server's --max-stop-sequences sequences of at most "
                                                "--max-stop-length characters.")
    seed: int | None = Field(None, ge=INT64_MIN, le=INT64_MAX,
                             description="Sample i uses seed + i, so seed + (best_of or n) - 1 must fit in int64 "
                                         "too.")
    user: Name | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = Field(None, description="Only with stream true.")
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = Field(None, description="Token id (as a string) -> bias added to its logit. "
                                                           f"The ids {IN_VOCABULARY}.")
    response_format: ResponseFormat | None = None
    # Extensions shared with vLLM.
    top_k: int | None = Field(None, ge=-1, le=INT32_MAX, description="0 or -1: no top-k filter.")
    min_p: float | None = Field(None, ge=0, le=1, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, gt=0, le=MAX_REPETITION_PENALTY, allow_inf_nan=False,
                                             description="1: none.")
    min_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="At most max_tokens.")
    ignore_eos: bool | None = False
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    prompt_logprobs: Logprobs | None = Field(None, description="vLLM: logprobs of the prompt's tokens. Not with "
                                                                "stream true.")
    return_token_ids: bool | None = False    # add `token_ids` (and `prompt_token_ids`) to the choices
    return_tokens_as_token_ids: bool | None = Field(False, description='Tokens in logprobs as "token_id:<id>".')
    add_special_tokens: bool | None = Field(None, description="Default: true for completions, false for chat.")
    truncate_prompt_tokens: int | None = Field(None, ge=1, le=MAX_PROMPT_TOKEN_IDS,
                                               description="Keep only the prompt's last this many tokens.")
    guided_json: SchemaValue | None = None
    guided_regex: Spec | None = None
    guided_choice: GuidedChoices | None = None
    guided_grammar: Spec | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_decoding_backend: Name | None = Field(None, description=IGNORED)
    request_id: Name | None = Field(None, description=IGNORED)
    guided_whitespace_pattern: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    skip_special_tokens: Annotated[Literal[True], Field(description=NEUTRAL_ONLY), not_supported("true")] = True
    spaces_between_special_tokens: Annotated[Literal[True], Field(description=NEUTRAL_ONLY),
                                             not_supported("true")] = True
    include_stop_str_in_output: Annotated[Literal[False], Field(description=NEUTRAL_ONLY),
                                          not_supported("false")] = False
    use_beam_search: bool | None = Field(False, description=(
        "vLLM: a beam search of width best_of (default: n); the n best beams are the choices, streamed whole when "
        "the search ends. Not with temperature other than 0 or 1, top_p, top_k, min_p, penalties, logit_bias, "
        "stop, min_tokens or a structured output."))
    length_penalty: float | None = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY, allow_inf_nan=False,
                                         description="Only with use_beam_search: a finished beam scores its "
                                                     "cumulative logprob over its length to this power; above 0 "
                                                     "favours longer beams.")
    early_stopping: bool | Literal["never"] | None = Field(False, description=(
        "Only with use_beam_search, as transformers': true ends the search once best_of (or n) beams have "
        "finished; false once no running beam is likely to beat them; \"never\" once none can."))
    allowed_token_ids: Annotated[list[TokenId] | None, Field(max_length=0, description=NEUTRAL_ONLY),
                                 not_supported("an empty list or null")] = None
    bad_words: Annotated[list[str] | None, Field(max_length=0, description=NEUTRAL_ONLY),
                         not_supported("an empty list or null")] = None
    logits_processors: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    priority: Annotated[int, Field(ge=-2 ** 31, lt=2 ** 31, description=(
        "Lower is admitted first among this API key's own requests, as vLLM's priority; it never moves one tenant "
        "ahead of another's fair share. Needs --scheduling-policy priority or vtc (vtc is the default with a "
        "tenants file)."))] = 0
    cache_salt: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    kv_transfer_params: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    vllm_xargs: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        """The rules across fields that the schema states: those checked of any body, and those checked
        before generating."""
        return [*cls.request_rules(), *cls.generation_rules()]

    @classmethod
    def request_rules(cls) -> list[dict[str, Any]]:
        """Rules checked of every body (the validators, GenerationService.check_request)."""
        streamed = given("stream", {"const": True})
        return [implies(given("stream_options"), streamed, "stream_options only with stream true"),
                never_both(streamed, given("prompt_logprobs"), "prompt_logprobs not with stream true")]

    @classmethod
    def generation_rules(cls) -> list[dict[str, Any]]:
        """Rules checked only before generating (GenerationService's structured-output check, SamplingParams'
        checks of beam search)."""
        return [at_most_one(cls.structured_sources(), f"At most one structured output: {STRUCTURED_FIELDS}"),
                *beam_search_rules(cls.structured_sources())]

    @classmethod
    def structured_sources(cls) -> list[dict[str, Any]]:
        """JSON Schema of each way of asking for a structured output, as structured_outputs_given finds them."""
        response_format = {"type": "object", "properties": {"type": {"enum": ["json_object", "json_schema"]}}}
        outputs = [given(name) for name in ("json", "regex", "choice", "grammar")]
        outputs.append(given("json_object", {"const": True}))
        return [given("response_format", response_format),
                *(given(f"guided_{kind}") for kind in ("json", "regex", "choice", "grammar")),
                *(given("structured_outputs", {"type": "object", **output}) for output in outputs)]

    @field_validator("best_of")
    @classmethod
    def _best_of_at_least_n(cls, best_of: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n")           # absent when n itself was refused
        if best_of is not None and n is not None and best_of < n:
            raise ValueError(f"best_of must be at least n={n}")
        return best_of

    @field_validator("seed")
    @classmethod
    def _last_sample_seed_fits(cls, seed: int | None, info: ValidationInfo) -> int | None:
        samples = info.data.get("best_of") or info.data.get("n")   # absent when it was refused
        if seed is not None and samples is not None and seed + samples - 1 > INT64_MAX:
            raise ValueError(f"seed + {'best_of' if info.data.get('best_of') else 'n'} - 1 must be at most "
                             f"{INT64_MAX} (sample i uses seed + i)")
        return seed

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def logit_bias_ids(self) -> dict[int, float]:
        return {int(token): bias for token, bias in (self.logit_bias or {}).items()}

    def structured_outputs_given(self) -> list[tuple[str, StructuredOutput]]:
        """(the field, what it asks for) of every structured-output field given; ValueError naming a bad one.
        Exactly one may be given: the caller refuses more."""
        found: list[tuple[str, str, Any]] = []
        if self.response_format is not None and self.response_format.type != "text":
            spec = self.response_format.json_schema.schema_ if self.response_format.json_schema else None
            found.append(("response_format", "json_object" if spec is None else "json_schema", spec))
        for field, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                            ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                found.append((field, kind, getattr(self, field)))
        outputs = self.structured_outputs
        if outputs is not None:
            for name, kind, value in (("json", "json_schema", outputs.json_), ("regex", "regex", outputs.regex),
                                      ("choice", "choice", outputs.choice), ("grammar", "grammar", outputs.grammar)):
                if value is not None:
                    found.append((f"structured_outputs.{name}", kind, value))
            if outputs.json_object:
                found.append(("structured_outputs.json_object", "json_object", None))
        return [(field, structured_output(kind, spec)) for field, kind, spec in found]


class CompletionRequest(SamplingRequest):
    """A completion: its rules across fields are the allOf of this schema. Strings must be valid Unicode: a lone
    surrogate (a \\ud800 escape without its pair) is refused."""

    prompt: Prompt = Field(description=f"Token ids {IN_VOCABULARY}. Each prompt shorter than the model's context; "
                                       "text at most the server's --max-prompt-chars characters together.")
    max_tokens: int | None = Field(16, ge=0, le=MAX_TOKENS, description="0: the prompt only (with echo and "
                                                                        "logprobs, its loglikelihood). "
                                                                        + MAX_TOKENS_RULE)
    echo: bool | None = Field(False, description="The prompt comes first in the text (and in logprobs).")
    logprobs: Logprobs | None = Field(None, description="Each token's logprob, and the this many most likely "
                                                        "tokens at each position.")
    suffix: Annotated[Literal[""] | None, Field(description=NEUTRAL_ONLY), not_supported("an empty string or null")] \
        = None
    prompt_embeds: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None

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



class ChatCompletionRequest(SamplingRequest):
    """A chat completion: its rules across fields are the allOf of this schema. Strings must be valid Unicode: a
    lone surrogate (a \\ud800 escape without its pair) is refused."""

    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES,
                                        description="Rendered shorter than the model's context; at most the "
                                                    "server's --max-prompt-chars characters of text together (with "
                                                    "tools, documents and chat_template_kwargs).")
    logprobs: bool | None = Field(False, description="Each output token's logprob.")
    top_logprobs: Logprobs | None = Field(None, description="With logprobs: this many most likely tokens per "
                                                            "position.")
    echo: bool | None = Field(False, description="vLLM: the answer starts with the last message's content when "
                                                 "that message has the answer's role.")
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Passed to the chat template (not with tool_choice \"none\"); parsed back into "
                          "tool_calls with --enable-auto-tool-choice.")
    tool_choice: ToolChoice | None = Field(
        None, description='"required" or a named function: the answer is made a call (structured output), '
                          "returned in tool_calls; not with another structured output, and only with tools (or "
                          "functions), among which a named function must be.")
    functions: Annotated[list[FunctionDefinition], Field(max_length=MAX_TOOLS)] | None = Field(
        None, description="Legacy form of tools: taken as tools of type function.")
    function_call: FunctionChoice | None = Field(
        None, description="Legacy form of tool_choice; the answer's call is also in message.function_call. A named "
                          "function must be among the functions (or tools).")
    parallel_tool_calls: bool | None = Field(None, description='false: tool_choice "required" makes one call.')
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = Field(
        None, description="Passed to the chat template, which may use it.")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description=IGNORED)
    store: bool | None = Field(None, description=IGNORED + " Nothing is stored.")
    metadata: Metadata | None = Field(None, description=IGNORED)
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = Field(
        None, description=IGNORED)
    prompt_cache_key: Name | None = Field(None, description=IGNORED)
    prompt_cache_retention: Literal["in_memory", "24h"] | None = Field(None, description=IGNORED)
    prompt_cache_options: JsonObject | None = Field(None, description=IGNORED)
    safety_identifier: Name | None = Field(None, description=IGNORED)
    prediction: Prediction | None = Field(None, description=IGNORED)
    modalities: Annotated[list[Literal["text"]] | None, Field(max_length=1, description=NEUTRAL_ONLY),
                          not_supported('["text"] or null')] = None
    audio: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    web_search_options: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    moderation: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None
    # vLLM extensions.
    add_generation_prompt: bool = True
    continue_final_message: bool | None = Field(False, description="The last message, which must be the "
                                                                   "assistant's, is left open for the model to "
                                                                   "continue (add_generation_prompt false).")
    chat_template_kwargs: TemplateKwargs | None = Field(
        None, description="More variables for the chat template; none may be named as a parameter of the template "
                          "call itself (messages, tools, documents, tokenize, add_generation_prompt, "
                          "continue_final_message, chat_template, ... and the tokenizer's apply_chat_template's).")
    documents: Annotated[list[Document], Field(max_length=MAX_DOCUMENTS)] | None = Field(
        None, description="Passed to the chat template (for retrieval-augmented templates).")
    include_reasoning: bool | None = Field(True, description=IGNORED)
    chat_template: Annotated[None, Field(description=NEUTRAL_ONLY + " The model's own template is used."),
                             not_supported("null")] = None
    mm_processor_kwargs: Annotated[None, Field(description=NEUTRAL_ONLY), not_supported("null")] = None

    @classmethod
    def request_rules(cls) -> list[dict[str, Any]]:
        """SamplingRequest's, top_logprobs' validator and GenerationService's checks of chats and tools."""
        return [*super().request_rules(),
                implies(given("top_logprobs", {"type": "integer", "minimum": 1}), given("logprobs", {"const": True}),
                        "top_logprobs above 0 needs logprobs true"),
                implies(given("continue_final_message", {"const": True}),
                        given("add_generation_prompt", {"const": False}),
                        "continue_final_message true needs add_generation_prompt false"),
                *tool_rules()]

    @classmethod
    def structured_sources(cls) -> list[dict[str, Any]]:
        """SamplingRequest's, and a forced tool choice: its call is a structured output of its own."""
        return [*super().structured_sources(), forced_tool_choice()]

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs_need_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs set to true")
        return top

    @property
    def text_chars(self) -> int:
        """Characters of text the chat template may render: messages, tools, documents and template variables."""
        chars = sum(m.text_chars for m in self.messages)
        for extra in (self.tools, self.functions, self.documents):
            if extra:
                chars += len(json.dumps([item if isinstance(item, dict) else item.model_dump() for item in extra],
                                        ensure_ascii=False))
        if self.chat_template_kwargs:
            chars += len(json.dumps(self.chat_template_kwargs, ensure_ascii=False))
        return chars

    @property
    def legacy_functions(self) -> bool:
        """Whether the request uses the deprecated `functions` / `function_call` in place of tools."""
        return self.tools is None and self.tool_choice is None and \
            (self.functions is not None or self.function_call is not None)

    @property
    def tool_choice_param(self) -> str:
        """The field that gave the tool choice, for errors."""
        return "function_call" if self.tool_choice is None and self.function_call is not None else "tool_choice"

    def effective_tools(self) -> list[Tool] | None:
        """tools, or the legacy functions as tools of type function."""
        if self.tools is not None:
            return self.tools
        if self.functions is not None:
            return [Tool(function=function) for function in self.functions]
        return None

    def effective_tool_choice(self) -> "str | NamedToolChoice | None":
        """tool_choice, or the legacy function_call as one ("none", "auto" or the named function)."""
        if self.tool_choice is not None or self.function_call is None:
            return self.tool_choice
        if isinstance(self.function_call, str):
            return self.function_call
        return NamedToolChoice(function=self.function_call)

    def forced_tool(self) -> NamedFunction | Literal["required"] | None:
        """The call the answer must be: "required" (one or more of the tools), a named function, or None."""
        choice = self.effective_tool_choice()
        if choice == "required":
            return "required"
        return choice.function if isinstance(choice, NamedToolChoice) else None

    def template_tools(self) -> list[dict[str, Any]] | None:
        """tools (or the legacy functions, as tools) as chat templates take them; none with tool_choice "none".
        vLLM passes them even then by default (it drops them only with --exclude-tools-when-tool-choice-none);
        slora drops them: a template shown tools asks the model to call them, which "none" forbids, and whose
        calls would not be parsed."""
        tools = self.effective_tools()
        if not tools or self.effective_tool_choice() == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in tools]

    def structured_outputs_given(self) -> list[tuple[str, StructuredOutput]]:
        """As SamplingRequest's, and a forced tool choice's: the JSON schema of its call (as vLLM does it)."""
        given = super().structured_outputs_given()
        forced = self.forced_tool()
        tools = self.effective_tools() or []
        if forced == "required":
            functions = [(tool.function.name, tool.function.parameters) for tool in tools]
            schema = tool_calls.required_schema(functions, parallel=self.parallel_tool_calls is not False)
        elif forced is not None:
            parameters = next((t.function.parameters for t in tools if t.function.name == forced.name), None)
            schema = tool_calls.parameters_schema(parameters)
        else:
            return given
        return [*given, (self.tool_choice_param, structured_output("json_schema", schema))]


class TokenizeRequest(Tolerant):
    """vLLM's `POST /tokenize` body with a prompt (and without messages, which make it the chat form)."""

    model_config = ConfigDict(json_schema_extra=prompt_form_rules)
    model: ModelName | None = None
    prompt: Text = Field(description="At most the server's --max-prompt-chars characters.")
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class TokenizeChatRequest(ChatCompletionRequest):
    """vLLM's `POST /tokenize` body with chat messages: the ids are the prompt the chat route would run."""

    # Optional here (the base model by default), where the chat route requires it: the route fills it in once
    # validated, before any use as a ChatCompletionRequest; mypy sees the base's field widened.
    model: ModelName | None = None  # type: ignore[assignment]
    return_token_strs: bool | None = False

    @classmethod
    def schema_rules(cls) -> list[dict[str, Any]]:
        """Only the rules checked of every body: nothing is generated, so the structured output is not looked at
        (as vLLM's /tokenize ignores it)."""
        return cls.request_rules()


class DetokenizeRequest(Tolerant):
    """vLLM's `POST /detokenize` body; model is optional (the tokenizer is the base model's)."""

    model: ModelName | None = None
    tokens: Annotated[list[TokenId], Field(max_length=MAX_PROMPT_TOKEN_IDS)] = Field(
        description=f"Token ids {IN_VOCABULARY}.")


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
