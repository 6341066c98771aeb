"""Engine replicas behind Ray Serve, with adapters multiplexed by version id.

An ingress (the FastAPI app: auth, tenants and tokenization done once there) sends each tokenized request
through a DeploymentHandle with the adapter's version id as Ray's multiplexed model id:

    handle.options(multiplexed_model_id=version, stream=True, method_name="generate").remote(request)

Ray's router then prefers a replica that already holds that version; slora routes nothing itself. Each
replica runs one engine (AsyncEngine) and makes a version known on its first request through Ray's
multiplexed loader, which registers it as a public adapter named by the version; when Ray evicts it (LRU over
`max_adapters` versions) the name is dropped, its running requests finish, and the engine's tiers free it.

Each replica also posts its engine's snapshot to the cluster's SnapshotBoard (a small named Ray actor) every
PUBLISH_INTERVAL_S, from which the ingress's /metrics gives every replica's series with a `replica` label.

A request whose client leaves is stopped two ways. The ingress cancels its stream, which Ray turns into a
CancelledError inside `generate` within milliseconds; Ray documents that as best effort. So the ingress also
posts the request id to the board, and each replica reads the ids posted since its last snapshot in the answer
to its next post and aborts those it runs.

Ray is imported inside functions only: a server without replicas never imports it.
"""
import asyncio
import contextvars
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slora.api.async_engine import AsyncEngine, EngineState, EngineUnavailable
from slora.config import EngineConfig
from slora.core.outputs import EngineSnapshot, RequestOutput
from slora.engine import Engine
from slora.sampling.params import SamplingParams

logger = logging.getLogger(__name__)

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
# How long Ray lets a replica being removed (scale-down, redeploy) finish its requests before it stops it.
# Generous: a long generation on a loaded replica takes minutes, and a drained replica takes no new ones.
DEFAULT_DRAIN_TIMEOUT_S = 300.0
PUBLISH_INTERVAL_S = 1.0            # how often a replica posts its engine snapshot to the board
ABORTED_KEPT_S = 60.0               # how long the board keeps an aborted id for replicas yet to post
BOARD_NAMESPACE = "slora"           # the Ray namespace of the boards (detached actors, one per application)


def board_name(app_name: str) -> str:
    """The SnapshotBoard of the Ray Serve application `app_name` (its replicas post there)."""
    return f"slora-snapshots:{app_name}"


class SnapshotBoard:
    """The latest engine snapshot of each replica, as they post them (a Ray actor: `board(app_name)`). A replica
    that stops posting (dead, removed) leaves the board's answers after `max_age_s`. It also carries the ids of
    requests the ingress aborted, to every replica, in the answer to its next post."""

    def __init__(self) -> None:
        self._latest: dict[str, tuple[float, EngineSnapshot]] = {}
        self._aborted: dict[str, float] = {}        # request id -> when the ingress aborted it

    def post(self, replica_id: str, snapshot: EngineSnapshot) -> list[str]:
        """Keep the snapshot; the ids aborted since this replica's previous post (all kept ones on its first)."""
        now = time.monotonic()
        previous = self._latest.get(replica_id, (now - ABORTED_KEPT_S, None))[0]
        self._latest[replica_id] = (now, snapshot)
        self._aborted = {rid: at for rid, at in self._aborted.items() if now - at <= ABORTED_KEPT_S}
        return [rid for rid, at in self._aborted.items() if at >= previous]

    def abort(self, request_id: str) -> None:
        self._aborted[request_id] = time.monotonic()

    def fresh(self, max_age_s: float) -> dict[str, EngineSnapshot]:
        """The snapshots posted within `max_age_s`; older ones are dropped."""
        now = time.monotonic()
        self._latest = {rid: item for rid, item in self._latest.items() if now - item[0] <= max_age_s}
        return {rid: snapshot for rid, (_, snapshot) in self._latest.items()}


def board(app_name: str) -> Any:
    """The application's board: made on first use by whoever asks first (the ingress or a replica), detached so
    that it outlives a replica that made it; `undeploy` removes it. Ray's ActorHandle (typed Any)."""
    import ray

    actor = ray.remote(num_cpus=0)(SnapshotBoard)
    return actor.options(name=board_name(app_name), namespace=BOARD_NAMESPACE, lifetime="detached",
                         get_if_exists=True).remote()


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
    """What one replica did with adapters (tests and benchmarks; /metrics reads the engine's snapshots)."""

    replica_id: str                      # Ray's replica tag, the `replica` label of the ingress's /metrics
    actor_name: str                      # its Ray actor (in Ray's "serve" namespace): ray.kill takes it down
    loads: dict[str, int]                # version -> times the multiplexed loader registered it here
    evictions: dict[str, int]            # version -> times Ray evicted it here
    requests: dict[str, int]             # version -> requests on it served here
    base_requests: int
    abandoned: int                       # requests aborted because their consumer went away first
    running: int                         # requests in the engine now
    engine_steps: int                    # steps the engine has run
    engine_versions: tuple[str, ...]     # versions the engine knows now, on any tier
    pool_loads: int                      # adapter versions the engine copied into its pool
    reloads: int                         # versions read back from disk after their host copy was dropped


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
        import ray
        from ray import serve

        if max_adapters < 1:
            raise ValueError(f"max_adapters must be >= 1, got {max_adapters}")
        # Built here, not on the engine thread: Ray counts the replica started once its constructor returns.
        self._engine = AsyncEngine(Engine(config))
        self._started = False
        self._stall_timeout_s = stall_timeout_s
        context = serve.get_replica_context()
        self._replica_id, self._app_name = context.replica_tag, context.app_name
        self._actor_name = ray.get_runtime_context().get_actor_name() or ""
        self._tasks: set[asyncio.Task] = set()
        self._read_from: dict[str, str] = {}            # version -> the folder the engine reads it back from
        self._loads: Counter[str] = Counter()
        self._evictions: Counter[str] = Counter()
        self._requests: Counter[str] = Counter()
        self._base_requests = 0
        self._abandoned = 0
        self._running: set[str] = set()                 # ids of the requests `generate` streams now
        self._weights: dict[str | None, float] = {}     # the tenants' weights the engine has now
        # Ray's loader takes the model id only; the folder of the request whose load it is travels beside it.
        self._folder: contextvars.ContextVar[str] = contextvars.ContextVar(f"slora-adapter-folder-{id(self)}")
        self._adapter = serve.multiplexed(max_num_models_per_replica=max_adapters)(self._loader())
        # Ray runs the constructor on the replica's event loop: the engine starts (and posts its snapshots)
        # before the first request.
        self._spawn(self._ready())

    def _spawn(self, work: Awaitable[None]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)          # held until done: the loop keeps only weak references to tasks
        task.add_done_callback(self._tasks.discard)

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
        self._running.add(request.request_id)
        try:
            async for output in stream:
                yield output
        finally:               # the consumer went away (closed, cancelled) before the end: stop computing it
            if stream.finished:
                self._running.discard(request.request_id)
            else:
                self._abandon(request.request_id)

    def _abandon(self, request_id: str) -> None:
        """Abort a request this replica streams, once, whichever way its end was asked for (the stream's
        cancellation, or the board). The stream is sent its final output, so a generator still driven ends."""
        if request_id in self._running:
            self._running.discard(request_id)
            self._abandoned += 1
            self._engine.abort(request_id, notify=True)

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
        if self._read_from.get(version) != folder:    # registered from a folder since deleted (an unload and
            await self._engine.call(lambda engine: engine.adapters.read_back_from(version, Path(folder)))
            self._read_from[version] = folder         # upload again): read back from this request's copy

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
        self._read_from[version] = folder
        self._loads[version] += 1
        return _RegisteredAdapter(version, self._unregister)

    async def _unregister(self, version: str) -> None:
        """Drop the version's name; requests running on it keep it until they finish."""
        self._evictions[version] += 1
        self._read_from.pop(version, None)
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
            self._spawn(self._post_snapshots())
        while self._engine.state is EngineState.STARTING:
            await asyncio.sleep(READY_POLL_S)

    async def _post_snapshots(self) -> None:
        """Post the engine's latest snapshot to the application's board every PUBLISH_INTERVAL_S, and abort the
        requests the board says the ingress aborted. A failed post is logged, and the board is looked up again
        (made anew if it was removed)."""
        posts_to = board(self._app_name)
        while True:
            snapshot = self._engine.snapshot
            if snapshot is not None:
                try:
                    for request_id in await posts_to.post.remote(self._replica_id, snapshot):
                        self._abandon(request_id)
                except Exception as exc:     # Ray's errors: the board's actor died or was removed
                    logger.warning("replica %s could not post its snapshot: %s", self._replica_id, exc)
                    posts_to = board(self._app_name)
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    async def check_health(self) -> None:
        """Ray's health check: raise unless the engine loop is alive and making progress."""
        await self._ready()
        healthy, why = self._engine.health(self._stall_timeout_s)
        if not healthy:
            raise EngineUnavailable(f"the engine is not serving: {why}")

    async def pool_pages(self) -> int:
        """Pages in this replica's unified pool: the ingress checks requests against it."""
        await self._ready()
        return await self._engine.call(lambda engine: engine.snapshot().pool["total_pages"])

    async def load_count(self) -> ReplicaStats:
        await self._ready()
        snapshot, versions, reloads = await self._engine.call(lambda engine: (
            engine.snapshot(), tuple(sorted(engine.adapters.versions)), engine.adapters.num_reloads))
        return ReplicaStats(self._replica_id, self._actor_name, dict(self._loads), dict(self._evictions),
                            dict(self._requests), self._base_requests, self._abandoned, snapshot.requests,
                            sum(snapshot.steps.values()), versions, snapshot.adapter_pool_loads, reloads)


@dataclass(frozen=True, kw_only=True)
class Autoscaling:
    """Ray Serve's autoscaling of the replicas: between `min_replicas` and `max_replicas`, aiming at
    `target_ongoing_requests` per replica. The delays are Ray's defaults: a replica is added after the load has
    stayed above target for `upscale_delay_s`, removed (drained first) after it stayed below for
    `downscale_delay_s`; the load is averaged over `look_back_period_s`."""

    min_replicas: int
    max_replicas: int
    target_ongoing_requests: float
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    look_back_period_s: float = 30.0

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
            raise ValueError(f"autoscaling needs 0 <= min <= max and max >= 1, got min {self.min_replicas} and "
                             f"max {self.max_replicas}")
        if not self.target_ongoing_requests > 0:
            raise ValueError(f"the autoscaling target must be positive, got {self.target_ongoing_requests}")


def autoscaling_config(autoscaling: Autoscaling, initial_replicas: int) -> dict[str, Any]:
    """Ray's autoscaling_config, starting at `initial_replicas` (kept within the bounds)."""
    initial = min(max(initial_replicas, autoscaling.min_replicas), autoscaling.max_replicas)
    return {"min_replicas": autoscaling.min_replicas, "max_replicas": autoscaling.max_replicas,
            "initial_replicas": initial, "target_ongoing_requests": autoscaling.target_ongoing_requests,
            "upscale_delay_s": autoscaling.upscale_delay_s, "downscale_delay_s": autoscaling.downscale_delay_s,
            "look_back_period_s": autoscaling.look_back_period_s}


def replica_app(config: EngineConfig, num_replicas: int, *, num_gpus: float, num_cpus: float,
                max_adapters: int = DEFAULT_MAX_ADAPTERS,
                max_ongoing_requests: int = DEFAULT_MAX_ONGOING_REQUESTS,
                autoscaling: Autoscaling | None = None,
                drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S) -> Any:
    """The Ray Serve application of `num_replicas` engines (with `autoscaling`: the number it starts with);
    `serve.run(app, name=..., route_prefix=None)` starts it. A replica removed by a scale-down or an update
    takes no new requests and finishes those it has, for up to `drain_timeout_s`. Returns Ray's Application
    (typed Any: ray is not imported where this module is)."""
    from ray import serve

    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not drain_timeout_s > 0:
        raise ValueError(f"drain_timeout_s must be positive, got {drain_timeout_s}")
    scaling: dict[str, Any] = {"num_replicas": num_replicas} if autoscaling is None else \
        {"autoscaling_config": autoscaling_config(autoscaling, num_replicas)}
    deployment = serve.deployment(max_ongoing_requests=max_ongoing_requests,
                                  ray_actor_options={"num_gpus": num_gpus, "num_cpus": num_cpus},
                                  graceful_shutdown_timeout_s=drain_timeout_s, **scaling)(EngineReplica)
    return deployment.bind(config, max_adapters)
