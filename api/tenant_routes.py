"""GET /v1/tenants: each tenant's share of the engine as the scheduler counts it, beside its limits. An admin sees
every tenant of the tenants file; any other tenant sees itself."""
from typing import Any

from fastapi import Depends, FastAPI

from slora.api.context import ServerContext
from slora.api.response_models import TenantInfo, TenantList
from slora.api.tenants import Tenant
from slora.core.fair_share import TenantShare

_UNSERVED = TenantShare(weight=1.0, counter=0.0, prompt_tokens=0, output_tokens=0, adapter_pages=0)


def add_tenant_routes(app: FastAPI, ctx: ServerContext, caller: Any) -> None:  # noqa: ANN401 - a dependency
    @app.get("/v1/tenants", response_model=TenantList)
    async def list_tenants(tenant: Tenant = Depends(caller)) -> TenantList:
        ctx.require_engine()
        assert ctx.engine.info is not None and ctx.engine.snapshot is not None, "the engine is up"
        shares = ctx.engine.snapshot.tenants
        shown = [tenant] if not tenant.is_admin or ctx.tenants.single_user else list(ctx.tenants.tenants.values())
        data = [tenant_info(t, shares.get(t.namespace, _UNSERVED)) for t in sorted(shown, key=lambda t: t.id)]
        return TenantList(object="list", scheduling_policy=ctx.engine.info.scheduling_policy, data=data)


def tenant_info(tenant: Tenant, share: TenantShare) -> TenantInfo:
    """A tenant's limits and its service so far (as of the engine's latest published snapshot)."""
    return TenantInfo(id=tenant.id, role=tenant.role, weight=share.weight, virtual_tokens=share.counter,
                      prompt_tokens=share.prompt_tokens, output_tokens=share.output_tokens,
                      adapter_pages=share.adapter_pages, max_concurrent=tenant.max_concurrent,
                      max_queued=tenant.max_queued)
