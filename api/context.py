"""Everything one server instance owns: the engine, tenants, limits, metrics, adapters and generation
services. Routes receive it; it is stored on `app.state.ctx`."""
import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from slora.api.adapter_admin import AdapterService
from slora.api.adapter_store import AdapterStore, StoredAdapter
from slora.api.async_engine import AsyncEngine, EngineSource, EngineState, ServedEngine
from slora.api.errors import (
    APIError,
    unavailable,
)
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.response_models import now
from slora.api.serving import GenerationService
from slora.api.settings import ServerSettings
from slora.api.tenants import TenantDirectory, load_tenants
from slora.api.tokenizer_pool import Tokenization

logger = logging.getLogger(__name__)

class ServerContext:
    """Everything one server instance owns; stored on `app.state.ctx`."""

    def __init__(self, source: EngineSource, settings: ServerSettings) -> None:
        self.settings = settings
        self.tenants = load_tenants(settings.tenants_file) if settings.tenants_file else TenantDirectory()
        self.engine = AsyncEngine(source)
        self.metrics = ServerMetrics()
        self.admission = Admission(settings.max_pending_requests, settings.retry_after_s)
        self.tokenization = Tokenization(settings.tokenizer_workers, settings.max_tokenize_pending,
                                         settings.retry_after_s)
        # Opened (locked, read, cleaned of orphans) by open_store: at start, not when an app is only built.
        self.store = AdapterStore(settings.adapter_store_folder)
        self.stored: list[StoredAdapter] = []
        root = Path(settings.adapter_root) if settings.adapter_root else None
        self.adapters = AdapterService(self.engine, self.tenants, self.metrics, root, self.store,
                                       settings.max_adapter_bytes, settings.served_model_names)
        resolver = self.adapters.resolve if settings.enable_lora_resolver else None
        self.generation = GenerationService(self.engine, settings, self.admission, self.metrics, self.tokenization,
                                            resolver)
        self.created = now()
        # The server serves once the --lora-modules are loaded and the adapter store's adapters restored
        # (`starting` says which it is doing); a refused module stops the start (startup_error, then
        # on_startup_failure, which `slora serve` sets to stop the server).
        self.starting: str | None = "loading its adapters"
        self.startup_error: str | None = None
        self.on_startup_failure: Callable[[], None] | None = None

    def open_store(self) -> None:
        """Take the adapter store (StoreError, a ValueError, if another server holds it) and read what it
        holds; `slora serve` calls it before the model loads, the app's start otherwise."""
        if not self.store.is_open:
            self.stored = self.store.open()

    async def load_startup_adapters(self) -> None:
        """Once the engine is up: the --lora-modules, through the admin load's checks, then the adapters of the
        adapter store, with their names, owners and versions."""
        while self.engine.info is None or self.engine.state is EngineState.STARTING:
            if self.engine.state in (EngineState.FAILED, EngineState.STOPPED):
                if self.engine.start_error is not None:     # the model did not load: there is nothing to serve
                    self.fail_start(f"the model could not be loaded: {self.engine.start_error}")
                return
            await asyncio.sleep(0.05)
        if self.tenants.tenants:                  # single-user: one client, nothing to weigh
            await self.engine.call(self._apply_weights)
        if self.settings.lora_modules and not await self.load_lora_modules():
            return
        self.starting = "restoring the adapters of its adapter store"
        await self.adapters.restore(self.stored)
        self.starting = None

    def _apply_weights(self, engine: ServedEngine) -> None:
        """Each tenant's weight from the tenants file: its share of the engine under the vtc policy."""
        for tenant in self.tenants.tenants.values():
            engine.set_tenant_weight(tenant.id, tenant.weight)

    async def load_lora_modules(self) -> bool:
        """Load the --lora-modules adapters; False (and the start fails) if one is refused."""
        self.starting = "loading its --lora-modules adapters"
        for module in self.settings.lora_modules:
            try:
                folder = await asyncio.to_thread(self.settings.lora_module_folder, module)
                await self.adapters.load_module(module.name, folder)
            except (APIError, ValueError) as exc:
                reason = exc.message if isinstance(exc, APIError) else str(exc)
                prefix = f"--lora-modules {module.name!r}: "
                self.fail_start(reason if reason.startswith(prefix) else prefix + reason)
                return False
        logger.info("--lora-modules loaded: %s", ", ".join(m.name for m in self.settings.lora_modules))
        return True

    def fail_start(self, message: str) -> None:
        logger.error("the server cannot start: %s", message)
        self.startup_error = message
        self.engine.begin_drain()
        if self.on_startup_failure is not None:
            self.on_startup_failure()

    async def close(self) -> None:
        await self.engine.shutdown(self.settings.shutdown_timeout_s)
        self.tokenization.close()
        self.generation.close()
        self.store.close()          # its files stay: the next start serves them again

    def count_error(self, status: int) -> None:
        self.metrics.errors.labels(status=str(status)).inc()

    def require_engine(self) -> None:
        if self.engine.info is None or not self.engine.accepting:
            raise unavailable(f"the server is {self.engine.state.value}; retry later", self.settings.retry_after_s)
        if self.starting is not None:
            raise unavailable(f"the server is {self.starting}; retry later", self.settings.retry_after_s)
