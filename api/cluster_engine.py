"""The engine of a cluster's ingress: the surface AsyncEngine drives (step, add_request, abort, adapters, the
tokenizer and model facts), with the computing done by engine replicas on Ray Serve (slora.api.replica).

The ingress keeps every check of the single server (tenants, quotas, adapter names and namespaces) because
its `adapters` is a real AdapterManager: the cluster's catalog. It is built from the model's config alone
(a model on the `meta` device gives the LoRA shapes; no weights are read) and never computes. A request's
(name, owner) resolves to a version there; the request then streams from a replica through the handle with
the version as Ray's multiplexed model id and the version's folder (the adapter store's, on this node's
disk) for the replica to read. Ray routes; nothing here chooses a replica.

Structured outputs: a compiled grammar may not pickle, so the replica compiles `params.structured` itself;
the grammar compiled at the ingress (its checks) is not sent.
"""
import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, TypeVar

from slora.api.replica import PUBLISH_INTERVAL_S, ReplicaRequest
from slora.config import EngineConfig
from slora.core.outputs import (
    INTERNAL_ERROR,
    AdapterPlacement,
    CompletionOutput,
    EngineSnapshot,
    RequestError,
    RequestOutput,
)
from slora.core.page_pool import PageAllocator
from slora.core.scheduler import check_fits
from slora.execution.adapter_manager import AdapterFormat, AdapterManager
from slora.execution.pool_memory import PoolShape
from slora.models.builtin import resolve_model
from slora.models.config import ModelConfig, load_model_config
from slora.models.registry import build_model
from slora.models.tokenizer import eos_token_ids, load_tokenizer
from slora.sampling.params import SamplingParams
from slora.sampling.request_state import check_request

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar

logger = logging.getLogger(__name__)
T = TypeVar("T")
# As Engine.step: the longest a step with nothing new waits, so a request arriving meanwhile waits no longer.
IDLE_STEP_WAIT_S = 0.005
# Longest a stream may stay silent before its request fails: a replica that died or hangs ends its requests
# with an error instead of leaving them waiting. Generous: a request queued behind a replica's batch is silent.
STREAM_STALL_TIMEOUT_S = 120.0
# A replica that stopped posting its snapshot (dead, removed) leaves the ingress's /metrics after this long.
REPLICA_SNAPSHOT_MAX_AGE_S = 5 * PUBLISH_INTERVAL_S


@dataclass(frozen=True)
class _Failure:
    """A stream that ended without its final output; made into one on AsyncEngine's thread."""

    request_id: str
    error: RequestError


@dataclass
class _Flight:
    """One request streaming from a replica."""

    request_id: str
    prompt_token_ids: list[int]
    num_samples: int
    version: str | None
    future: concurrent.futures.Future
    latest: RequestOutput | None = None


def build_catalog(config: EngineConfig, model_config: ModelConfig, max_model_len: int,
                  num_pages: int) -> AdapterManager:
    """An AdapterManager with the replicas' adapter format, over a pool of the replicas' size (`num_pages`,
    as a replica reports it) that is only bookkeeping: adapters too large for a replica are refused here."""
    shapes = build_model(model_config, "meta").lora_targets()       # shapes from the config, no weights
    shape = PoolShape(model_config.num_layers, num_pages, config.page_size, model_config.num_kv_heads,
                      model_config.head_dim, config.torch_dtype, config.torch_kv_cache_dtype,
                      config.kv_cache_skip_layers)
    adapter_format = AdapterFormat(shapes, config.max_lora_rank, shape.page_elems, config.torch_dtype)
    usable = config.scheduler_config(0, max_model_len).usable_pages(num_pages)
    # No host tier: the catalog never computes, so it keeps no packed copies (a quarter of the ingress's
    # memory by default otherwise); its adapters' residency reads "disk" here, the replicas hold the copies.
    return AdapterManager(PageAllocator(num_pages, config.page_size), adapter_format, 0, usable)


def in_catalog_names(snapshot: EngineSnapshot, catalog: dict[str, AdapterPlacement]) -> EngineSnapshot:
    """A replica's snapshot with its adapters under the cluster's names: a replica knows each version by the
    version alone, the catalog by the names and namespaces the tenants gave it. A version the catalog no
    longer names (unloaded, still running) keeps no name, and is not shown."""
    def placed(version: str, placement: AdapterPlacement) -> AdapterPlacement:
        known = catalog.get(version)
        return replace(placement, names=known.names if known else (),
                       used_by=known.used_by if known else frozenset())
    return replace(snapshot, adapter_placements={v: placed(v, p) for v, p in snapshot.adapter_placements.items()})


def error_output(flight: _Flight, error: RequestError) -> RequestOutput:
    """The final output of a request whose replica failed: its samples end with "error"."""
    return _final_output(flight, "error", error)


def _final_output(flight: _Flight, reason: str, error: RequestError | None = None) -> RequestOutput:
    latest = flight.latest
    samples = latest.outputs if latest is not None else \
        [CompletionOutput(i, [], "", None) for i in range(flight.num_samples)]
    outputs = [CompletionOutput(s.index, list(s.token_ids), s.text, s.finish_reason or reason, s.logprobs,
                                s.cumulative_logprob) for s in samples]
    return RequestOutput(flight.request_id, flight.prompt_token_ids, outputs, finished=True,
                         num_cached_tokens=latest.num_cached_tokens if latest is not None else 0, error=error)


async def _next_within(outputs: AsyncIterator[T], timeout_s: float) -> T:
    """The iterator's next item, or TimeoutError after `timeout_s`. Not `asyncio.wait_for`: before Python 3.12
    it returns the item and swallows a cancellation that arrives just as the item does (CPython gh-86296), so an
    aborted request's stream went on to its end, and its replica with it."""
    step = asyncio.ensure_future(outputs.__anext__())
    try:
        done, _ = await asyncio.wait({step}, timeout=timeout_s)
    finally:
        step.cancel()           # cancelled (the request was aborted) or timed out; a no-op when it is done
    if not done:
        raise TimeoutError(f"no output in {timeout_s:g} s")
    return step.result()


class ClusterEngine:
    """Engine's surface for AsyncEngine, over a DeploymentHandle of EngineReplica (`handle`: Ray's, typed Any
    because ray is not imported where this module is). Every method but the stream tasks runs on AsyncEngine's
    thread; the streams run on an event loop of their own, and hand outputs over through a queue."""

    def __init__(self, config: EngineConfig, handle: Any, *, pool_pages: int, board: Any = None,
                 stall_timeout_s: float = STREAM_STALL_TIMEOUT_S) -> None:
        """`pool_pages`: a replica's pool size (replicas are alike); `board`: the replicas' SnapshotBoard (Ray's
        ActorHandle), read for /metrics and told of aborted requests, or None."""
        self.config = config
        source = resolve_model(config.model)
        self.model_config = load_model_config(source.folder)
        self.model_name = source.served_name
        self.tokenizer = load_tokenizer(source.folder)
        self.max_model_len = min(config.max_model_len or self.model_config.max_model_len,
                                 self.model_config.max_model_len)
        self.eos_token_ids = eos_token_ids(self.model_config.eos_token_ids, self.tokenizer)
        self.adapters = build_catalog(config, self.model_config, self.max_model_len, pool_pages)
        self._scheduler_config = config.scheduler_config(0, self.max_model_len)     # the replicas' admission rules
        self.adapters.load_demos(source.demo_adapters)     # the replicas' demo adapters, by the same folders
        self.requests: dict[str, _Flight] = {}
        self.tenant_weights: dict[str | None, float] = {}
        self._handle = handle
        self._stall_timeout_s = stall_timeout_s
        self._inbox: queue.SimpleQueue[RequestOutput | _Failure] = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="slora-cluster-streams", daemon=True)
        self._thread.start()
        self._replicas: dict[str, EngineSnapshot] = {}     # replaced whole by the board's reader: no lock
        self._board = board
        if board is not None:
            asyncio.run_coroutine_threadsafe(self._read_board(board), self._loop)

    # ---- facts AsyncEngine reads --------------------------------------------------------------------
    @property
    def scheduling_policy(self) -> str:
        return self.config.scheduling_policy or "fcfs"

    def set_tenant_weight(self, owner: str | None, weight: float) -> None:
        """The owner's share under vtc: sent with its requests, each replica's scheduler applies it."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be positive, got {weight}")
        self.tenant_weights[owner] = weight

    # ---- requests -----------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, owner: str | None = None, stream: bool = True,
                    grammar: "CompiledGrammar | None" = None, priority: int = 0) -> None:
        """Resolve the adapter in the catalog (UnknownAdapterError) and start the request's stream from a
        replica. `grammar` is not sent (it may not pickle): the replica compiles `params.structured`."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        # The engine's own checks, here too: refused before the client's response starts, as on one engine.
        check_request(prompt_token_ids, params, self.model_config.vocab_size, self.max_model_len,
                      self.config.max_num_seqs, self.config.max_beam_width)
        if priority and self.scheduling_policy == "fcfs":
            raise ValueError("a request's priority needs the priority or vtc scheduling policy; this engine "
                             "schedules first come, first served")
        ref = None if adapter is None else self.adapters.resolve(adapter, owner)
        # Each replica would refuse what its pool cannot hold; refused here, the client gets a 400, not an error
        # event after its response has started.
        check_fits(self._scheduler_config, self.adapters.allocator.num_pages, len(prompt_token_ids),
                   ref.num_pages if ref else 0)
        version = None if ref is None else ref.version
        request = self._replica_request(request_id, prompt_token_ids, params, version, owner, priority)
        if version is not None:       # its folder stays on disk until the request ends, as in Engine
            self.adapters.acquire(version)
        future = asyncio.run_coroutine_threadsafe(self._stream(request), self._loop)
        self.requests[request_id] = _Flight(request_id, list(prompt_token_ids), params.num_samples, version, future)

    def _replica_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                         version: str | None, owner: str | None, priority: int) -> ReplicaRequest:
        folder = None if version is None else self.adapters.source_folder(version)
        if version is not None and folder is None:
            raise ValueError(f"adapter version {version[:12]} has no folder on disk the replicas could read")
        return ReplicaRequest(request_id, list(prompt_token_ids), params, version,
                              None if folder is None else str(folder), owner, priority,
                              self.tenant_weights.get(owner))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request: its stream is cancelled, which cancels it on the replica."""
        flight = self.requests.get(request_id)
        if flight is None:
            return None
        flight.future.cancel()
        return self._end(flight, _final_output(flight, "abort"))

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        """The outputs that arrived since the last step; waits up to IDLE_STEP_WAIT_S when none has."""
        try:
            arrived = [self._inbox.get(timeout=IDLE_STEP_WAIT_S)]
        except queue.Empty:
            return []
        while True:
            try:
                arrived.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        return [output for output in map(self._take, arrived) if output is not None]

    def _take(self, output: RequestOutput | _Failure) -> RequestOutput | None:
        flight = self.requests.get(output.request_id)
        if flight is None:              # aborted meanwhile: its final output was returned then
            return None
        if isinstance(output, _Failure):
            return self._end(flight, error_output(flight, output.error))
        flight.latest = output
        return self._end(flight, output) if output.finished else output

    def _end(self, flight: _Flight, output: RequestOutput) -> RequestOutput:
        del self.requests[flight.request_id]
        if flight.version is not None:
            self.adapters.release(flight.version)
        return output

    # ---- streams (their own event loop) ----------------------------------------------------------------
    async def _stream(self, request: ReplicaRequest) -> None:
        try:
            async for output in self._outputs(request):
                self._inbox.put(output)
        except asyncio.CancelledError:
            raise
        except Exception as exc:       # a replica that died, a stall, Ray's errors: this request alone fails
            logger.warning("request %s failed on its replica: %s", request.request_id, exc)
            reason = "stalled" if isinstance(exc, TimeoutError) else f"failed ({type(exc).__name__})"
            self._inbox.put(_Failure(request.request_id, RequestError(
                INTERNAL_ERROR, f"the replica serving the request {reason}; the request was stopped")))

    async def _outputs(self, request: ReplicaRequest) -> AsyncIterator[RequestOutput]:
        options: dict[str, Any] = {"stream": True, "method_name": "generate"}
        if request.adapter_version is not None:
            options["multiplexed_model_id"] = request.adapter_version
        responses = self._handle.options(**options).remote(request)
        ended = False
        try:
            while True:
                try:
                    yield await _next_within(responses, self._stall_timeout_s)
                except StopAsyncIteration:
                    ended = True
                    return
        finally:                  # cancelled, failed or stalled: the replica stops computing it
            if not ended:
                responses.cancel()          # at once, but best effort, as Ray documents it
                self._post_abort(request.request_id)

    def _post_abort(self, request_id: str) -> None:
        """Tell the replicas through their board: the one running the request aborts it at its next post."""
        if self._board is None:
            return
        try:
            self._board.abort.remote(request_id)      # not awaited: a lost post leaves Ray's cancel alone
        except Exception as exc:        # Ray's errors: the board's actor is gone (undeploy)
            logger.warning("could not post the abort of request %s to the replicas' board: %s", request_id, exc)

    async def _read_board(self, board: Any) -> None:
        """Keep the replicas' latest snapshots, read from their board every PUBLISH_INTERVAL_S."""
        while True:
            try:
                self._replicas = await board.fresh.remote(REPLICA_SNAPSHOT_MAX_AGE_S)
            except Exception as exc:    # Ray's errors: the board is gone (undeploy); metrics only
                logger.warning("could not read the replicas' snapshots: %s", exc)
                self._replicas = {}
            await asyncio.sleep(PUBLISH_INTERVAL_S)

    # ---- introspection ------------------------------------------------------------------------------
    def check_alive(self) -> None:
        """Nothing to check here: Ray Serve watches and replaces the replicas."""

    def snapshot(self) -> EngineSnapshot:
        """The ingress's counters (requests in flight, the catalog) and its replicas' snapshots, their adapters
        under the catalog's names."""
        counts, replicas = self.adapters.counts(), self._replicas
        catalog = self.adapters.placements({v for snap in replicas.values() for v in snap.adapter_placements})
        return EngineSnapshot(pool=self.adapters.allocator.stats().as_dict(), sequences_running=len(self.requests),
                              sequences_waiting=0, requests=len(self.requests), preemptions=0,
                              adapter_pool_loads=0, adapter_pool_evictions=0, adapters_registered=counts.names,
                              adapters_host=counts.on_host, adapters_pool=0, steps={}, step_seconds={},
                              decode_bytes=0, taken_at=time.time(),
                              adapter_load_seconds=self.adapters.load_times.counted(),
                              replicas={rid: in_catalog_names(snap, catalog) for rid, snap in replicas.items()})

    def close(self) -> None:
        """Stop the streams' loop (their requests are aborted by AsyncEngine's shutdown first)."""
        self._loop.call_soon_threadsafe(self._loop.stop)
