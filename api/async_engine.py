"""The engine loop on its own thread, bridged to asyncio (DESIGN §7: the event loop never waits on the GPU).

The engine is not thread-safe, so exactly one thread — the one started here — ever touches it. The event
loop talks to it through a command queue (callables run between two steps, results returned through
futures) and receives outputs through `loop.call_soon_threadsafe`. Outputs are cumulative, so each request
stream keeps only its latest MAX_PENDING_OUTPUTS: each step's output is read as its own chunk, and a slow
client gets older ones merged into the next, never a queue that grows.
"""
import asyncio
import concurrent.futures
import copy
import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from slora.config import EngineConfig
from slora.core.outputs import EngineSnapshot, RequestOutput
from slora.execution.adapter_manager import AdapterManager, PreparedAdapter
from slora.execution.tensor_parallel import TensorParallelError
from slora.models.config import ModelConfig
from slora.sampling.params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from slora.sampling.grammar import CompiledGrammar

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_PENDING_OUTPUTS = 16     # a request stream's outputs kept between two reads


class ServedEngine(Protocol):
    """What AsyncEngine drives on its thread and the server reads there, between steps: slora.engine.Engine in
    this process, or slora.api.cluster_engine.ClusterEngine in front of engine replicas."""

    config: EngineConfig
    model_config: ModelConfig
    model_name: str
    tokenizer: "PreTrainedTokenizerBase | None"
    max_model_len: int
    eos_token_ids: frozenset[int]
    adapters: AdapterManager

    @property
    def scheduling_policy(self) -> str: ...

    def set_tenant_weight(self, owner: str | None, weight: float) -> None: ...

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    adapter: str | None = None, owner: str | None = None, stream: bool = True,
                    grammar: "CompiledGrammar | None" = None, priority: int = 0) -> None: ...

    def abort(self, request_id: str) -> RequestOutput | None: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def snapshot(self) -> EngineSnapshot: ...

    def check_alive(self) -> None: ...

    def close(self) -> None: ...


EngineSource = ServedEngine | Callable[[], ServedEngine]


class EngineState(enum.Enum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    STOPPED = "stopped"
    FAILED = "failed"


class EngineUnavailable(RuntimeError):
    """The engine is starting, draining, stopped or dead: the request cannot be served now."""


@dataclass(frozen=True)
class EngineInfo:
    """Immutable facts about the engine, safe to read from any thread."""

    model_name: str
    max_model_len: int
    vocab_size: int
    tokenizer: Any            # a private copy for the API side (HF fast tokenizers are not thread-safe)
    eos_token_ids: tuple[int, ...] = ()     # what ends an output: its structured-output grammars compile with them
    scheduling_policy: str = "fcfs"         # whether a request's priority is honoured (not under fcfs)


class RequestStream:
    """The outputs of one request, consumed on the event loop. The latest MAX_PENDING_OUTPUTS (cumulative)
    outputs are kept between reads: two steps delivered in one turn of the loop (a step that only takes the
    tokens of the one before is quick) still stream as two chunks."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self.finished = False
        self._pending: deque[RequestOutput] = deque(maxlen=MAX_PENDING_OUTPUTS)   # the oldest dropped first
        self._error: BaseException | None = None
        self._wake = asyncio.Event()

    def push(self, output: RequestOutput) -> None:
        self._pending.append(output)
        self._wake.set()

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._wake.set()

    async def next(self) -> RequestOutput:
        while not self._pending:
            if self._error is not None:
                raise self._error
            await self._wake.wait()
            self._wake.clear()
        output = self._pending.popleft()
        self.finished = output.finished
        return output

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            yield await self.next()


class AsyncEngine:
    """Owns the engine thread. Every public method is called on the event loop thread."""

    def __init__(self, source: EngineSource, idle_poll_s: float = 0.5, snapshot_interval_s: float = 0.2) -> None:
        self._source = source
        self._idle_poll_s = idle_poll_s
        self._snapshot_interval_s = snapshot_interval_s
        self._commands: queue.SimpleQueue[tuple[Callable[[ServedEngine], Any], concurrent.futures.Future]] = \
            queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="slora-engine", daemon=True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last_snapshot = 0.0
        self._abort_scheduled = False
        self.state = EngineState.STARTING
        self.info: EngineInfo | None = None
        self._engine: ServedEngine | None = None          # touched on the engine thread only, except prepare_adapter
        self.snapshot: EngineSnapshot | None = None
        self.busy_since: float | None = None          # monotonic start of the step or command in progress
        self.start_error: str | None = None           # why the engine could not be built (FAILED at start)

    # ---- lifecycle (event loop) ------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    def begin_drain(self, abort_after_s: float | None = None) -> None:
        """Stop admitting requests (SIGTERM); in-flight ones go on, and with `abort_after_s` those still
        running after that long are aborted (their clients get a 503 error). Safe in a signal handler."""
        if self.state in (EngineState.STARTING, EngineState.READY):
            self.state = EngineState.DRAINING
        if abort_after_s is not None and self._loop is not None and not self._abort_scheduled:
            self._abort_scheduled = True
            self._loop.call_soon_threadsafe(self._loop.call_later, abort_after_s, self._abort_all)

    def _abort_all(self) -> None:
        if self._streams:
            logger.warning("aborting %d request(s) still running at the end of the shutdown timeout",
                           len(self._streams))
        for request_id in list(self._streams):
            self.abort(request_id, notify=True)

    async def shutdown(self, timeout_s: float) -> None:
        """Drain: wait up to `timeout_s` for in-flight requests, abort the rest, stop the thread."""
        self.begin_drain()
        deadline = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < deadline and self._thread.is_alive():
            await asyncio.sleep(0.05)
        self._abort_all()
        self._stop.set()
        self._commands.put((lambda engine: None, concurrent.futures.Future()))   # wake an idle loop
        await asyncio.to_thread(self._thread.join, max(1.0, timeout_s))
        if self.state is not EngineState.FAILED:
            self.state = EngineState.STOPPED

    @property
    def accepting(self) -> bool:
        return self.state is EngineState.READY and self._thread.is_alive()

    def health(self, stall_timeout_s: float) -> tuple[bool, str]:
        """Whether the loop is alive and making progress, and a word on why not."""
        if not self._thread.is_alive():
            return False, "the engine thread is not running"
        if self.state is not EngineState.READY:
            return False, self.state.value
        started = self.busy_since
        if started is not None and time.monotonic() - started > stall_timeout_s:
            return False, f"engine step or command running for more than {stall_timeout_s:.0f}s"
        return True, "ok"

    @property
    def num_streams(self) -> int:
        return len(self._streams)

    # ---- requests (event loop) -------------------------------------------------------------------------
    async def call(self, command: Callable[[ServedEngine], T]) -> T:
        """Run `command(engine)` on the engine thread between two steps and return its result."""
        return await asyncio.wrap_future(self._submit(command))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       adapter: str | None, owner: str | None,
                       grammar: "CompiledGrammar | None" = None, priority: int = 0) -> RequestStream:
        """Add a request (its structured output's `grammar` compiled already); raises what `Engine.add_request`
        raises (ValueError, UnknownAdapterError)."""
        if not self.accepting:
            raise EngineUnavailable(self.state.value)
        stream = RequestStream(request_id)
        self._streams[request_id] = stream
        try:
            await self.call(lambda engine: engine.add_request(request_id, prompt_token_ids, params, adapter, owner,
                                                              grammar=grammar, priority=priority))
        except asyncio.CancelledError:
            self.abort(request_id)            # the add may have run already: do not leave it generating
            raise
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return stream

    async def prepare_adapter(self, path: Path) -> PreparedAdapter:
        """Read, validate and pack an adapter on a worker thread; only the engine's immutable configuration
        is read there. Register the result on the engine thread with `call(lambda e: e.adapters.register(...))`."""
        if self._engine is None:
            raise EngineUnavailable(self.state.value)
        return await asyncio.to_thread(self._engine.adapters.prepare, path)

    def abort(self, request_id: str, notify: bool = False) -> None:
        """Abort a request and free its pages at the next pause between steps. With `notify`, its stream
        receives the final output (finish_reason "abort"); otherwise the stream is dropped now."""
        if not notify:
            self._streams.pop(request_id, None)
        try:
            self._submit(lambda engine: self._abort_on_engine(engine, request_id))
        except EngineUnavailable:
            self._streams.pop(request_id, None)

    # ---- engine thread ---------------------------------------------------------------------------------
    def _submit(self, command: Callable[[ServedEngine], T]) -> concurrent.futures.Future:
        if self._stop.is_set() or self.state in (EngineState.STOPPED, EngineState.FAILED):
            raise EngineUnavailable(self.state.value)
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((command, future))
        return future

    def _run(self) -> None:
        engine = self._build()
        if engine is None:
            self._fail_commands()
            return
        try:
            self._serve(engine)
        except TensorParallelError as exc:      # a rank ended: the message names it, a traceback adds nothing
            logger.error("the engine stopped: %s; the server stops serving", exc)
            self._fail_loop()
        except Exception:          # a failed step leaves the engine in an unknown state: stop serving
            logger.exception("the engine loop failed; the server stops serving")
            self._fail_loop()
        finally:
            self._fail_commands()
            engine.close()

    def _fail_loop(self) -> None:
        self.state = EngineState.FAILED
        self._notify_failure()

    def _build(self) -> ServedEngine | None:
        try:
            engine = self._source() if callable(self._source) else self._source
            tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
            self.info = EngineInfo(engine.model_name, engine.max_model_len, engine.model_config.vocab_size,
                                   tokenizer, tuple(sorted(engine.eos_token_ids)), engine.scheduling_policy)
            self._publish(engine, force=True)
            self._engine = engine
        except ValueError as exc:          # the model given cannot load: the message says why, no traceback
            self._fail_start(str(exc))
            return None
        except Exception as exc:
            logger.exception("the engine could not be started")
            self._fail_start(str(exc) or type(exc).__name__)
            return None
        if self.state is EngineState.STARTING:
            self.state = EngineState.READY
        logger.info("engine ready: model %s, context %d tokens", self.info.model_name, self.info.max_model_len)
        return engine

    def _fail_start(self, reason: str) -> None:
        self.start_error = reason
        self.state = EngineState.FAILED

    def _serve(self, engine: ServedEngine) -> None:
        while not self._stop.is_set():
            engine.check_alive()              # between steps too: an idle server with a rank gone says so
            ran_commands = self._run_commands(engine, block=not engine.has_unfinished())
            if engine.has_unfinished():
                self.busy_since = time.monotonic()
                outputs = engine.step()
                self.busy_since = None
                if outputs:
                    self._deliver(outputs)
            self._publish(engine, force=ran_commands or not engine.has_unfinished())

    def _run_commands(self, engine: ServedEngine, block: bool) -> bool:
        try:
            batch = [self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()]
        except queue.Empty:
            return False
        while True:
            try:
                batch.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command, future in batch:
            if not future.set_running_or_notify_cancel():
                continue
            self.busy_since = time.monotonic()      # the stall check sees commands as it sees steps
            try:
                future.set_result(command(engine))
            except Exception as exc:          # user errors (ValueError) and bugs alike go to the caller
                future.set_exception(exc)
            finally:
                self.busy_since = None
        return True

    def _abort_on_engine(self, engine: ServedEngine, request_id: str) -> None:
        output = engine.abort(request_id)
        if output is not None:
            self._deliver([output])

    def _publish(self, engine: ServedEngine, force: bool = False) -> None:
        # snapshot() walks the waiting sequences and the adapters in use, so it is taken at most every
        # snapshot_interval_s while busy.
        now = time.monotonic()
        if force or now - self._last_snapshot >= self._snapshot_interval_s:
            self.snapshot = engine.snapshot()
            self._last_snapshot = now

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        self._call_on_loop(self._dispatch, outputs)

    def _call_on_loop(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None, "start() sets the loop before it starts the engine thread"
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:              # the event loop is closed: nobody is listening any more
            pass

    def _notify_failure(self) -> None:
        self._call_on_loop(self._fail_streams, EngineUnavailable("the engine failed"))

    def _fail_commands(self) -> None:
        while True:
            try:
                _, future = self._commands.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineUnavailable(self.state.value))

    # ---- event loop callbacks --------------------------------------------------------------------------
    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            stream.push(output)
            if output.finished:
                del self._streams[output.request_id]

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.fail(error)
        self._streams.clear()
