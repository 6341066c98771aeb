"""The FastAPI app: `create_app(engine, settings)` builds everything a server needs and holds no global state."""
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, NamedTuple

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import FormData, Headers, UploadFile
from starlette.middleware.body_limit import RequestBodyLimitMiddleware
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from slora.api.adapter_files import UploadedFile
from slora.api.async_engine import EngineSource, ServedEngine
from slora.api.context import ServerContext
from slora.api.docs_page import install_docs
from slora.api.errors import (
    APIError,
    bad_request,
    install_error_handlers,
    invalid_request,
    model_not_found,
    too_large,
    unavailable,
)
from slora.api.generation_routes import add_generation_routes
from slora.api.metrics import CONTENT_TYPE
from slora.api.openapi import install_openapi
from slora.api.protocol import AdapterLoadRequest, LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from slora.api.response_models import AdapterDeleted, AdapterInfo, AdapterList, Health, ModelCard, ModelList
from slora.api.responses import model_card
from slora.api.settings import ServerSettings
from slora.api.tenant_routes import add_tenant_routes
from slora.api.tenants import Tenant, TenantDirectory
from slora.api.tokenizer_routes import add_tokenizer_routes

logger = logging.getLogger(__name__)
UPLOAD_ROUTE = "/v1/adapters"
METRICS_ROUTE = "/metrics"
KEYED_PREFIX = "/v1/"           # every route under it needs a key; /health, /metrics and the docs do not
KEYED_PATHS = frozenset({"/tokenize", "/detokenize", "/tokenizer_info", "/version"})   # vLLM's, outside /v1/
MULTIPART = "multipart/form-data"
TENANT_STATE = "tenant"         # where Authentication leaves the caller, in the ASGI scope's state
DISCARD_S = 1.0                 # how long a refused request's body is read and dropped before the answer
MAX_PATH_SHOWN = 200            # of an unknown path, in its 404's message


class BodyLimit:
    """Picks a request's body limit by what the body is: only a multipart/form-data POST to the upload route
    may send up to `max_upload` bytes; every other body, JSON included, `max_body`. A declared Content-Length
    over the limit is refused (413) before the app runs; a body without one is counted as it arrives by
    Starlette's RequestBodyLimitMiddleware, which refuses it (413) once it passes the limit."""

    def __init__(self, app: ASGIApp, max_body: int, max_upload: int, on_error: Callable[[int], None]) -> None:
        self.app = app
        self.max_body = max_body
        self.max_upload = max_upload
        self.on_error = on_error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        limit = self.max_upload if _is_upload(scope, headers) else self.max_body
        declared = declared_length(headers)
        if declared is not None and declared > limit:
            await answer_unread(too_large(limit), self.on_error, scope, receive, send)
            return
        await RequestBodyLimitMiddleware(self.app, limit)(scope, receive, send)


class Authentication:
    """Checks the API key from the headers alone, before anything parses the body: a missing or wrong key is
    a 401 whatever the body (what arrives of it within a second is dropped unparsed, see discard_body). It
    guards every route under /v1/ (and /metrics with metrics_require_key) and leaves the tenant in the
    scope's state, where `caller` reads it."""

    def __init__(self, app: ASGIApp, tenants: TenantDirectory, guard_metrics: bool,
                 on_error: Callable[[int], None], max_discard: int) -> None:
        self.app = app
        self.tenants = tenants
        self.guard_metrics = guard_metrics
        self.on_error = on_error
        self.max_discard = max_discard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and self._guarded(scope["path"]):
            headers = Headers(scope=scope)
            try:
                tenant = authenticate(self.tenants, headers)
            except APIError as error:
                await discard_body(receive, headers, self.max_discard)
                await answer_unread(error, self.on_error, scope, receive, send)
                return
            scope.setdefault("state", {})[TENANT_STATE] = tenant
        await self.app(scope, receive, send)

    def _guarded(self, path: str) -> bool:
        return path.startswith(KEYED_PREFIX) or path in KEYED_PATHS or (self.guard_metrics and path == METRICS_ROUTE)


def authenticate(tenants: TenantDirectory, headers: Headers) -> Tenant:
    """The tenant of the request's bearer key; APIError 401 without a valid one."""
    scheme, _, key = headers.get("authorization", "").partition(" ")
    key = key.strip() if scheme.lower() == "bearer" else ""
    tenant = tenants.authenticate(key)
    if tenant is None:
        message = "Incorrect API key provided." if key else \
            "Missing API key: send it as 'Authorization: Bearer <key>'."
        raise APIError(401, message, code="invalid_api_key")
    return tenant


async def answer_unread(error: APIError, on_error: Callable[[int], None], scope: Scope, receive: Receive,
                        send: Send) -> None:
    """Answer a request whose body was not read. The connection closes after the answer, so that the server
    does not go on reading (and discarding) a body the client may still be sending."""
    on_error(error.status)
    response = error.response()
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


async def discard_body(receive: Receive, headers: Headers, limit: int) -> None:
    """Drop what arrives of a refused request's body, unparsed, for at most DISCARD_S and `limit` bytes. The
    connection closes after the answer, and closing a socket with unread bytes resets it: a client still
    sending its body would see the reset instead of the answer. A larger or slower body is not waited for."""
    declared = declared_length(headers)
    if declared is not None and declared > limit:
        return
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(_drop_body(receive, limit), DISCARD_S)


async def _drop_body(receive: Receive, limit: int) -> None:
    received = 0
    while received <= limit:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        received += len(message.get("body", b""))


def declared_length(headers: Headers) -> int | None:
    value = headers.get("content-length")
    return int(value) if value is not None and value.isascii() and value.isdigit() else None


def media_type(headers: Headers) -> str:
    return headers.get("content-type", "").partition(";")[0].strip().lower()


def _is_upload(scope: Scope, headers: Headers) -> bool:
    return scope["path"] == UPLOAD_ROUTE and scope["method"] == "POST" and media_type(headers) == MULTIPART


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        raise invalid_request(exc.errors()) from None


def _form_bool(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on")


def create_app(engine: ServedEngine | EngineSource, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP service over `engine` (an Engine, or a function that builds one on the engine thread, so
    that the server answers 503 while the model loads)."""
    settings = settings or ServerSettings()
    ctx = ServerContext(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.open_store()
        ctx.engine.start()
        adapters = asyncio.ensure_future(ctx.load_startup_adapters())
        try:
            yield
        finally:
            adapters.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await adapters
            await ctx.close()

    # docs_url=None: FastAPI's page loads Swagger UI from a CDN; install_docs serves it from the server.
    app = FastAPI(title="slora", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app, metrics_require_key=settings.metrics_require_key)
    install_docs(app)
    app.state.ctx = ctx
    app.router.redirect_slashes = False        # its redirect would echo the client's Host header back
    install_error_handlers(app, on_error=ctx.count_error)
    _install_method_not_allowed(app, on_error=ctx.count_error)
    _install_not_found(app, on_error=ctx.count_error)
    app.add_middleware(BodyLimit, max_body=settings.max_body_bytes, max_upload=settings.max_upload_bytes,
                       on_error=ctx.count_error)
    # Added last, so it runs first: the key is checked before the body limit or anything else looks further.
    app.add_middleware(Authentication, tenants=ctx.tenants, guard_metrics=settings.metrics_require_key,
                       on_error=ctx.count_error, max_discard=settings.max_body_bytes)
    caller = _auth_dependency(ctx.tenants)
    add_generation_routes(app, ctx, caller)
    _add_model_routes(app, ctx, caller)
    _add_adapter_routes(app, ctx, caller)
    _add_ops_routes(app, ctx, caller)
    add_tokenizer_routes(app, ctx, caller)
    add_tenant_routes(app, ctx, caller)
    return app


def allowed_methods(app: FastAPI, scope: Scope) -> list[str]:
    """The methods of every route whose path matches the request's (Starlette's 405 names the first one's)."""
    # A mounted folder's files (the docs' assets) refused it: Starlette leaves the Mount's app as the endpoint.
    if isinstance(scope.get("endpoint"), StaticFiles):
        return ["GET", "HEAD"]
    methods: set[str] = set()
    for route in app.router.routes:
        if isinstance(route, Route) and route.methods and route.matches(scope)[0] is not Match.NONE:
            methods |= route.methods
    return sorted(methods)


def _install_method_not_allowed(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """A 405 is our error object, its Allow header every method of the path: Starlette's names only those
    of the first route that matches (GET for /v1/adapters, which takes POST as well)."""
    @app.exception_handler(405)
    async def _method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
        allowed = allowed_methods(app, request.scope)
        on_error(405)
        error = APIError(405, f"the method {request.method[:32]} is not allowed on this path; it takes "
                         f"{', '.join(allowed)}", code="method_not_allowed", headers={"Allow": ", ".join(allowed)})
        return error.response()


def _install_not_found(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """A path that no route serves (an OpenAI route this server does not implement, /v1/embeddings or
    /v1/responses, as much as a typo) is a 404 whose message names it: Starlette's says only "Not Found", which
    leaves a client guessing whether the route or the model is missing."""
    @app.exception_handler(404)
    async def _not_found(request: Request, exc: Exception) -> JSONResponse:
        on_error(404)
        return route_not_found(request.method, request.url.path).response()


def route_not_found(method: str, path: str) -> APIError:
    shown = path if len(path) <= MAX_PATH_SHOWN else path[:MAX_PATH_SHOWN] + "..."
    return APIError(404, f"{method[:32]} {shown} is not served by this server; GET /docs lists the routes it "
                    "serves", code="route_not_found")


def _auth_dependency(tenants: TenantDirectory):  # noqa: ANN202 - a FastAPI dependency
    async def caller(request: Request) -> Tenant:
        # Authentication has checked the key already on the routes it guards; any other route checks it here.
        tenant = request.scope.get("state", {}).get(TENANT_STATE)
        return tenant if tenant is not None else authenticate(tenants, request.headers)
    return caller


def _add_model_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    async def cards(tenant: Tenant) -> list[ModelCard]:
        ctx.require_engine()
        info = ctx.engine.info
        assert info is not None, "require_engine() refuses the request before the engine is up"
        namespace = tenant.namespace

        def visible(engine: ServedEngine) -> list[tuple[str, str, bool]]:
            entries = sorted(engine.adapters.visible_to(namespace), key=lambda e: (e.owner != namespace, e.name))
            seen: dict[str, tuple[str, str, bool]] = {}
            for e in entries:                     # one's own adapter hides a public one of the same name
                seen.setdefault(e.name, (e.name, ctx.adapters.model_owner(e, tenant), e.public))
            return list(seen.values())
        adapters = await ctx.engine.call(visible)
        base_name = ctx.generation.base_names[0]
        base = model_card(base_name, ctx.created, "slora", None, info.max_model_len)
        return [base] + [model_card(name, ctx.created, owned_by, base_name, info.max_model_len)
                         for name, owned_by, _ in sorted(adapters)]

    @app.get("/v1/models")
    async def list_models(tenant: Tenant = Depends(caller)) -> ModelList:
        return ModelList(object="list", data=await cards(tenant))

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, tenant: Tenant = Depends(caller)) -> ModelCard:
        for card in await cards(tenant):
            if card.id == model_id:
                return card
        raise model_not_found(model_id)


def _add_adapter_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    """The adapter service answers with dicts; the routes' response models check and document them."""
    @app.get("/v1/adapters", response_model=AdapterList, response_model_exclude_unset=True)
    async def list_adapters(tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        ctx.require_engine()
        return {"object": "list", "data": await ctx.adapters.list_adapters(tenant)}

    @app.post("/v1/adapters", response_model=AdapterInfo, response_model_exclude_unset=True)
    async def load_adapter(request: Request, tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        ctx.require_engine()
        if media_type(request.headers) == MULTIPART:
            return await _load_upload(ctx, request, tenant)
        body: AdapterLoadRequest = _parse(AdapterLoadRequest, await request.body())
        return await ctx.adapters.load_path(tenant, body.name, body.path, body.public, body.owner)

    @app.delete("/v1/adapters/{name}", response_model=AdapterDeleted)
    async def delete_adapter(name: str, tenant: Tenant = Depends(caller), owner: str | None = None) -> dict:
        ctx.require_engine()
        return await ctx.adapters.unload(tenant, name, owner or None)   # `?owner=` names nobody, as in uploads

    @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoraAdapterRequest, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        await ctx.adapters.load_path(tenant, body.lora_name, body.lora_path, param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        await ctx.adapters.unload(tenant, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


class UploadForm(NamedTuple):
    name: str
    files: list[UploadedFile]
    public: bool
    owner: str | None


async def _load_upload(ctx: ServerContext, request: Request, tenant: Tenant) -> dict[str, Any]:
    release = await _reserve_upload(ctx, request, tenant)
    try:
        form = await _read_form(request)
        try:
            return await ctx.adapters.load_upload(tenant, *_upload_form(form))
        finally:
            await form.close()
    finally:
        release()


async def _reserve_upload(ctx: ServerContext, request: Request, tenant: Tenant) -> Callable[[], None]:
    """The upload's declared length, counted against the caller's byte quota while its body is spooled;
    refused unread if it does not fit (AdapterService.reserve_upload)."""
    try:
        return ctx.adapters.reserve_upload(tenant, declared_length(request.headers))
    except APIError as error:
        await discard_body(request.receive, request.headers, ctx.settings.max_body_bytes)
        error.headers["Connection"] = "close"       # refused unparsed: nor is the rest of it read and dropped
        raise


def _upload_form(form: FormData) -> UploadForm:
    name = form.get("name")
    if not isinstance(name, str) or not name:
        raise bad_request("the upload needs a 'name' field", param="name")
    owner = form.get("owner")
    files = [UploadedFile(field, value.filename or "", value.file, value.size or 0)
             for field, value in form.multi_items() if isinstance(value, UploadFile)]
    owner = owner if isinstance(owner, str) and owner else None
    return UploadForm(name, files, _form_bool(form.get("public")), owner)


async def _read_form(request: Request) -> FormData:
    """The multipart form, its files spooled to anonymous temporary files: the parser closes (and so removes)
    them if the body fails, the caller once the form is used."""
    try:
        return await request.form(max_files=4, max_fields=8)
    except ClientDisconnect:
        raise bad_request("the client disconnected before the upload was complete", param="files") from None


def _add_ops_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    async def metrics_reader(request: Request) -> Tenant | None:
        """Who reads /metrics, for the adapter names it may see: the key's tenant (a key sent must be valid), the
        single user of a server without tenants, or None: an anonymous scrape of a public /metrics."""
        keyed = ctx.settings.metrics_require_key or ctx.tenants.single_user or "authorization" in request.headers
        reader = await caller(request) if keyed else None
        if ctx.settings.metrics_require_key and not (reader is not None and reader.is_admin):
            raise APIError(403, "/metrics needs an admin tenant's key", code="permission_denied")
        return reader

    @app.get("/health", response_model=Health)
    async def health() -> Health | Response:
        ok, reason = ctx.engine.health(ctx.settings.stall_timeout_s)
        if ok and ctx.starting is not None:
            ok, reason = False, ctx.starting
        if not ok:
            return unavailable(f"not healthy: {reason}", ctx.settings.retry_after_s).response()
        return Health(status="ok")

    @app.get(METRICS_ROUTE, response_class=PlainTextResponse)
    async def metrics(reader: Tenant | None = Depends(metrics_reader)) -> Response:
        queued = ctx.admission.queued
        model_name = ctx.generation.base_names[0] if ctx.engine.info is not None else ""
        text = ctx.metrics.render(ctx.engine, queued=queued, inflight=ctx.admission.pending - queued,
                                  viewer=reader, model_name=model_name)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)
