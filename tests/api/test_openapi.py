"""The OpenAPI schema at /openapi.json: plain checks of what it documents, and a bounded Schemathesis run of
every operation against a real server, with an admin key, a tenant key and no key."""
import re
from pathlib import Path

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance, status_code_conformance

from conftest import BASE_MODEL, TEST_ADAPTERS, start_server, write_tenants
from slora.api.app import create_app
from slora.api.openapi import OPERATIONS
from slora.tiny_model import DEMO_ADAPTERS

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
    return schemathesis.openapi.from_dict(document)


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
        "anyOf": [{"$ref": ref("TokenizeRequest")}, {"$ref": ref("TokenizeChatRequest")}]}
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
