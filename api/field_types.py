"""The bounded field types and caps of the request bodies.

Every value is capped here, so that a hostile body is refused while it is validated, before any work is done for
it, and /openapi.json shows the bounds.

The caps are hard ones, far above the server's defaults; its settings (max_n, max_choices, max_stop_sequences,
max_stop_length, max_prompt_chars) tighten them at run time (api/request_checks.py).
"""
import json
from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BeforeValidator,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
)
from pydantic.json_schema import JsonDict
from pydantic_core import PydanticCustomError

from slora.sampling.params import MAX_LOGIT_BIAS, MAX_LOGPROBS, MAX_PENALTY, MAX_SEED, MAX_TOP_K, MIN_SEED

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
# Beam search divides a score by length ** length_penalty: past this, long beams' powers overflow a float (the
# search would fail), and useful values lie near 1 anyway.
MAX_LENGTH_PENALTY = 10.0


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


def not_supported(accepted: str) -> WrapValidator:
    """Keeps the field's own validation and schema (which admit only its neutral value) but words the refusal:
    the value is not wrong, slora does not implement it yet."""
    def validate(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:  # noqa: ANN401 - any JSON value
        try:
            return handler(value)
        except ValidationError:
            raise PydanticCustomError("not_supported", "not supported yet: only {accepted} is accepted",
                                      {"accepted": accepted}) from None
    return WrapValidator(validate)


def bounded_json(value: Any) -> Any:  # noqa: ANN401 - a free-form JSON value
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
        bounded_json(value)
    if not isinstance(value, dict):
        raise ValueError("must be a JSON schema: an object, or a string of JSON text of one")
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def keys_matching(pattern: str) -> Callable[[JsonDict], None]:
    """json_schema_extra of a dict whose keys match `pattern`: pydantic states a key pattern only as
    patternProperties, which admit keys that do not match it (validation refuses them)."""
    def extra(schema: JsonDict) -> None:
        schema["propertyNames"] = {"pattern": pattern}
    return extra


VALID_UNICODE = BeforeValidator(_valid_unicode)
Text = Annotated[str, Field(max_length=MAX_TEXT_CHARS), VALID_UNICODE]
Name = Annotated[str, Field(max_length=MAX_NAME_CHARS), VALID_UNICODE]
ModelName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS), VALID_UNICODE]
PromptText = Annotated[str, Field(min_length=1, max_length=MAX_TEXT_CHARS), VALID_UNICODE]
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS), VALID_UNICODE]
IN_VOCABULARY = "below the model's vocabulary size (vocab_size of /tokenizer_info), known only at run time"
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX, description=f"A token id {IN_VOCABULARY}.")]
TokenIds = Annotated[list[TokenId], Field(min_length=1, max_length=MAX_PROMPT_TOKEN_IDS)]
NEUTRAL_ONLY = "Not supported yet: only the neutral value shown is accepted."
IGNORED = "Accepted and ignored: it does not change the answer."
# What the descriptions say of the limits the server's settings set (api/settings.py, `slora serve` flags).
MAX_TOKENS_RULE = ("At most the server's --max-tokens-limit, and the prompt's tokens plus max_tokens at most the "
                   "model's context (max_model_len of /v1/models).")
Spec = Annotated[str, Field(min_length=1, max_length=MAX_SPEC_CHARS), VALID_UNICODE]
JsonObject = Annotated[dict[str, Any], Field(description=f"Nested at most {MAX_JSON_DEPTH} levels deep."),
                       AfterValidator(bounded_json)]
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
                      Field(max_length=MAX_LOGIT_BIAS_ENTRIES, json_schema_extra=keys_matching(TOKEN_ID_KEY))]
Metadata = Annotated[dict[Annotated[str, Field(max_length=64), VALID_UNICODE],
                          Annotated[str, Field(max_length=512), VALID_UNICODE]], Field(max_length=MAX_METADATA)]


def string_or_list(value: Any) -> str | None:  # noqa: ANN401 - the raw JSON value
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
    Discriminator(string_or_list, custom_error_type="invalid_stop",
                  custom_error_message="must be a string or a list of strings")]
