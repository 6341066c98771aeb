"""The rules across fields of the request bodies, as JSON Schema: each model's allOf states them.

The validators and the service's checks (api/request_checks.py) refuse some combinations of fields. The schema
states each one JSON Schema can express as an entry of the model's allOf, described in plain words, so that a client
generated from the schema sends none of them; the rest (those that compare two values, or depend on the model or
the server's settings) are stated in the fields' descriptions.
"""
from typing import Any

from pydantic.json_schema import JsonDict


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


def stated_rules(schema: JsonDict, model: type[Any]) -> None:
    """json_schema_extra of the request models: their schema_rules() as the allOf of their schema."""
    schema["allOf"] = model.schema_rules()



def forced_tool_choice() -> dict[str, Any]:
    """JSON Schema of a chat body whose answer must be a call: tool_choice "required" or a named function, or
    the legacy function_call a named function."""
    return {"anyOf": [given("tool_choice", {"anyOf": [{"const": "required"}, {"type": "object"}]}),
                      given("function_call", {"type": "object"})]}


def tool_rules() -> list[dict[str, Any]]:
    """GenerationService's checks of tools: each legacy field instead of its new one, a forced call with tools."""
    some_tools = {"anyOf": [given(field, {"type": "array", "minItems": 1}) for field in ("tools", "functions")]}
    return [never_both(given("tools"), given("functions"),
                       "tools and functions not both: functions is the deprecated form of tools"),
            never_both(given("tool_choice"), given("function_call"),
                       "tool_choice and function_call not both: function_call is the deprecated form of tool_choice"),
            implies(forced_tool_choice(), some_tools,
                    'tool_choice "required" or a named function (or function_call a named function) needs tools '
                    "(or functions)")]


def beam_search_rules(structured_sources: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SamplingParams' checks of beam search: its fields only with it, and what it does not combine with (given
    at other than its neutral value): sampling controls, penalties, logit_bias, stop strings, min_tokens, a
    structured output (`structured_sources`), and an answer of no tokens."""
    beam_search = given("use_beam_search", {"const": True})
    neutral = {"temperature": [0, 1], "top_p": [1], "top_k": [0, -1], "min_p": [0], "presence_penalty": [0],
               "frequency_penalty": [0], "repetition_penalty": [1], "min_tokens": [0]}
    # max_completion_tokens wins over max_tokens: max_tokens 0 counts only without it.
    no_tokens = [given("max_completion_tokens", {"const": 0}),
                 {"allOf": [given("max_tokens", {"const": 0}), {"not": given("max_completion_tokens")}]}]
    excluded = [*(given(field, {"not": {"enum": [None, *values]}}) for field, values in neutral.items()),
                given("logit_bias", {"type": "object", "minProperties": 1}),
                given("stop", {"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1}]}),
                *structured_sources, *no_tokens]
    tuning = [given("length_penalty", {"not": {"enum": [None, 1]}}),
              given("early_stopping", {"not": {"enum": [None, False]}})]
    return [implies({"anyOf": tuning}, beam_search, "length_penalty and early_stopping only with use_beam_search "
                                                    "true"),
            never_both(beam_search, {"anyOf": excluded},
                       "use_beam_search true takes no temperature other than 0 or 1, top_p, top_k, min_p, "
                       "penalties, logit_bias, stop, min_tokens or structured output, and max_tokens at least 1")]


def prompt_form_rules(schema: JsonDict) -> None:
    """json_schema_extra of /tokenize's prompt form: a body with messages is the chat form."""
    schema["allOf"] = [{"description": "Without messages: a body with messages is the chat form",
                        "not": {"required": ["messages"]}}]
