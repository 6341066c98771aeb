"""Request bodies of the OpenAI-compatible routes (pydantic) and builders of the response objects.

Every documented field of OpenAI's completions and chat completions, and vLLM's extensions, is accepted. Unknown
fields are ignored with a warning naming them in the log (as vLLM does), so that a client sending a newer field
still works. A documented field that slora does not implement is accepted only at its neutral value, its schema
admits only that value, and any other value is a 400 naming the field ("not supported"). Fields that cannot change
the answer (store, metadata, service_tier, prompt_cache_key, ...) are accepted at any valid value and ignored.

Every field is bounded here, so that a hostile body is refused while it is validated, before any work is done
for it, and /openapi.json shows the bounds. The caps are hard ones, far above the server's defaults; its
settings (max_n, max_choices, max_stop_sequences, max_stop_length, max_prompt_chars) tighten them at run time.
"""
import json
import logging
import math
import reprlib
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
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
    model_validator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from slora.api import tool_calls
from slora.core.outputs import TokenLogprob
from slora.sampling.params import (
    FLOAT32_MAX,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_PENALTY,
    MAX_SEED,
    MAX_TOP_K,
    MIN_SEED,
)
from slora.sampling.structured_output import StructuredOutput

logger = logging.getLogger(__name__)

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
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_REPETITION_PENALTY = 1e6
MAX_NAME_CHARS = 256                        # model, user, message and adapter names
MAX_PATH_CHARS = 4096
MAX_SPEC_CHARS = 2 ** 18                    # a JSON schema (as text), regex or grammar
MAX_GUIDED_CHOICES = 1024
MAX_CHOICE_CHARS = 2 ** 16                  # characters of all choices together: each one is a branch to compile
MAX_JSON_DEPTH = 64                         # nesting of a free-form JSON value (schemas, tool parameters)
MAX_TOOLS = 128                             # OpenAI's bound on tools (and legacy functions)
MAX_TOOL_CALLS = 128                        # tool calls of one assistant message
MAX_DOCUMENTS = 256
MAX_DOCUMENT_FIELDS = 64
MAX_TEMPLATE_KWARGS = 64
MAX_METADATA = 16                           # OpenAI's bounds on metadata: 16 pairs, 64-char keys, 512-char values
LOGPROB_FLOOR = -9999.0                     # what -inf (and NaN) logprobs are reported as: JSON has no -inf
_NAMES = reprlib.Repr()                     # names of ignored fields, as the log shows them: bounded
_NAMES.maxlist, _NAMES.maxstring = 16, 64


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


def _bounded_json(value: Any) -> Any:  # noqa: ANN401 - a free-form JSON value
    """Refuse JSON nested deeper than MAX_JSON_DEPTH (walked without recursion): it is serialized again for the
    chat template or the grammar compiler, whose recursion a hostile depth would exhaust."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > MAX_JSON_DEPTH:
                raise ValueError(f"is nested deeper than {MAX_JSON_DEPTH} levels")
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return value


def schema_text(value: Any) -> str:  # noqa: ANN401 - a JSON schema given as an object or as JSON text
    """A JSON schema as the engine takes it: compact JSON text of an object. ValueError if it is not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise ValueError("must be a JSON schema: an object, or a string of JSON text of one") from None
        _bounded_json(value)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON schema: an object, or a string of JSON text of one")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _keys_matching(pattern: str) -> Callable[[JsonDict], None]:
    """json_schema_extra of a dict whose keys match `pattern`: pydantic states a key pattern only as
    patternProperties, which admit keys that do not match it (validation refuses them)."""
    def extra(schema: JsonDict) -> None:
        schema["propertyNames"] = {"pattern": pattern}
    return extra


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
IN_VOCABULARY = "below the model's vocabulary size (vocab_size of /tokenizer_info), known only at run time"
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description=f"A token id {IN_VOCABULARY}.")]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
NEUTRAL_ONLY = "Not supported yet: only the neutral value shown is accepted."
IGNORED = "Accepted and ignored: it does not change the answer."
Spec = Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS), VALID_UNICODE]
JsonObject = Annotated[dict[str, Any], Field(description=f"Nested at most {MAX_JSON_DEPTH} levels deep."),
                       AfterValidator(_bounded_json)]
# A JSON schema: an object, or (vLLM's guided_json) JSON text of one.
SchemaValue = Annotated[
    Annotated[JsonObject, Tag("object")] | Annotated[Spec, Tag("string")],
    Discriminator(lambda v: "object" if isinstance(v, dict) else "string" if isinstance(v, str) else None,
                  custom_error_type="invalid_schema",
                  custom_error_message="must be a JSON schema: an object, or a string of JSON text of one"),
    Field(description=f"A JSON schema: an object, or a string of JSON text of one; nested at most {MAX_JSON_DEPTH} "
                      "levels deep."),
    AfterValidator(lambda value: schema_text(value) and value)]


def _bounded_choices(choices: list[str]) -> list[str]:
    """Refuse choices longer than MAX_CHOICE_CHARS together: their grammar grows with them (a 1 MiB list
    compiled to 280 MB)."""
    total = sum(len(choice) for choice in choices)
    if total > MAX_CHOICE_CHARS:
        raise ValueError(f"the choices hold {total} characters together; the limit is {MAX_CHOICE_CHARS}")
    return choices


GuidedChoices = Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), VALID_UNICODE]],
                          Field(min_length=1, max_length=MAX_GUIDED_CHOICES,
                                description=f"At most {MAX_GUIDED_CHOICES} strings of at most {MAX_STOP_CHARS} "
                                            f"characters, {MAX_CHOICE_CHARS} characters together."),
                          AfterValidator(_bounded_choices)]
Logprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]
Penalty = Annotated[float, Field(ge=-MAX_PENALTY, le=MAX_PENALTY, allow_inf_nan=False)]
# OpenAI sends logit_bias with token ids as JSON object keys, so as strings of digits.
TOKEN_ID_KEY = r"^[0-9]{1,10}$"
LogitBias = Annotated[dict[Annotated[str, Field(pattern=TOKEN_ID_KEY)],
                           Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS, allow_inf_nan=False)]],
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES, json_schema_extra=_keys_matching(TOKEN_ID_KEY))]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64), VALID_UNICODE],
                          Annotated[str, Field(max_length=512), VALID_UNICODE]], Field(max_length=MAX_METADATA)]


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


# ---- rules across fields, stated in the schema ------------------------------------------------------------
# The validators below and the service (api/serving.py) refuse some combinations of fields. The schema states
# each one JSON Schema can express as an entry of the model's allOf, described in plain words, so that a client
# generated from the schema sends none of them; the rest (those that compare two values, or depend on the
# model or the server's settings) are stated in the fields' descriptions.
def given(field: str, value: dict[str, Any] | None = None) -> dict[str, Any]:
    """JSON Schema of a body with `field` present and not null (and matching `value`, when given)."""
    return {"required": [field], "properties": {field: {"not": {"type": "null"}} if value is None else value}}


def never_both(first: dict[str, Any], second: dict[str, Any], description: str) -> dict[str, Any]:
    """The rule that no body matches both `first` and `second`."""
    return {"description": description, "not": {"allOf": [first, second]}}


def implies(condition: dict[str, Any], consequence: dict[str, Any], description: str) -> dict[str, Any]:
    """The rule that a body matching `condition` matches `consequence`. The condition must require its fields
    (as given() does): `properties` alone holds for a body without them."""
    return {"description": description, "if": condition, "then": consequence}


def at_most_one(conditions: list[dict[str, Any]], description: str) -> dict[str, Any]:
    """oneOf holds for exactly one branch: none of the conditions, or one of them, never two."""
    return {"description": description, "oneOf": [{"not": {"anyOf": conditions}}, *conditions]}


def _stated_rules(schema: JsonDict, model: type[Any]) -> None:
    """json_schema_extra of the request models: their schema_rules() as the allOf of their schema."""
    schema["allOf"] = model.schema_rules()


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
                    _not_supported('"text", "json_object" or "json_schema"')]
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
    structural_tag: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    whitespace_pattern: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None


def structured_output(kind: str, spec: Any) -> StructuredOutput:  # noqa: ANN401 - as the request gave it
    if kind == "json_schema":
        return StructuredOutput("json_schema", schema_text(spec))
    if kind == "choice":
        return StructuredOutput("choice", tuple(spec))
    return StructuredOutput(kind, spec)  # type: ignore[arg-type]  # kind is one of STRUCTURED_KINDS here


STRUCTURED_FIELDS = ("response_format (json_object or json_schema), guided_json, guided_regex, guided_choice, "
                     "guided_grammar, structured_outputs' json, regex, choice, grammar or json_object (true)")
# What the descriptions say of the limits the server's settings set (api/settings.py, `slora serve` flags).
MAX_TOKENS_RULE = ("At most the server's --max-tokens-limit, and the prompt's tokens plus max_tokens at most the "
                   "model's context (max_model_len of /v1/models).")


class SamplingRequest(Tolerant):
    """Fields shared by completions and chat completions."""

    # The allOf of the schema states the rules across fields (schema_rules).
    model_config = ConfigDict(json_schema_extra=_stated_rules)
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
                                                                  "cumulative logprob are returned. At least n, at "
                                                                  "most the server's --max-n; with stream, at most "
                                                                  "n.")
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
    guided_whitespace_pattern: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    skip_special_tokens: Annotated[Literal[True], Field(description=NEUTRAL_ONLY), _not_supported("true")] = True
    spaces_between_special_tokens: Annotated[Literal[True], Field(description=NEUTRAL_ONLY),
                                             _not_supported("true")] = True
    include_stop_str_in_output: Annotated[Literal[False], Field(description=NEUTRAL_ONLY),
                                          _not_supported("false")] = False
    use_beam_search: Annotated[Literal[False], Field(description=NEUTRAL_ONLY), _not_supported("false")] = False
    length_penalty: Annotated[float, Field(ge=1, le=1, description=NEUTRAL_ONLY), _not_supported("1")] = 1.0
    allowed_token_ids: Annotated[list[TokenId] | None, Field(max_length=0, description=NEUTRAL_ONLY),
                                 _not_supported("an empty list or null")] = None
    bad_words: Annotated[list[str] | None, Field(max_length=0, description=NEUTRAL_ONLY),
                         _not_supported("an empty list or null")] = None
    logits_processors: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    priority: Annotated[int, Field(ge=0, le=0, description=NEUTRAL_ONLY), _not_supported("0")] = 0
    cache_salt: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    kv_transfer_params: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    vllm_xargs: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None

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
        """Rules checked only before generating (GenerationService's structured-output check)."""
        return [at_most_one(cls.structured_sources(), f"At most one structured output: {STRUCTURED_FIELDS}")]

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
    suffix: Annotated[Literal[""] | None, Field(description=NEUTRAL_ONLY), _not_supported("an empty string or null")] \
        = None
    prompt_embeds: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None

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
    Discriminator(_string_or_list, custom_error_type="invalid_content",
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
    type: Annotated[Literal["function"], _not_supported('"function" tools')] = "function"
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
                           Field(max_length=MAX_TEMPLATE_KWARGS, json_schema_extra=_keys_matching(TEMPLATE_NAME)),
                           AfterValidator(_bounded_json)]


class Prediction(BaseModel):
    """OpenAI's predicted output: only a speed hint, accepted and ignored."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["content"] = "content"
    content: Content


def _forced_tool_choice() -> dict[str, Any]:
    """JSON Schema of a chat body whose answer must be a call: tool_choice "required" or a named function, or
    the legacy function_call a named function."""
    return {"anyOf": [given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
                      given("function_call", {"type": "object"})]}


def _tool_rules() -> list[dict[str, Any]]:
    """GenerationService's checks of tools: each legacy field instead of its new one, a forced call with tools."""
    some_tools = {"anyOf": [given(field, {"type": "array", "minItems": 1}) for field in ("tools", "functions")]}
    return [never_both(given("tools"), given("functions"),
                       "tools and functions not both: functions is the deprecated form of tools"),
            never_both(given("tool_choice"), given("function_call"),
                       "tool_choice and function_call not both: function_call is the deprecated form of tool_choice"),
            implies(_forced_tool_choice(), some_tools,
                    'tool_choice "required" or a named function (or function_call a named function) needs tools '
                    "(or functions)")]


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
                          _not_supported('["text"] or null')] = None
    audio: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    web_search_options: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
    moderation: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None
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
                             _not_supported("null")] = None
    mm_processor_kwargs: Annotated[None, Field(description=NEUTRAL_ONLY), _not_supported("null")] = None

    @classmethod
    def request_rules(cls) -> list[dict[str, Any]]:
        """SamplingRequest's, top_logprobs' validator and GenerationService's checks of chats and tools."""
        return [*super().request_rules(),
                implies(given("top_logprobs", {"type": "integer", "minimum": 1}), given("logprobs", {"const": True}),
                        "top_logprobs above 0 needs logprobs true"),
                implies(given("continue_final_message", {"const": True}),
                        given("add_generation_prompt", {"const": False}),
                        "continue_final_message true needs add_generation_prompt false"),
                *_tool_rules()]

    @classmethod
    def structured_sources(cls) -> list[dict[str, Any]]:
        """SamplingRequest's, and a forced tool choice: its call is a structured output of its own."""
        return [*super().structured_sources(), _forced_tool_choice()]

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


def _prompt_form_rules(schema: JsonDict) -> None:
    schema["allOf"] = [{"description": "Without messages: a body with messages is the chat form",
                        "not": {"required": ["messages"]}}]


class TokenizeRequest(Tolerant):
    """vLLM's `POST /tokenize` body with a prompt (and without messages, which make it the chat form)."""

    model_config = ConfigDict(json_schema_extra=_prompt_form_rules)
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


# ---- responses ---------------------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


TokenText = Callable[[int], str]      # a token id's text, as logprobs show it
LogprobList = Sequence[TokenLogprob | None] | None


def logprob_value(value: float) -> float:
    """A logprob as JSON can carry it: -inf and NaN become LOGPROB_FLOOR (as vLLM reports them)."""
    return value if math.isfinite(value) and value > LOGPROB_FLOOR else LOGPROB_FLOOR


def padded(token_ids: Sequence[int], logprobs: LogprobList) -> list[TokenLogprob | None]:
    """One entry per token: what `logprobs` has, then None (for positions it lacks)."""
    entries = list(logprobs or [])[:len(token_ids)]
    return entries + [None] * (len(token_ids) - len(entries))


def completion_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int, token_text: TokenText,
                        offset: int = 0) -> tuple[dict[str, list[Any]], int]:
    """OpenAI's legacy logprobs of some tokens (the prompt's first has none: null) and the text offset after
    them. top_logprobs holds the `top` most likely tokens and the token itself."""
    tokens: list[str] = []
    values: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, entry in zip(token_ids, padded(token_ids, logprobs)):
        text = token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if entry is None:
            values.append(None)
            tops.append(None)
            continue
        value = logprob_value(entry.logprob)
        values.append(value)
        best: dict[str, float] = {}
        for candidate, candidate_logprob in entry.top[:top]:
            best.setdefault(token_text(candidate), logprob_value(candidate_logprob))
        best.setdefault(text, value)
        tops.append(best)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}, offset


def chat_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int, token_text: TokenText) -> dict[str, Any]:
    """OpenAI's chat logprobs of some output tokens: `{"content": [...]}`."""
    def entry_of(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob_value(logprob), "bytes": list(text.encode("utf-8"))}
    content = [{**entry_of(token_id, entry.logprob),
                "top_logprobs": [entry_of(candidate, value) for candidate, value in entry.top[:top]]}
               for token_id, entry in zip(token_ids, padded(token_ids, logprobs)) if entry is not None]
    return {"content": content}


def prompt_logprobs(token_ids: Sequence[int], logprobs: LogprobList, top: int,
                    token_text: TokenText) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token itself and the `top` most likely there."""
    if logprobs is None:
        return None
    positions: list[dict[str, dict[str, Any]] | None] = []
    for token_id, entry in zip(token_ids, padded(token_ids, logprobs)):
        if entry is None:
            positions.append(None)
            continue
        position = {str(token_id): {"logprob": logprob_value(entry.logprob), "rank": entry.rank,
                                    "decoded_token": token_text(token_id)}}
        for rank, (candidate, value) in enumerate(entry.top[:top], 1):
            position.setdefault(str(candidate), {"logprob": logprob_value(value), "rank": rank,
                                                 "decoded_token": token_text(candidate)})
        positions.append(position)
    return positions


def completion_choice(index: int, text: str, finish_reason: str | None,
                      token_ids: list[int] | None = None, prompt_token_ids: list[int] | None = None,
                      logprobs: dict[str, Any] | None = None, extra: dict[str, Any] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    choice.update(extra or {})
    return choice


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None = None,
                prompt_token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "message": {"role": "assistant", "content": text},
                              "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    if prompt_token_ids is not None:
        choice["prompt_token_ids"] = prompt_token_ids
    return choice


def chat_delta_choice(index: int, delta: dict[str, Any], finish_reason: str | None,
                      token_ids: list[int] | None = None, logprobs: dict[str, Any] | None = None) -> dict:
    choice: dict[str, Any] = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:
        choice["token_ids"] = token_ids
    return choice


def response_object(kind: str, response_id: str, created: int, model: str, choices: list[dict],
                    usage_value: dict | None, include_usage_key: bool = True,
                    extra: dict[str, Any] | None = None) -> dict:
    body: dict[str, Any] = {"id": response_id, "object": kind, "created": created, "model": model,
                            "choices": choices}
    if include_usage_key:
        body["usage"] = usage_value
    body.update(extra or {})
    return body


def model_card(model_id: str, created: int, owned_by: str, parent: str | None, max_model_len: int | None) -> dict:
    return {"id": model_id, "object": "model", "created": created, "owned_by": owned_by, "root": model_id,
            "parent": parent, "max_model_len": max_model_len}
