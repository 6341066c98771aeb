"""Engine replicas behind Ray Serve, with adapters multiplexed by version id.

An ingress (the FastAPI app: auth, tenants and tokenization done once there) sends each tokenized request
through a DeploymentHandle with the adapter's version id as Ray's multiplexed model id:

    handle.options(multiplexed_model_id=version, stream=True, method_name="generate").remote(request)

Ray's router then prefers a replica that already holds that version; slora routes nothing itself. Each
replica runs one engine (AsyncEngine) and makes a version known on its first request through Ray's
multiplexed loader, which registers it as a public adapter named by the version; when Ray evicts it (LRU over
`max_adapters` versions) the name is dropped, its running requests finish, and the engine's tiers free it.

Ray is imported inside functions only: a server without replicas never imports it.
"""
import asyncio
import contextvars
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slora.api.async_engine import AsyncEngine, EngineState, EngineUnavailable
from slora.config import EngineConfig
from slora.core.outputs import RequestOutput
from slora.engine import Engine
from slora.sampling.params import SamplingParams

# Versions a replica keeps registered before Ray evicts the least recently used. Not Ray's default of 3: a
# registered version costs only its packed copy in the host tier, which is LRU by bytes itself
# (EngineConfig.adapter_host_cache_gib) and falls back to the adapter's folder, and the pool evicts idle
# adapters on its own. Ray's limit only bounds the names a replica holds.
DEFAULT_MAX_ADAPTERS = 1024
# Requests Ray lets one replica hold at once. The engine queues what does not fit a batch itself; below an
# adapter's burst, Ray would count its replica busy and send the rest to another, which loads it again.
DEFAULT_MAX_ONGOING_REQUESTS = 256
STALL_TIMEOUT_S = 60.0              # a step or command running longer makes the replica unhealthy
READY_POLL_S = 0.01


@dataclass(frozen=True)
class ReplicaRequest:
    """One tokenized request, as the ingress sends it to a replica (pickled by Ray)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter_version: str | None = None   # the content hash, also the multiplexed model id it is routed by
    adapter_folder: str | None = None    # a PEFT folder every replica can read (the ingress's shared store)
    owner: str | None = None             # the tenant namespace: prefix-cache salt and fair share
    priority: int = 0
    weight: float | None = None          # the owner's weight under vtc (the ingress's tenants file); None: as is

    def __post_init__(self) -> None:
        if (self.adapter_version is None) != (self.adapter_folder is None):
            raise ValueError("adapter_version and adapter_folder go together: give both or neither")


@dataclass(frozen=True)
class ReplicaStats:
    """What one replica did with adapters (tests, and later metrics)."""

    replica_id: str
    loads: dict[str, int]                # version -> times the multiplexed loader registered it here
    evictions: dict[str, int]            # version -> times Ray evicted it here
    requests: dict[str, int]             # version -> requests on it served here
    base_requests: int
    abandoned: int                       # requests aborted because their consumer went away first
    running: int                         # requests in the engine now
    engine_steps: int                    # steps the engine has run
    engine_versions: tuple[str, ...]     # versions the engine knows now, on any tier


class _RegisteredAdapter:
    """What Ray's multiplexer caches per version. On LRU eviction Ray awaits the object's `__del__` when it
    is a coroutine function (ray/serve/multiplex.py, unload_model_lru). It is set on the instance, not
    defined on the class: Python's collector calls only the class's `__del__`, which would make an async
    one a coroutine never awaited."""

    def __init__(self, version: str, unregister: Callable[[str], Awaitable[None]]) -> None:
        self.version = version
        self._unregister = unregister
        self.__del__ = self._release

    async def _release(self) -> None:
        await self._unregister(self.version)


class EngineReplica:
    """One engine behind Ray Serve (`serve.deployment(EngineReplica)`, or `replica_app`)."""

    def __init__(self, config: EngineConfig, max_adapters: int = DEFAULT_MAX_ADAPTERS,
                 stall_timeout_s: float = STALL_TIMEOUT_S) -> None:
        from ray import serve

        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        # Built here, not on the engine thread: Ray counts the replica started once its constructor returns.
        self._engine = AsyncEngine(Engine(config))
        self._started = False
        self._stall_timeout_s = stall_timeout_s
        self._replica_id = f"{os.uname().nodename}:{os.getpid()}"
        self._loads: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        self._base_requests = 0
        self._abandoned = 0
        self._weights: dict[str | None, float] = {}     # the tenants' weights the engine has now
        # Ray's loader takes the model id only; the folder of the request whose load it is travels beside it.
        self._folder: contextvars.ContextVar[str] = contextvars.ContextVar(f"slora-adapter-folder-{id(self)}")
        self._adapter = serve.multiplexed(max_num_models_per_replica=max_adapters)(self._loader())

    def _loader(self) -> Callable[[str], Awaitable[_RegisteredAdapter]]:
        """The load function for serve.multiplexed. A plain function, not a bound method: Ray keeps its
        cache as an attribute of the function it wraps (api.py, `__serve_multiplex_wrapper`), and a bound
        method takes no attributes. Wrapped here, the limit is a constructor argument."""
        async def load_adapter(version: str) -> _RegisteredAdapter:
            return await self._register(version)
        return load_adapter

    # ---- requests ------------------------------------------------------------------------------------
    async def generate(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        """The request's outputs as the engine makes them (cumulative, as RequestStream delivers them)."""
        await self._ready()
        await self._weigh(request.owner, request.weight)
        if request.adapter_version is not None:
            await self._adapter_for(request)
        # Nothing between the adapter's load and the add below awaits: an eviction's unload, queued to the
        # engine thread later, cannot come before the request holds the version.
        stream = await self._engine.generate(request.request_id, list(request.prompt_token_ids), request.params,
                                             request.adapter_version, request.owner, priority=request.priority)
        self._count(request.adapter_version)
        try:
            async for output in stream:
                yield output
        finally:               # the consumer went away (closed, cancelled) before the end: stop computing it
            if not stream.finished:
                self._abandoned += 1
                self._engine.abort(request.request_id)

    async def _weigh(self, owner: str | None, weight: float | None) -> None:
        """The owner's weight as the ingress knows it; sent with every request, applied when it changes."""
        if weight is None or self._weights.get(owner) == weight:
            return
        await self._engine.call(lambda engine: engine.set_tenant_weight(owner, weight))
        self._weights[owner] = weight

    async def _adapter_for(self, request: ReplicaRequest) -> None:
        from ray import serve

        version, folder = request.adapter_version, request.adapter_folder
        assert version is not None and folder is not None, "ReplicaRequest checks they come together"
        routed = serve.get_multiplexed_model_id()
        if routed != version:      # routed by another id, Ray's affinity would not follow the adapter
            raise ValueError(f"request {request.request_id!r} is for adapter version {version!r} but was "
                             f"routed with multiplexed model id {routed!r}")
        self._folder.set(folder)
        await self._adapter(version)

    def _count(self, version: str | None) -> None:
        if version is None:
            self._base_requests += 1
        else:
            self._requests[version] += 1

    # ---- adapters ------------------------------------------------------------------------------------
    async def _register(self, version: str) -> _RegisteredAdapter:
        """Read, check and register the version from the folder of the request that asked for it: the
        reading off the engine thread, the registering between two steps."""
        folder = self._folder.get(None)
        assert folder is not None, "Ray runs the loader in the task of the request that asked for it"
        prepared = await self._engine.prepare_adapter(Path(folder))
        if prepared.version != version:
            raise ValueError(f"adapter folder {folder!r} holds version {prepared.version!r}, not the version "
                             f"{version!r} requested: its files changed")
        await self._engine.call(lambda engine: engine.adapters.register(version, prepared, owner=None, public=True))
        self._loads[version] += 1
        return _RegisteredAdapter(version, self._unregister)

    async def _unregister(self, version: str) -> None:
        """Drop the version's name; requests running on it keep it until they finish."""
        self._evictions[version] += 1
        try:
            await self._engine.call(lambda engine: engine.adapters.unload(version, owner=None))
        except EngineUnavailable:      # the engine is gone, and its adapters with it
            pass

    # ---- lifecycle, health, stats --------------------------------------------------------------------
    async def _ready(self) -> None:
        """Start the engine thread on first use (it needs the running loop), then wait until it serves."""
        if not self._started:
            self._started = True
            self._engine.start()
        while self._engine.state is EngineState.STARTING:
            await asyncio.sleep(READY_POLL_S)

    async def check_health(self) -> None:
        """Ray's health check: raise unless the engine loop is alive and making progress."""
        await self._ready()
        healthy, why = self._engine.health(self._stall_timeout_s)
        if not healthy:
            raise EngineUnavailable(f"the engine is not serving: {why}")

    async def load_count(self) -> ReplicaStats:
        await self._ready()
        running, steps, versions = await self._engine.call(lambda engine: (
            len(engine.requests), sum(engine.snapshot().steps.values()), tuple(sorted(engine.adapters.versions))))
        return ReplicaStats(self._replica_id, dict(self._loads), dict(self._evictions), dict(self._requests),
                            self._base_requests, self._abandoned, running, steps, versions)


def replica_app(config: EngineConfig, num_replicas: int, *, num_gpus: float, num_cpus: float,
                max_adapters: int = DEFAULT_MAX_ADAPTERS,
                max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS) -> Any:
    """The Ray Serve application of `num_replicas` engines; `serve.run(app, name=..., route_prefix=None)`
    starts it. Returns Ray's Application (typed Any: ray is not imported where this module is)."""
    from ray import serve

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    deployment = serve.deployment(num_replicas=num_replicas, max_ongoing_requests=max_ongoing_requests,
                                  ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus})(EngineReplica)
    return deployment.bind(config, max_adapters)
