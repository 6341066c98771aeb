"""The OpenAPI schema served at /openapi.json: FastAPI's own, completed with what FastAPI cannot see.

FastAPI documents the routes' bodies and answers from their pydantic models (api/protocol.py,
api/response_models.py). It cannot see what middleware, exception handlers and hand-parsed bodies do: the bearer
keys (checked by a middleware) and the public routes, the error answers (it documents a 422 that this server never
gives: validation errors are 400s), the bodies parsed by hand (`POST /v1/adapters` as JSON or a multipart upload,
/tokenize's prompt or chat form, /detokenize), the server-sent events of a streamed generation, and its own
/openapi.json and /docs. The table below states these, per operation; `install_openapi` merges it into the
generated schema once, on the first request for it.

The request models' schemas are pydantic's own, which replace FastAPI's copies: FastAPI writes bounds as floats
(a seed's int64 bound 2**63 - 1 becomes 9.223372036854776e18, which is 2**63), and pydantic's carry the rules
across fields (each model's allOf, from its schema_rules) exactly as api/protocol.py states them.
"""
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema, models_json_schema

from slora.api.adapter_files import CONFIG_FILE, WEIGHTS_FILE
from slora.api.protocol import (
    AdapterLoadRequest,
    AdapterName,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoraAdapterRequest,
    Name,
    TokenizeChatRequest,
    TokenizeRequest,
    UnloadLoraAdapterRequest,
)
from slora.api.response_models import absent

REF = "#/components/schemas/{model}"
JSON, SSE, TEXT, HTML, MULTIPART = ("application/json", "text/event-stream", "text/plain", "text/html",
                                    "multipart/form-data")
BEARER = "bearer"
# Answers of FastAPI's own routes, which it leaves out of its schema: the Swagger page, the schema itself.
_STRING = MappingProxyType({"type": "string"})
_OBJECT = MappingProxyType({"type": "object"})


# ---- the shapes FastAPI cannot see: error answers (from exception handlers and middleware), server-sent events,
# the multipart upload (the route parses it by hand) ----------------------------------------------------------
class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error answer, as APIError.body() builds it."""

    model_config = ConfigDict(extra="forbid")
    error: ErrorDetail


class ServerSentEvent(BaseModel):
    """One event of a stream (`stream: true`): `data` is a JSON chunk or error object, the last one `[DONE]`."""

    data: str
    event: str


class AdapterUpload(BaseModel):
    """The multipart form of `POST /v1/adapters`: the two files of a PEFT folder."""

    name: AdapterName
    public: bool = Field(default=False, description="admins only: visible to every tenant")
    owner: Name | SkipJsonSchema[None] = absent("admins only: the tenant to load it for")
    # mypy's dataclass_transform support wants a literal alias; pydantic takes any str (the file names).
    adapter_config: bytes = Field(alias=CONFIG_FILE)  # type: ignore[literal-required]
    adapter_model: bytes = Field(alias=WEIGHTS_FILE)  # type: ignore[literal-required]


# ---- what each operation answers --------------------------------------------------------------------------
@dataclass(frozen=True)
class OperationDoc:
    errors: tuple[int, ...]
    # Successful answers beside those FastAPI documents: media type, body model or schema.
    ok: tuple[tuple[str, type[BaseModel] | Mapping[str, Any]], ...] = ()
    public: bool = False                                  # served without an API key
    bodies: tuple[tuple[str, type[BaseModel] | Mapping[str, Any]], ...] = ()  # request bodies FastAPI cannot see


# Any request may carry a body over the limit (413), meet an unexpected failure (500) or find the server over
# its connection limit, loading the model or draining (503); the routes behind a key answer 401 without one,
# those that parse a body or a query answer 400 when it is invalid.
_ANY = (413, 500, 503)
_KEYED = _ANY + (401,)
_PARSED = _KEYED + (400,)
_GENERATION = _PARSED + (404, 409, 429)
_METRICS = ("get", "/metrics")
# /tokenize takes a prompt or chat messages, told apart by `messages` (the prompt form's schema refuses it): one
# form, never both.
_TOKENIZE_BODY = MappingProxyType({"oneOf": [{"$ref": REF.format(model=model.__name__)}
                                             for model in (TokenizeRequest, TokenizeChatRequest)]})
OPERATIONS: Mapping[tuple[str, str], OperationDoc] = MappingProxyType({
    ("post", "/v1/completions"): OperationDoc(_GENERATION, ((SSE, ServerSentEvent),)),
    ("post", "/v1/chat/completions"): OperationDoc(_GENERATION, ((SSE, ServerSentEvent),)),
    ("get", "/v1/models"): OperationDoc(_KEYED),
    ("get", "/v1/models/{model_id}"): OperationDoc(_KEYED + (404,)),
    ("get", "/v1/adapters"): OperationDoc(_KEYED),
    ("post", "/v1/adapters"): OperationDoc(_PARSED + (403, 404, 411, 507),
                                           bodies=((JSON, AdapterLoadRequest), (MULTIPART, AdapterUpload))),
    ("delete", "/v1/adapters/{name}"): OperationDoc(_PARSED + (404,)),
    ("post", "/v1/load_lora_adapter"): OperationDoc(_PARSED + (403,)),
    ("post", "/v1/unload_lora_adapter"): OperationDoc(_PARSED + (404,)),
    _METRICS: OperationDoc(_ANY, public=True),
    ("post", "/tokenize"): OperationDoc(_PARSED + (404, 429), bodies=((JSON, _TOKENIZE_BODY),)),
    ("post", "/detokenize"): OperationDoc(_PARSED + (404, 429), bodies=((JSON, DetokenizeRequest),)),
    ("get", "/tokenizer_info"): OperationDoc(_KEYED + (400,)),
    ("get", "/version"): OperationDoc(_KEYED),
    ("get", "/v1/tenants"): OperationDoc(_KEYED),
    ("get", "/health"): OperationDoc(_ANY, public=True),
    ("get", "/openapi.json"): OperationDoc(_ANY, ((JSON, _OBJECT),), public=True),
    ("get", "/docs"): OperationDoc(_ANY, ((HTML, _STRING),), public=True),
})
# /metrics with ServerSettings.metrics_require_key: an admin's key only.
_KEYED_METRICS = OperationDoc(_KEYED + (403,))
_ERROR_DESCRIPTIONS = MappingProxyType({
    400: "Invalid request: the message names the problem and `param` the field",
    401: "Missing or unknown API key",
    403: "Not allowed for this API key (publishing without admin rights, over an adapter quota, or /metrics "
         "without an admin's key)",
    404: "No such model or adapter, or one that belongs to another tenant",
    411: "An upload without a Content-Length from a tenant with a byte quota",
    409: "The adapter's files changed or vanished on the server since it was loaded; its owner must load it again",
    413: "The request body is larger than the server's limit",
    429: "Over this API key's concurrency or token rate, or the server is at capacity; see Retry-After",
    500: "Internal error; the details are in the server log",
    503: "The model is loading, the server is shutting down or at its connection limit; see Retry-After",
    507: "The server has no room to store the upload",
})
_RETRY_AFTER = MappingProxyType({"Retry-After": {"description": "seconds to wait before retrying",
                                                 "schema": {"type": "integer"}}})
# The models of what the table adds, and the request models whose schemas replace FastAPI's copies.
_DOC_MODELS = (ErrorResponse, ServerSentEvent, AdapterLoadRequest, AdapterUpload, TokenizeRequest, TokenizeChatRequest,
               DetokenizeRequest, CompletionRequest, ChatCompletionRequest, LoadLoraAdapterRequest,
               UnloadLoraAdapterRequest)
_UPLOAD_ENCODING = MappingProxyType({CONFIG_FILE: {"contentType": JSON},
                                     WEIGHTS_FILE: {"contentType": "application/octet-stream"}})


def install_openapi(app: FastAPI, metrics_require_key: bool = False) -> None:
    """Make `app.openapi()` (and so /openapi.json and /docs) return the completed schema; /metrics is documented
    as behind an admin's key when the server has `metrics_require_key`."""
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            generated = get_openapi(title=app.title, version=app.version, description=app.description,
                                    routes=app.routes)
            app.openapi_schema = complete_schema(generated, metrics_require_key)
        return app.openapi_schema
    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to replace the schema


def complete_schema(schema: dict[str, Any], metrics_require_key: bool = False) -> dict[str, Any]:
    """`schema` (as FastAPI generates it) with the models, security, bodies and answers of OPERATIONS."""
    components = schema.setdefault("components", {})
    components.setdefault("schemas", {}).update(_model_schemas())
    components["securitySchemes"] = {BEARER: {"type": "http", "scheme": "bearer",
                                              "description": "an API key of a tenant in the tenants file"}}
    schema["security"] = [{BEARER: []}]
    for (method, path), doc in _operations(metrics_require_key).items():
        operation = schema.setdefault("paths", {}).setdefault(path, {}).setdefault(method, _new_operation(method, path))
        _document(operation, doc)
    for name in ("HTTPValidationError", "ValidationError"):   # only FastAPI's 422, which this server never gives
        components["schemas"].pop(name, None)
    return schema


def _operations(metrics_require_key: bool) -> Mapping[tuple[str, str], OperationDoc]:
    return {**OPERATIONS, _METRICS: _KEYED_METRICS} if metrics_require_key else OPERATIONS


def _model_schemas() -> dict[str, Any]:
    _, top = models_json_schema([(model, "validation") for model in _DOC_MODELS], ref_template=REF)
    return top["$defs"]


def _new_operation(method: str, path: str) -> dict[str, Any]:
    """An operation FastAPI leaves out of its schema (its own /openapi.json and /docs)."""
    name = path.strip("/").replace(".", "_").replace("/", "_")
    return {"summary": name.replace("_", " ").capitalize(), "operationId": f"{method}_{name}"}


def _document(operation: dict[str, Any], doc: OperationDoc) -> None:
    if doc.public:
        operation["security"] = []
    if doc.bodies:
        operation["requestBody"] = {"required": True, "content": {media: _body(media, model)
                                                                   for media, model in doc.bodies}}
    responses = operation.setdefault("responses", {})
    responses.pop("422", None)
    success = responses.setdefault("200", {"description": "Successful Response"})
    success.setdefault("content", {}).update({media: {"schema": _schema_of(model)} for media, model in doc.ok})
    responses.update({str(status): _error_response(status) for status in sorted(doc.errors)})


def _body(media: str, model: type[BaseModel] | Mapping[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"schema": _schema_of(model)}
    if media == MULTIPART:
        body["encoding"] = dict(_UPLOAD_ENCODING)
    return body


def _schema_of(model: type[BaseModel] | Mapping[str, Any]) -> dict[str, Any]:
    return dict(model) if isinstance(model, Mapping) else {"$ref": REF.format(model=model.__name__)}


def _error_response(status: int) -> dict[str, Any]:
    response: dict[str, Any] = {"description": _ERROR_DESCRIPTIONS[status],
                                "content": {JSON: {"schema": _schema_of(ErrorResponse)}}}
    if status in (429, 503):
        response["headers"] = dict(_RETRY_AFTER)
    return response
