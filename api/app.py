"""The FastAPI app: `create_app(engine, settings)` builds everything a server needs and holds no global state."""
import logging
import shutil
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from slora.api import protocol
from slora.api.adapter_admin import AdapterService, UploadedFile
from slora.api.async_engine import AsyncEngine, EngineSource
from slora.api.errors import APIError, bad_request, install_error_handlers, model_not_found, unavailable
from slora.api.limits import Admission
from slora.api.metrics import CONTENT_TYPE, ServerMetrics
from slora.api.openapi import install_openapi
from slora.api.protocol import (AdapterLoadRequest, ChatCompletionRequest, CompletionRequest, LoadLoraAdapterRequest,
                                UnloadLoraAdapterRequest)
from slora.api.serving import GenerationService, Tokenization
from slora.api.settings import ServerSettings
from slora.api.tenants import Tenant, TenantDirectory, load_tenants
from slora.engine import Engine

logger = logging.getLogger(__name__)
UPLOAD_ROUTE = "/v1/adapters"


class ServerContext:
    """Everything one server instance owns; stored on `app.state.ctx`."""

    def __init__(self, source: EngineSource, settings: ServerSettings) -> None:
        self.settings = settings
        self.tenants = load_tenants(settings.tenants_file) if settings.tenants_file else TenantDirectory()
        self.engine = AsyncEngine(source)
        self.metrics = ServerMetrics()
        self.admission = Admission(settings.max_pending_requests, settings.retry_after_s)
        self.tokenization = Tokenization()
        self._temporary_uploads = settings.upload_dir is None
        self.upload_dir = Path(settings.upload_dir or tempfile.mkdtemp(prefix="slora-uploads-"))
        self.upload_dir.mkdir(parents=True, exist_ok=True)
        root = Path(settings.adapter_root) if settings.adapter_root else None
        self.adapters = AdapterService(self.engine, self.tenants, self.metrics, root, self.upload_dir)
        self.generation = GenerationService(self.engine, settings, self.admission, self.metrics, self.tokenization)
        self.created = protocol.now()

    async def close(self) -> None:
        await self.engine.shutdown(self.settings.shutdown_timeout_s)
        self.tokenization.close()
        if self._temporary_uploads:
            shutil.rmtree(self.upload_dir, ignore_errors=True)

    def require_engine(self) -> None:
        if self.engine.info is None or not self.engine.accepting:
            raise unavailable(f"the server is {self.engine.state.value}; retry later", self.settings.retry_after_s)


class BodyLimit:
    """Refuses request bodies over the limit (uploads to /v1/adapters have their own, larger one), whether
    or not the client announced a Content-Length."""

    def __init__(self, app: ASGIApp, max_body: int, max_upload: int) -> None:
        self.app = app
        self.max_body = max_body
        self.max_upload = max_upload

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.max_upload if scope["path"] == UPLOAD_ROUTE else self.max_body
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await _too_large(limit).response()(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException, because FastAPI turns any other error while reading a body into a
                    # generic "error parsing the body".
                    raise StarletteHTTPException(400, _too_large(limit).message)
            return message
        await self.app(scope, limited_receive, send)


def _too_large(limit: int) -> APIError:
    return bad_request(f"the request body is larger than the limit of {limit} bytes", code="request_too_large")


def _parse(model: type[BaseModel], raw: bytes) -> Any:
    try:
        return model.model_validate_json(raw or b"{}")
    except ValidationError as exc:
        first = exc.errors()[0]
        param = ".".join(str(p) for p in first.get("loc", ())) or None
        raise bad_request(f"{param}: {first.get('msg')}" if param else first.get("msg", "invalid body"),
                          param=param) from None


def _form_bool(value: Any) -> bool:
    return isinstance(value, str) and value.strip().lower() in ("1", "true", "yes", "on")


def create_app(engine: Engine | EngineSource, settings: ServerSettings | None = None) -> FastAPI:
    """The HTTP service over `engine` (an Engine, or a function that builds one on the engine thread, so
    that the server answers 503 while the model loads)."""
    settings = settings or ServerSettings()
    ctx = ServerContext(engine, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        try:
            yield
        finally:
            await ctx.close()

    app = FastAPI(title="slora", lifespan=lifespan, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    install_openapi(app)
    app.state.ctx = ctx
    install_error_handlers(app, on_error=lambda status: ctx.metrics.errors.inc(status=str(status)))
    app.add_middleware(BodyLimit, max_body=settings.max_body_bytes, max_upload=settings.max_upload_bytes)
    caller = _auth_dependency(ctx.tenants)
    _add_generation_routes(app, ctx, caller)
    _add_model_routes(app, ctx, caller)
    _add_adapter_routes(app, ctx, caller)
    _add_ops_routes(app, ctx)
    return app


def _auth_dependency(tenants: TenantDirectory):  # noqa: ANN202 - a FastAPI dependency
    async def caller(request: Request) -> Tenant:
        scheme, _, key = request.headers.get("authorization", "").partition(" ")
        key = key.strip() if scheme.lower() == "bearer" else ""
        tenant = tenants.authenticate(key)
        if tenant is None:
            message = "Incorrect API key provided." if key else \
                "Missing API key: send it as 'Authorization: Bearer <key>'."
            raise APIError(401, message, code="invalid_api_key")
        return tenant
    return caller


def _add_generation_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        return await ctx.generation.completions(body, tenant, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        return await ctx.generation.chat(body, tenant, request)


def _add_model_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    async def cards(tenant: Tenant) -> list[dict[str, Any]]:
        ctx.require_engine()
        info = ctx.engine.info
        namespace = tenant.namespace

        def visible(engine: Engine) -> list[tuple[str, str | None, bool]]:
            entries = sorted(engine.registry.visible_to(namespace), key=lambda e: (e.owner != namespace, e.name))
            seen: dict[str, tuple[str, str | None, bool]] = {}
            for e in entries:                     # one's own adapter hides a public one of the same name
                seen.setdefault(e.name, (e.name, e.owner, e.public))
            return list(seen.values())
        adapters = await ctx.engine.call(visible)
        base = protocol.model_card(info.model_name, ctx.created, "slora", None, info.max_model_len)
        return [base] + [protocol.model_card(name, ctx.created, tenant.id if owner == namespace else "slora",
                                             info.model_name, info.max_model_len)
                         for name, owner, _ in sorted(adapters)]

    @app.get("/v1/models")
    async def list_models(tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        return {"object": "list", "data": await cards(tenant)}

    @app.get("/v1/models/{model_id}")
    async def get_model(model_id: str, tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        for card in await cards(tenant):
            if card["id"] == model_id:
                return card
        raise model_not_found(model_id)


def _add_adapter_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:
    @app.get("/v1/adapters")
    async def list_adapters(tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        ctx.require_engine()
        return {"object": "list", "data": await ctx.adapters.list_adapters(tenant)}

    @app.post("/v1/adapters")
    async def load_adapter(request: Request, tenant: Tenant = Depends(caller)) -> dict[str, Any]:
        ctx.require_engine()
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            return await _load_upload(ctx, request, tenant)
        body: AdapterLoadRequest = _parse(AdapterLoadRequest, await request.body())
        return await ctx.adapters.load_path(tenant, body.name, body.path, body.public, body.owner)

    @app.delete("/v1/adapters/{name}")
    async def delete_adapter(name: str, tenant: Tenant = Depends(caller), owner: str | None = None) -> dict:
        ctx.require_engine()
        return await ctx.adapters.unload(tenant, name, owner)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        await ctx.adapters.load_path(tenant, body.lora_name, body.lora_path, param="lora_path")
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest, tenant: Tenant = Depends(caller)) -> Response:
        ctx.require_engine()
        await ctx.adapters.unload(tenant, body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


async def _load_upload(ctx: ServerContext, request: Request, tenant: Tenant) -> dict[str, Any]:
    form = await request.form(max_files=4, max_fields=8)
    try:
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("the upload needs a 'name' field", param="name")
        owner = form.get("owner")
        files = [UploadedFile(field, value.filename or "", value.file)
                 for field, value in form.multi_items() if isinstance(value, UploadFile)]
        return await ctx.adapters.load_upload(tenant, name, files, _form_bool(form.get("public")),
                                              owner if isinstance(owner, str) and owner else None)
    finally:
        await form.close()


def _add_ops_routes(app: FastAPI, ctx: ServerContext) -> None:
    @app.get("/health")
    async def health() -> Response:
        ok, reason = ctx.engine.health(ctx.settings.stall_timeout_s)
        if not ok:
            return unavailable(f"not healthy: {reason}", ctx.settings.retry_after_s).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        queued = ctx.admission.queued
        text = ctx.metrics.render(ctx.engine, queued=queued, inflight=ctx.admission.pending - queued)
        return PlainTextResponse(text, media_type=CONTENT_TYPE)
