"""The generation routes: /v1/completions and /v1/chat/completions."""
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import Response

from slora.api.context import ServerContext
from slora.api.protocol import ChatCompletionRequest, CompletionRequest
from slora.api.response_models import ChatCompletion, Completion
from slora.api.tenants import Tenant


def add_generation_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:  # noqa: ANN401
    """The answer's model is the schema of the JSON answer; a streamed one (server-sent events, or 499 to a client
    that left) is a Response of its own, which FastAPI sends as it is."""
    @app.post("/v1/completions", response_model=Completion, response_model_exclude_unset=True)
    async def completions(body: CompletionRequest, request: Request,
                          tenant: Tenant = Depends(caller)) -> Completion | Response:
        ctx.require_engine()
        return await ctx.generation.completions(body, tenant, request)

    @app.post("/v1/chat/completions", response_model=ChatCompletion, response_model_exclude_unset=True)
    async def chat(body: ChatCompletionRequest, request: Request,
                   tenant: Tenant = Depends(caller)) -> ChatCompletion | Response:
        ctx.require_engine()
        return await ctx.generation.chat(body, tenant, request)
