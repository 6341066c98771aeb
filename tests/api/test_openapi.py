"""The OpenAPI schema at /openapi.json: plain checks of what it documents, and a bounded Schemathesis run of
every operation against a real server, with an admin key, a tenant key and no key."""
import copy
import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema_rs
import pytest
import schemathesis
from conftest import BASE_MODEL, TEST_ADAPTERS, start_server, write_tenants
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from slora.api.app import create_app
from slora.api.openapi import OPERATIONS
from slora.models.tiny import DEMO_ADAPTERS

KEYS = {"admin": "openapi-admin-key", "tenant": "openapi-tenant-key"}
CHECKS = [not_a_server_error, status_code_conformance, response_schema_conformance]
REQUEST_TIMEOUT_S = 120      # one generated request on a loaded 2-core machine; only a hang reaches it
ERROR_REF = "#/components/schemas/ErrorResponse"
UPLOADED = "openapi-bot"              # an adapter name the run loads, uses and deletes


@pytest.fixture(scope="module")
def server(tmp_path_factory, adapter_root):
    folder = tmp_path_factory.mktemp("openapi")
    tenants = write_tenants(folder, {"ops": {"key": KEYS["admin"], "role": "admin"}, "acme": {"key": KEYS["tenant"]}})
    # A small max_tokens limit keeps every generated completion short (larger ones get a documented 400);
    # /metrics behind an admin's key documents (and answers) 401 and 403 too.
    srv = start_server(folder, "--tenants", str(tenants), "--adapter-root", str(adapter_root),
                       "--max-tokens-limit", "16", "--metrics-require-key")
    yield srv
    assert srv.stop() == 0, srv.log()[-3000:]


@pytest.fixture(scope="module")
def document(server) -> dict:
    response = httpx.get(f"{server.url}/openapi.json", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def api_schema(server, document):
    return schemathesis.openapi.from_dict(without_rules(document))


def without_rules(document: dict) -> dict:
    """The document without the request models' rules across fields (their allOf), for Schemathesis: with them
    its canonicalizer (jsonschema_rs) gives up on the chat body ("outgrew_intersections") and generates nothing.
    The rules have tests of their own; a generated body that breaks one gets a documented 400."""
    copied = copy.deepcopy(document)
    for model in copied["components"]["schemas"].values():
        model.pop("allOf", None)
    return copied


def public_operations(document: dict) -> set[tuple[str, str]]:
    return {(method, path) for path, item in document["paths"].items() for method, operation in item.items()
            if operation.get("security") == []}


def test_security_scheme_is_bearer_except_on_public_routes(document):
    assert document["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer", "description": "an API key of a tenant in the tenants file"}}
    assert document["security"] == [{"bearer": []}]
    assert public_operations(document) == {("get", "/health"), ("get", "/openapi.json"), ("get", "/docs")}
    assert {"401", "403"} <= set(document["paths"]["/metrics"]["get"]["responses"])


def test_metrics_are_public_without_metrics_require_key():
    document = create_app(lambda: None).openapi()      # never started: the schema needs no engine
    assert public_operations(document) == {("get", "/health"), ("get", "/openapi.json"), ("get", "/docs"),
                                           ("get", "/metrics")}
    assert not {"401", "403"} & set(document["paths"]["/metrics"]["get"]["responses"])


def test_adapter_load_documents_json_and_multipart_bodies(document):
    content = document["paths"]["/v1/adapters"]["post"]["requestBody"]["content"]
    assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/AdapterLoadRequest"}
    assert content["multipart/form-data"]["schema"] == {"$ref": "#/components/schemas/AdapterUpload"}
    upload = document["components"]["schemas"]["AdapterUpload"]
    assert set(upload["properties"]) == {"name", "public", "owner", "adapter_config.json",
                                         "adapter_model.safetensors"}
    assert set(upload["required"]) == {"name", "adapter_config.json", "adapter_model.safetensors"}
    assert upload["properties"]["adapter_model.safetensors"] == {
        "type": "string", "format": "binary", "title": "Adapter Model.Safetensors"}
    request = document["components"]["schemas"]["AdapterLoadRequest"]
    assert set(request["required"]) == {"name", "path"}
    assert request["properties"]["path"]["minLength"] == 1
    assert request["properties"]["name"]["pattern"] == upload["properties"]["name"]["pattern"]
    assert re.fullmatch(request["properties"]["name"]["pattern"].strip("^$"), "support-bot.v2")
    assert not re.fullmatch(request["properties"]["name"]["pattern"].strip("^$"), "../etc")


def test_an_empty_owner_query_names_nobody(server):
    with server.http(KEYS["admin"]) as admin:
        response = admin.delete("/v1/adapters/no-such-adapter", params={"owner": ""})
    assert response.status_code == 404, response.text


def test_every_route_documents_its_errors_and_no_422(document):
    operations = {(method, path): operation for path, item in document["paths"].items()
                  for method, operation in item.items()}
    assert set(operations) == set(OPERATIONS)
    for key, operation in operations.items():
        responses = operation["responses"]
        assert "422" not in responses, key
        errors = {status for status in responses if status != "200"}
        assert {"413", "500", "503"} <= errors, key
        assert ("401" in errors) != (operation.get("security") == []), key
        for status in errors:
            assert responses[status]["content"]["application/json"]["schema"] == {"$ref": ERROR_REF}, (key, status)
    assert {"400", "404", "409", "429"} <= set(operations[("post", "/v1/completions")]["responses"])
    assert {"400", "403", "404", "507"} <= set(operations[("post", "/v1/adapters")]["responses"])
    assert "HTTPValidationError" not in document["components"]["schemas"]
    assert set(document["components"]["schemas"]["ErrorResponse"]["properties"]) == {"error"}
    detail = document["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


def test_media_types_of_streaming_and_plain_text_routes(document):
    def ok(method: str, path: str) -> set[str]:
        return set(document["paths"][path][method]["responses"]["200"]["content"])
    assert ok("post", "/v1/completions") == ok("post", "/v1/chat/completions") == {"application/json",
                                                                                  "text/event-stream"}
    for path in ("/metrics", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
        assert ok("get" if path == "/metrics" else "post", path) == {"text/plain"}, path
    assert ok("get", "/docs") == {"text/html"}


def test_tokenizer_routes_and_version_are_documented(document):
    """vLLM's routes outside /v1/ parse their bodies by hand: without the table's entries FastAPI's schema has
    neither them nor their bodies."""
    paths = document["paths"]
    ref = "#/components/schemas/{}".format
    tokenize = paths["/tokenize"]["post"]
    assert tokenize["requestBody"]["content"]["application/json"]["schema"] == {
        "oneOf": [{"$ref": ref("TokenizeRequest")}, {"$ref": ref("TokenizeChatRequest")}]}
    assert paths["/detokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": ref("DetokenizeRequest")}
    answers = {("post", "/tokenize"): "Tokenized", ("post", "/detokenize"): "Detokenized",
               ("get", "/tokenizer_info"): "TokenizerInfo", ("get", "/version"): "Version"}
    for (method, path), model in answers.items():
        operation = paths[path][method]
        assert operation["responses"]["200"]["content"] == {"application/json": {"schema": {"$ref": ref(model)}}}
        assert "401" in operation["responses"] and operation.get("security") != [], path       # behind a key
    schemas = document["components"]["schemas"]
    assert set(schemas["Tokenized"]["required"]) == {"count", "max_model_len", "tokens"}
    assert "token_strs" in schemas["Tokenized"]["properties"]
    assert {"prompt", "add_special_tokens", "return_token_strs"} <= set(schemas["TokenizeRequest"]["properties"])
    chat_form = schemas["TokenizeChatRequest"]
    assert "messages" in chat_form["required"] and "model" not in chat_form["required"]
    assert schemas["DetokenizeRequest"]["required"] == ["tokens"]
    assert set(schemas["Version"]["required"]) == {"version"}


def test_a_chat_answer_may_be_tool_calls_without_content(document):
    schemas = document["components"]["schemas"]
    message = schemas["AssistantMessage"]
    assert {"type": "null"} in message["properties"]["content"]["anyOf"]
    assert message["properties"]["tool_calls"]["items"] == {"$ref": "#/components/schemas/AssistantToolCall"}
    assert "tool_calls" not in message["required"] and "function_call" in message["properties"]
    call = schemas["AssistantToolCall"]
    assert set(call["required"]) == {"id", "type", "function"}
    assert set(schemas["AssistantFunctionCall"]["required"]) == {"name", "arguments"}


def test_docs_page_is_served_without_a_key(server):
    response = httpx.get(f"{server.url}/docs", timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in response.text


# ---- the rules the server enforces, as the schema states them ---------------------------------------------
# Every rule that refuses a body for a reason across fields or a range is either a keyword of the schema (a
# body that breaks it fails the schema, and the same body with the rule kept passes it) or, where JSON Schema
# cannot state it (it compares two values, or depends on the model or the server's settings), words of a
# description. Either way the server answers the breaking body 400, naming the field.
COMPLETIONS, CHATS, TOKENIZE, DETOKENIZE = "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"
HELLO = [{"role": "user", "content": "Hello"}]
HELLO_AND_ANSWER = [*HELLO, {"role": "assistant", "content": "Hi"}]
CLOCK_TOOL = {"type": "function", "function": {"name": "get_time"}}
OUTSIDE_VOCABULARY = 100_000          # within the schema's int32 bound, past the tiny model's 512 tokens
BASE_BODIES = {COMPLETIONS: {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 2},
               CHATS: {"model": BASE_MODEL, "messages": HELLO, "max_tokens": 2},
               TOKENIZE: {}, DETOKENIZE: {}}


@dataclass(frozen=True)
class Rule:
    path: str
    broken: dict            # fields added to the path's base body that break the rule
    kept: dict | None       # the same with the rule kept: the schema admits it and the server serves it
    param: str              # the field the 400 names
    statement: str          # how the allOf entry's description starts, or words of the description that states it


KEYWORD_RULES = {
    "tools-and-functions": Rule(CHATS, {"tools": [CLOCK_TOOL], "functions": [{"name": "get_time"}]},
                                {"tools": [CLOCK_TOOL], "functions": None}, "functions",
                                "tools and functions not both"),
    "tool_choice-and-function_call": Rule(CHATS, {"tools": [CLOCK_TOOL], "tool_choice": "auto",
                                                  "function_call": "none"},
                                          {"tools": [CLOCK_TOOL], "tool_choice": "auto"}, "function_call",
                                          "tool_choice and function_call not both"),
    "forced-tool_choice-without-tools": Rule(CHATS, {"tool_choice": "required", "tools": []},
                                             {"tool_choice": "auto", "tools": []}, "tool_choice",
                                             'tool_choice "required" or a named function'),
    "forced-function_call-without-functions": Rule(CHATS, {"function_call": {"name": "get_time"}},
                                                   {"function_call": "auto"}, "function_call",
                                                   'tool_choice "required" or a named function'),
    "two-guided-fields": Rule(COMPLETIONS, {"guided_regex": "a+", "guided_choice": ["yes", "no"]},
                              {"guided_choice": ["yes", "no"]}, "guided_choice", "At most one structured output"),
    "guided-and-structured_outputs": Rule(CHATS, {"guided_json": {"type": "object"},
                                                  "structured_outputs": {"choice": ["yes", "no"]}},
                                          {"guided_json": None, "structured_outputs": {"choice": ["yes", "no"]}},
                                          "structured_outputs.choice", "At most one structured output"),
    "guided-and-response_format": Rule(COMPLETIONS, {"response_format": {"type": "json_object"},
                                                     "guided_choice": ["yes", "no"]},
                                       {"response_format": {"type": "text"}, "guided_choice": ["yes", "no"]},
                                       "guided_choice", "At most one structured output"),
    "two-structured_outputs-kinds": Rule(COMPLETIONS, {"structured_outputs": {"choice": ["yes"], "json_object": True}},
                                         {"structured_outputs": {"choice": ["yes"], "json_object": False}},
                                         "structured_outputs.json_object", "At most one structured output"),
    "forced-tool_choice-and-guided": Rule(CHATS, {"tools": [CLOCK_TOOL], "tool_choice": "required",
                                                  "guided_choice": ["yes"]},
                                          {"tools": [CLOCK_TOOL], "tool_choice": "auto", "guided_choice": ["yes"]},
                                          "guided_choice", "At most one structured output"),
    "json_schema-without-its-json_schema": Rule(CHATS, {"response_format": {"type": "json_schema"}},
                                                {"response_format": {"type": "json_schema", "json_schema": {
                                                    "name": "answer", "schema": {"type": "object"}}}},
                                                "response_format", 'type "json_schema" needs json_schema'),
    "continue_final_message-and-add_generation_prompt": Rule(
        CHATS, {"messages": HELLO_AND_ANSWER, "continue_final_message": True},
        {"messages": HELLO_AND_ANSWER, "continue_final_message": True, "add_generation_prompt": False},
        "continue_final_message", "continue_final_message true needs add_generation_prompt false"),
    "top_logprobs-without-logprobs": Rule(CHATS, {"top_logprobs": 2}, {"top_logprobs": 2, "logprobs": True},
                                          "top_logprobs", "top_logprobs above 0 needs logprobs true"),
    "stream_options-without-stream": Rule(COMPLETIONS, {"stream_options": {"include_usage": True}},
                                          {"stream_options": {"include_usage": True}, "stream": True},
                                          "stream_options", "stream_options only with stream true"),
    "prompt_logprobs-with-stream": Rule(COMPLETIONS, {"stream": True, "prompt_logprobs": 1}, {"prompt_logprobs": 1},
                                        "prompt_logprobs", "prompt_logprobs not with stream true"),
    "length_penalty-without-use_beam_search": Rule(COMPLETIONS, {"length_penalty": 0.5},
                                                   {"length_penalty": 0.5, "use_beam_search": True}, "length_penalty",
                                                   "length_penalty and early_stopping only with use_beam_search"),
    "early_stopping-without-use_beam_search": Rule(CHATS, {"early_stopping": "never"},
                                                   {"early_stopping": "never", "use_beam_search": True},
                                                   "early_stopping",
                                                   "length_penalty and early_stopping only with use_beam_search"),
    "use_beam_search-with-top_p": Rule(COMPLETIONS, {"use_beam_search": True, "top_p": 0.5},
                                       {"use_beam_search": True, "top_p": 1, "temperature": None}, "top_p",
                                       "use_beam_search true takes no"),
    "use_beam_search-with-temperature": Rule(CHATS, {"use_beam_search": True, "temperature": 0.5},
                                             {"use_beam_search": True, "temperature": 0}, "temperature",
                                             "use_beam_search true takes no"),
    "use_beam_search-with-stop": Rule(CHATS, {"use_beam_search": True, "stop": "x"},
                                      {"use_beam_search": True, "stop": []}, "stop", "use_beam_search true takes no"),
    "use_beam_search-with-a-structured-output": Rule(COMPLETIONS, {"use_beam_search": True, "guided_choice": ["yes"]},
                                                     {"use_beam_search": True, "response_format": {"type": "text"}},
                                                     "guided_choice", "use_beam_search true takes no"),
    "use_beam_search-with-max_tokens-0": Rule(COMPLETIONS, {"use_beam_search": True, "max_tokens": 0},
                                              {"use_beam_search": True, "max_tokens": 0, "max_completion_tokens": 1},
                                              "max_tokens", "use_beam_search true takes no"),
    "tokenize-prompt-with-messages": Rule(TOKENIZE, {"prompt": "Hello", "messages": None}, {"prompt": "Hello"},
                                          "messages", "Without messages: a body with messages is the chat form"),
}
# Keywords of single fields that pydantic's schema lacked, with the rule they state.
FIELD_KEYWORD_RULES = {
    "logit_bias-key-not-a-token-id": (Rule(COMPLETIONS, {"logit_bias": {"abc": 1}}, {"logit_bias": {"5": 1}},
                                           "logit_bias", "propertyNames"), "logit_bias"),
    "chat_template_kwargs-key-not-a-name": (Rule(CHATS, {"chat_template_kwargs": {"1st": 1}},
                                                 {"chat_template_kwargs": {"first": 1}}, "chat_template_kwargs",
                                                 "propertyNames"), "chat_template_kwargs"),
    "temperature-past-float32": (Rule(COMPLETIONS, {"temperature": 1e39}, {"temperature": 100.0}, "temperature",
                                      "maximum"), "temperature"),
    "seed-past-int64": (Rule(COMPLETIONS, {"seed": 2 ** 63}, {"seed": 2 ** 63 - 1}, "seed", "maximum"), "seed"),
}
DESCRIBED_RULES = {   # rule: (the rule, where its description is: the component and the path in it)
    "best_of-below-n": (Rule(COMPLETIONS, {"n": 2, "best_of": 1}, None, "best_of", "At least n"),
                        ("CompletionRequest", "properties", "best_of")),
    "best_of-above-n-with-stream": (Rule(COMPLETIONS, {"best_of": 2, "stream": True}, None, "best_of",
                                         "with stream, at most n"), ("CompletionRequest", "properties", "best_of")),
    "seed-of-the-last-sample-past-int64": (Rule(COMPLETIONS, {"seed": 2 ** 63 - 1, "n": 2}, None, "seed",
                                                "seed + (best_of or n) - 1 must fit in int64"),
                                           ("CompletionRequest", "properties", "seed")),
    "n-above-max-n": (Rule(COMPLETIONS, {"n": 17}, None, "n", "--max-n"), ("CompletionRequest", "properties", "n")),
    "choices-above-max-choices": (Rule(COMPLETIONS, {"prompt": ["Hello"] * 5, "n": 16}, None, "n", "--max-choices"),
                                  ("CompletionRequest", "properties", "n")),
    "stops-above-max-stop-sequences": (Rule(COMPLETIONS, {"stop": ["a", "b", "c", "d", "e"]}, None, "stop",
                                            "--max-stop-sequences"), ("CompletionRequest", "properties", "stop")),
    "max_tokens-above-limit": (Rule(COMPLETIONS, {"max_tokens": 17}, None, "max_tokens", "--max-tokens-limit"),
                               ("CompletionRequest", "properties", "max_tokens")),
    "min_tokens-above-max_tokens": (Rule(COMPLETIONS, {"min_tokens": 3}, None, "min_tokens", "At most max_tokens"),
                                    ("CompletionRequest", "properties", "min_tokens")),
    "prompt-past-the-context": (Rule(COMPLETIONS, {"prompt": [5] * 4096}, None, "prompt",
                                     "shorter than the model's context"),
                                ("CompletionRequest", "properties", "prompt")),
    "prompt-token-id-outside-vocabulary": (Rule(COMPLETIONS, {"prompt": [5, OUTSIDE_VOCABULARY]}, None, "prompt",
                                                "below the model's vocabulary size"),
                                           ("CompletionRequest", "properties", "prompt")),
    "logit_bias-token-id-outside-vocabulary": (Rule(COMPLETIONS, {"logit_bias": {str(OUTSIDE_VOCABULARY): 1}}, None,
                                                    "logit_bias", "below the model's vocabulary size"),
                                               ("CompletionRequest", "properties", "logit_bias")),
    "stop_token_ids-outside-vocabulary": (Rule(COMPLETIONS, {"stop_token_ids": [OUTSIDE_VOCABULARY]}, None,
                                               "stop_token_ids", "below the model's vocabulary size"),
                                          ("CompletionRequest", "properties", "stop_token_ids")),
    "detokenize-token-id-outside-vocabulary": (Rule(DETOKENIZE, {"tokens": [5, OUTSIDE_VOCABULARY]}, None, "tokens",
                                                    "below the model's vocabulary size"),
                                               ("DetokenizeRequest", "properties", "tokens")),
    "named-tool-not-among-tools": (Rule(CHATS, {"tools": [CLOCK_TOOL], "tool_choice": {
                                       "type": "function", "function": {"name": "get_weather"}}}, None, "tool_choice",
                                        "among which a named function must be"),
                                   ("ChatCompletionRequest", "properties", "tool_choice")),
    "continue_final_message-after-a-user-message": (Rule(CHATS, {"continue_final_message": True,
                                                                 "add_generation_prompt": False}, None,
                                                         "continue_final_message", "must be the assistant's"),
                                                    ("ChatCompletionRequest", "properties", "continue_final_message")),
    "chat_template_kwargs-naming-a-call-parameter": (Rule(CHATS, {"chat_template_kwargs": {"tokenize": False}}, None,
                                                          "chat_template_kwargs", "parameter of the template call"),
                                                     ("ChatCompletionRequest", "properties", "chat_template_kwargs")),
    "json-nested-too-deep": (Rule(CHATS, {"guided_json": functools.reduce(lambda inner, _: {"a": inner}, range(70),
                                                                          {})}, None, "guided_json",
                                  "Nested at most 64 levels deep"), ("ChatCompletionRequest", "properties",
                                                                     "guided_json")),
    "guided_json-text-not-a-schema": (Rule(COMPLETIONS, {"guided_json": "not JSON"}, None, "guided_json",
                                           "a string of JSON text of one"),
                                      ("CompletionRequest", "properties", "guided_json")),
}


def body_of(rule: Rule, fields: dict) -> dict:
    return {**BASE_BODIES[rule.path], **fields}


@pytest.fixture(scope="module")
def body_schemas(document) -> dict[str, jsonschema_rs.Draft202012Validator]:
    """A validator of each route's request body, as the served schema documents it."""
    def validator(path: str) -> jsonschema_rs.Draft202012Validator:
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        return jsonschema_rs.Draft202012Validator({**body, "components": document["components"]})
    return {path: validator(path) for path in BASE_BODIES}


def descriptions(schema: object) -> list[str]:
    """Every description in a schema and the schemas within it."""
    if isinstance(schema, list):
        return [text for item in schema for text in descriptions(item)]
    if not isinstance(schema, dict):
        return []
    own = [schema["description"]] if isinstance(schema.get("description"), str) else []
    return own + [text for key, value in schema.items() if key != "description" for text in descriptions(value)]


def stated_rules(document: dict) -> set[str]:
    """The descriptions of the rules across fields: the allOf entries of the components."""
    return {entry["description"] for model in document["components"]["schemas"].values()
            for entry in model.get("allOf", [])}


def post(server, path: str, body: dict) -> httpx.Response:
    with server.http(KEYS["tenant"]) as http:
        return http.post(path, json=body)


def assert_refused_naming(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    # stop_token_ids outside the vocabulary is refused by the engine, whose 400 names the field in its message.
    assert (error["param"] or "").startswith(param) or param in error["message"], error


@pytest.mark.parametrize("name", sorted(KEYWORD_RULES))
def test_rule_across_fields_is_a_schema_keyword(document, body_schemas, name):
    """The allOf entry is there, and it is the one that refuses: the body that keeps the rule passes."""
    rule = KEYWORD_RULES[name]
    schema = body_schemas[rule.path]
    assert not schema.is_valid(body_of(rule, rule.broken)), name
    assert schema.is_valid(body_of(rule, rule.kept)), list(schema.iter_errors(body_of(rule, rule.kept)))
    assert any(text.startswith(rule.statement) for text in stated_rules(document)), rule.statement


@pytest.mark.parametrize("name", sorted(FIELD_KEYWORD_RULES))
def test_field_rule_is_a_schema_keyword(document, body_schemas, name):
    rule, field = FIELD_KEYWORD_RULES[name]
    schema = body_schemas[rule.path]
    assert not schema.is_valid(body_of(rule, rule.broken)), name
    assert schema.is_valid(body_of(rule, rule.kept)), list(schema.iter_errors(body_of(rule, rule.kept)))
    model = "CompletionRequest" if rule.path == COMPLETIONS else "ChatCompletionRequest"
    assert rule.statement in json.dumps(document["components"]["schemas"][model]["properties"][field])


@pytest.mark.parametrize("name", sorted(DESCRIBED_RULES))
def test_rule_json_schema_cannot_state_is_described(document, body_schemas, name):
    """The schema admits the body (the rule is beyond its keywords), and the field's description states it."""
    rule, (model, *path) = DESCRIBED_RULES[name]
    assert body_schemas[rule.path].is_valid(body_of(rule, rule.broken)), name
    described = functools.reduce(lambda schema, key: schema[key], path, document["components"]["schemas"][model])
    assert any(rule.statement in text for text in descriptions(described)), descriptions(described)


ALL_RULES = {**KEYWORD_RULES, **{name: rule for name, (rule, _) in FIELD_KEYWORD_RULES.items()},
             **{name: rule for name, (rule, _) in DESCRIBED_RULES.items()}}


@pytest.mark.parametrize("name", sorted(ALL_RULES))
def test_server_refuses_a_body_that_breaks_a_stated_rule(server, name):
    rule = ALL_RULES[name]
    assert_refused_naming(post(server, rule.path, body_of(rule, rule.broken)), rule.param)


@pytest.mark.parametrize("name", sorted(name for name, rule in ALL_RULES.items() if rule.kept is not None))
def test_server_serves_the_body_that_keeps_the_rule(server, name):
    """The keywords are no stricter than the server: the body they admit is served."""
    rule = ALL_RULES[name]
    response = post(server, rule.path, body_of(rule, rule.kept))
    assert response.status_code == 200, response.text


def test_every_rule_across_fields_of_the_schema_has_its_test(document):
    statements = {rule.statement for rule in KEYWORD_RULES.values()}
    for text in stated_rules(document):
        assert any(text.startswith(statement) for statement in statements), text


# ---- /tokenize and /detokenize take what their schema admits, and only that -------------------------------
# As vLLM: /tokenize takes a prompt body or a chat body (with messages), /detokenize a model or none.
TOKENIZER_BODIES_ADMITTED = (
    (TOKENIZE, {"prompt": "Hello"}),
    (TOKENIZE, {"model": BASE_MODEL, "prompt": "Hello", "add_special_tokens": False, "return_token_strs": True}),
    (TOKENIZE, {"model": None, "prompt": ""}),
    (TOKENIZE, {"messages": HELLO}),
    (TOKENIZE, {"model": BASE_MODEL, "messages": HELLO_AND_ANSWER, "continue_final_message": True,
                "add_generation_prompt": False}),
    # Nothing is generated, so the structured outputs are not looked at (as vLLM's /tokenize ignores them).
    (TOKENIZE, {"messages": HELLO, "guided_regex": "a+", "guided_choice": ["yes"]}),
    (DETOKENIZE, {"tokens": [5, 6]}),
    (DETOKENIZE, {"model": BASE_MODEL, "tokens": [5]}),
    (DETOKENIZE, {"model": None, "tokens": []}),
)
TOKENIZER_BODIES_REFUSED = (    # (route, body, the field the 400 names)
    (TOKENIZE, {}, "prompt"),
    (TOKENIZE, {"prompt": "Hello", "messages": None}, "messages"),
    (TOKENIZE, {"prompt": "Hello", "messages": "Hello"}, "messages"),
    (TOKENIZE, {"messages": []}, "messages"),
    (TOKENIZE, {"model": "", "prompt": "Hello"}, "model"),
    (TOKENIZE, {"messages": HELLO_AND_ANSWER, "continue_final_message": True}, "continue_final_message"),
    (TOKENIZE, {"messages": HELLO, "tools": [CLOCK_TOOL], "functions": [{"name": "get_time"}]}, "functions"),
    (DETOKENIZE, {"model": BASE_MODEL}, "tokens"),
    (DETOKENIZE, {"model": 5, "tokens": [5]}, "model"),
    (DETOKENIZE, {"tokens": [-1]}, "tokens"),
)


@pytest.mark.parametrize("path,body", TOKENIZER_BODIES_ADMITTED, ids=lambda part: json.dumps(part)[:60])
def test_tokenizer_routes_take_what_their_schema_admits(server, body_schemas, path, body):
    assert body_schemas[path].is_valid(body), list(body_schemas[path].iter_errors(body))
    response = post(server, path, body)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path,body,param", TOKENIZER_BODIES_REFUSED, ids=lambda part: json.dumps(part)[:60])
def test_tokenizer_routes_refuse_what_their_schema_refuses(server, body_schemas, path, body, param):
    assert not body_schemas[path].is_valid(body), body
    assert_refused_naming(post(server, path, body), param)


STREAMED = {"stream": True, "stream_options": {"include_usage": True}}
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
# A named tool call within the server's 16-token limit: seed 2 closes the tiny model's `{}` in time.
CLOCK = {"tools": [{"type": "function", "function": {"name": "get_time"}}], "seed": 2,
         "tool_choice": {"type": "function", "function": {"name": "get_time"}}}
SUCCESSES = (   # requests that must succeed, in order, so that every 200 schema is checked against real answers
    ("post", "/v1/load_lora_adapter", {"lora_name": "openapi-vllm", "lora_path": "mlp-r8"}),
    ("post", "/v1/completions", {"model": BASE_MODEL, "prompt": "Hello", "max_tokens": 3}),
    ("post", "/v1/completions", {"model": "openapi-vllm", "prompt": [[5, 6], [7]], "max_tokens": 3, "n": 2,
                                 "return_token_ids": True, **STREAMED}),
    ("post", "/v1/chat/completions", {"model": "openapi-vllm", "messages": CHAT, "max_tokens": 3,
                                      "return_token_ids": True}),
    ("post", "/v1/chat/completions", {"model": BASE_MODEL, "messages": CHAT, "max_completion_tokens": 3,
                                      **STREAMED}),
    ("post", "/v1/chat/completions", {"model": BASE_MODEL, "messages": CHAT, "max_completion_tokens": 16, **CLOCK}),
    ("post", "/v1/unload_lora_adapter", {"lora_name": "openapi-vllm"}),
    ("post", "/tokenize", {"prompt": "Hello", "return_token_strs": True}),
    ("post", "/tokenize", {"model": BASE_MODEL, "messages": CHAT}),
    ("post", "/detokenize", {"tokens": [5, 6, 7]}),
    ("get", "/tokenizer_info", None),
    ("get", "/version", None),
)


def test_successful_answers_conform_to_the_schema(api_schema, server):
    tenant = {"Authorization": f"Bearer {KEYS['tenant']}"}
    for method, path, body in SUCCESSES:
        operation = api_schema[path][method]
        case = operation.Case() if body is None else operation.Case(body=body, media_type="application/json")
        response = case.call_and_validate(base_url=server.url, headers=tenant, checks=CHECKS,
                                          timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, (path, response.text)
        streamed = response.headers["content-type"][0].startswith("text/event-stream")
        assert streamed == (body or {}).get("stream", False), (path, response.headers)
        if "tool_choice" in (body or {}):           # the call, checked against its schema above
            message = response.json()["choices"][0]["message"]
            assert message["content"] is None and message["tool_calls"], message


def test_adapter_upload_and_delete_conform_to_the_schema(api_schema, server, adapter_root):
    files = {name: (adapter_root / "attn-r4" / name).read_bytes()
             for name in ("adapter_config.json", "adapter_model.safetensors")}
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    load, delete = api_schema["/v1/adapters"]["post"], api_schema["/v1/adapters/{name}"]["delete"]
    cases = [load.Case(body={"name": "openapi-upload", "owner": "acme", **files}, media_type="multipart/form-data"),
             load.Case(body={"name": "openapi-path", "path": "all-r16"}, media_type="application/json"),
             delete.Case(path_parameters={"name": "openapi-upload"}, query={"owner": "acme"}),
             delete.Case(path_parameters={"name": "openapi-path"})]
    for case in cases:
        response = case.call_and_validate(base_url=server.url, headers=admin, checks=CHECKS,
                                          timeout=REQUEST_TIMEOUT_S)
        assert response.status_code == 200, response.text


def adapter_file(adapter_root: Path, name: str) -> st.SearchStrategy[bytes]:
    """One of the test adapters' file `name`, read when drawn: the weights are large, and Hypothesis would
    otherwise put them in its strategy's repr."""
    return st.sampled_from(TEST_ADAPTERS).map(lambda adapter: (adapter_root / adapter / name).read_bytes())


def known_values(adapter_root: Path) -> dict[str, st.SearchStrategy]:
    """Values that reach past validation (random ones almost never name a model, an adapter folder or a
    tenant), by the field or path parameter they replace."""
    models = st.sampled_from([BASE_MODEL, *DEMO_ADAPTERS, UPLOADED])
    names = st.sampled_from([UPLOADED, "demo-r4-attn"])
    files = {name: adapter_file(adapter_root, name) for name in ("adapter_config.json", "adapter_model.safetensors")}
    return {"model": models, "model_id": models, "name": names, "lora_name": names,
            "path": st.sampled_from(TEST_ADAPTERS), "lora_path": st.sampled_from(TEST_ADAPTERS),
            "owner": st.sampled_from(["acme", "ops"]), "n": st.integers(1, 2), "stream": st.booleans(),
            "prompt": st.sampled_from(["The quick brown fox", ["Hello", "Once upon"], [5, 6, 7]]),
            "max_tokens": st.integers(1, 4), "max_completion_tokens": st.integers(1, 4), **files}


def with_known_values(case: schemathesis.Case, values: dict[str, object]) -> schemathesis.Case:
    """`case` with some of its generated body fields or path parameters replaced by known values."""
    for field, value in values.items():
        if isinstance(case.body, dict) and field in case.body:
            case.body[field] = value
        elif case.path_parameters and field in case.path_parameters:
            case.path_parameters[field] = value
    return case


# One Hypothesis test per operation, driven here rather than through schemathesis.pytest, whose lazy loader
# sets pytest's internal `Function._nodeid`, which pytest 9.2 no longer has. Operations run in the table's
# order, so the demo adapters are deleted (which the admin may do) only after the generation routes ran.
@pytest.mark.parametrize("method,path", list(OPERATIONS), ids=lambda part: part)
def test_operation_conforms_to_the_schema(api_schema, server, adapter_root, method, path):
    """Positive and negative requests for one operation, each sent with the admin's key, a tenant's key
    and no key: no 5xx, only documented statuses, answers that match their documented schemas."""
    operation = api_schema[path][method]
    generated = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                          operation.as_strategy(GenerationMode.NEGATIVE))
    values = known_values(adapter_root)
    # Some of the known values, or all of them (which makes most positive requests run).
    known = st.one_of(st.fixed_dictionaries({}, optional=values), st.fixed_dictionaries(values))

    @given(case=st.builds(with_known_values, generated, known))
    @settings(max_examples=25, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def conforms(case: schemathesis.Case) -> None:
        for key in (KEYS["admin"], KEYS["tenant"], None):
            headers = {"Authorization": f"Bearer {key}" if key else ""}
            case.call_and_validate(base_url=server.url, headers=headers, checks=CHECKS, timeout=REQUEST_TIMEOUT_S)
    conforms()
