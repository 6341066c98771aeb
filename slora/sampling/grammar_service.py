"""Grammar compilation off the engine's thread (DESIGN §9). A server's structured-output specs compile in worker
processes, under a time budget and a memory budget, queued per tenant and taken in turn, before the request
reaches the engine; the compiled grammars are cached by bytes, each tenant's share kept fair.

xgrammar's compile cannot be interrupted, and its time grows faster than the spec (a regex of 1,000 starred
groups took minutes), so a compile that runs past its budget, grows its worker past the memory budget, or that no
client waits for any more is stopped by ending its worker process; the next compile starts a new one.
"""
import logging
import multiprocessing
import os
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from slora.sampling.structured_output import StructuredOutput

logger = logging.getLogger(__name__)
MIB = 2 ** 20
POLL_S = 0.02                   # how often a compile's wait looks at its deadline, its memory and its clients
RECYCLE_GROWTH = 0.5            # a worker grown past this share of the compile memory budget is started anew


@dataclass(frozen=True, kw_only=True)
class CompileLimits:
    """What one tenant's spec may cost the server to compile and keep."""

    timeout_s: float = 5.0                  # wall time of one compile
    max_grammar_bytes: int = 64 * MIB       # a compiled grammar's size (xgrammar's memory_size_bytes)
    max_compile_bytes: int = 1024 * MIB     # how much a worker may grow while it compiles
    cache_bytes: int = 512 * MIB            # compiled grammars kept for reuse, all tenants together
    workers: int = 2                        # compiles at once
    max_pending_per_tenant: int = 4         # one tenant's compiles queued or running

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"grammar compile timeout must be > 0 seconds, got {self.timeout_s}")
        for name in ("max_grammar_bytes", "max_compile_bytes", "workers", "max_pending_per_tenant"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.cache_bytes < 0:
            raise ValueError(f"cache_bytes must be >= 0, got {self.cache_bytes}")


class GrammarLimitError(ValueError):
    """A spec refused because compiling or keeping it passes a limit; `limit` names the setting."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


class GrammarQueueFull(RuntimeError):
    """The tenant has max_pending_per_tenant compiles queued or running already."""


class CompileAbandoned(RuntimeError):
    """No client waits for the compile any more."""


CacheKey = tuple[str, StructuredOutput]       # (tenant, spec): one tenant's compile never serves another's


@dataclass(eq=False)
class _Job:
    key: CacheKey
    future: Future = field(default_factory=Future)
    waiters: int = 1
    running: bool = False


class _TurnQueue:
    """Jobs per tenant, taken in turn: one tenant's backlog never holds another's compile behind it."""

    def __init__(self) -> None:
        self._tenants: OrderedDict[str, deque[_Job]] = OrderedDict()
        self._ready = threading.Condition()
        self._closed = False

    def put(self, job: _Job) -> None:
        with self._ready:
            self._tenants.setdefault(job.key[0], deque()).append(job)
            self._ready.notify()

    def take(self) -> _Job | None:
        """The next job (None once closed), the tenant that waited longest first."""
        with self._ready:
            while not self._tenants and not self._closed:
                self._ready.wait()
            if self._closed:
                return None
            tenant, jobs = next(iter(self._tenants.items()))
            job = jobs.popleft()
            del self._tenants[tenant]
            if jobs:
                self._tenants[tenant] = jobs              # to the back of the turn
            job.running = True
            return job

    def remove(self, job: _Job) -> bool:
        """Take `job` out if it still waits; whether it did."""
        with self._ready:
            jobs = self._tenants.get(job.key[0])
            if jobs is None or job not in jobs:
                return False
            jobs.remove(job)
            if not jobs:
                del self._tenants[job.key[0]]
            return True

    def close(self) -> None:
        with self._ready:
            self._closed = True
            self._ready.notify_all()


class _GrammarCache:
    """Compiled grammars by (tenant, spec), bounded by their bytes. Over the bound, the least recently used
    grammar of the tenant holding the most bytes goes first, so no tenant's specs push out another's fair share."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[CacheKey, tuple[Any, int]] = OrderedDict()
        self._tenant_bytes: dict[str, int] = {}

    @property
    def bytes(self) -> int:
        return sum(self._tenant_bytes.values())

    def get(self, key: CacheKey) -> Any:  # noqa: ANN401 - a CompiledGrammar, typed loosely to keep xgrammar lazy
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def put(self, key: CacheKey, grammar: Any, size: int) -> None:  # noqa: ANN401 - as get
        if size > self._capacity or key in self._entries:
            return
        self._entries[key] = (grammar, size)
        self._tenant_bytes[key[0]] = self._tenant_bytes.get(key[0], 0) + size
        while self.bytes > self._capacity:
            self._evict(max(self._tenant_bytes, key=self._tenant_bytes.__getitem__))

    def _evict(self, tenant: str) -> None:
        key = next(k for k in self._entries if k[0] == tenant)      # its least recently used
        _, size = self._entries.pop(key)
        self._tenant_bytes[tenant] -= size
        if not self._tenant_bytes[tenant]:
            del self._tenant_bytes[tenant]


def _serve_compiles(conn: Connection, tokenizer_json: str, max_grammar_bytes: int) -> None:
    """A worker process: compile each (kind, spec) received and answer ("ok", serialized grammar),
    ("invalid", message) or ("too_large", bytes). Ends when the pipe closes."""
    import xgrammar as xgr

    from slora.sampling.grammar import compile_spec
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo.deserialize_json(tokenizer_json), max_threads=1,
                                   cache_enabled=False)
    conn.send(("ready", ""))
    while True:
        try:
            kind, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            grammar = compile_spec(compiler, StructuredOutput(kind, spec))
        except ValueError as exc:
            conn.send(("invalid", str(exc)))
            continue
        size = grammar.memory_size_bytes
        conn.send(("ok", grammar.serialize_json()) if size <= max_grammar_bytes else ("too_large", size))


class _Worker:
    """One worker process and its pipe, started on first use and again after it was stopped."""

    def __init__(self, tokenizer_json: str, limits: CompileLimits) -> None:
        self._tokenizer_json, self._limits = tokenizer_json, limits
        self._process: Any = None
        self._conn: Connection | None = None
        self._baseline = 0

    def compile(self, spec: StructuredOutput, abandoned: Callable[[], bool]) -> tuple[str, Any]:
        """The worker's answer for `spec`; GrammarLimitError past the time or memory budget, CompileAbandoned
        once `abandoned()` holds: either stops the worker."""
        conn = self._started()
        conn.send((spec.kind, spec.spec))
        deadline = time.monotonic() + self._limits.timeout_s
        while not conn.poll(POLL_S):
            self._check(spec, deadline, abandoned)
        try:
            answer = conn.recv()
        except (EOFError, OSError):
            self.stop()
            raise ValueError(f"invalid {spec.kind}: the grammar compiler failed on it") from None
        if self._growth() > self._limits.max_compile_bytes * RECYCLE_GROWTH:
            self.stop()                  # memory the allocator keeps after a large compile goes with the process
        return answer

    def _check(self, spec: StructuredOutput, deadline: float, abandoned: Callable[[], bool]) -> None:
        if abandoned():
            self.stop()
            raise CompileAbandoned("no client waits for the compile")
        if not self._alive():
            self.stop()
            raise ValueError(f"invalid {spec.kind}: the grammar compiler failed on it")
        if time.monotonic() > deadline:
            self.stop()
            raise GrammarLimitError(f"the {spec.kind} did not compile within {self._limits.timeout_s:g} s, the "
                                    "server's limit (--grammar-compile-timeout); simplify it",
                                    "grammar_compile_timeout_s")
        if self._growth() > self._limits.max_compile_bytes:
            self.stop()
            raise GrammarLimitError(f"compiling the {spec.kind} needed more than "
                                    f"{self._limits.max_compile_bytes // MIB} MiB, the server's limit "
                                    "(--grammar-max-compile-bytes); simplify it", "grammar_max_compile_bytes")

    def warm(self) -> None:
        """Start the process now if it is not running; a failure is logged and retried at the next compile."""
        try:
            self._started()
        except (RuntimeError, OSError):
            logger.exception("the grammar compiler process did not start")

    def _started(self) -> Connection:
        if self._conn is not None and self._alive():
            return self._conn
        self.stop()
        context = multiprocessing.get_context("spawn")     # no fork of a process with threads and a GPU context
        parent, child = context.Pipe()
        self._process = context.Process(target=_serve_compiles, name="slora-grammar",
                                        args=(child, self._tokenizer_json, self._limits.max_grammar_bytes),
                                        daemon=True)
        self._process.start()
        child.close()
        self._conn = parent
        if not parent.poll(120) or parent.recv()[0] != "ready":     # imports torch through xgrammar: seconds
            self.stop()
            raise RuntimeError("the grammar compiler process did not start")
        self._baseline = _rss_bytes(self._process.pid)
        return parent

    def _alive(self) -> bool:
        return self._process is not None and self._process.is_alive()

    def _growth(self) -> int:
        return _rss_bytes(self._process.pid) - self._baseline if self._process is not None else 0

    def stop(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._process is not None:
            self._process.kill()
            self._process.join(timeout=10)
            self._process = None


def _rss_bytes(pid: int | None) -> int:
    """A process's resident memory, from /proc (0 where there is none: the memory budget is Linux's)."""
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class GrammarService:
    """Compiles specs for tenants on `limits.workers` worker processes against the tokenizer tables of
    `tokenizer_info` (an xgrammar TokenizerInfo: the engine's vocabulary and EOS ids). `submit` answers a
    Future of the CompiledGrammar; `abandon` tells that its client left. Thread-safe."""

    def __init__(self, tokenizer_info: Any, limits: CompileLimits) -> None:  # noqa: ANN401 - xgrammar's
        self.limits = limits
        self._info = tokenizer_info
        self._cache = _GrammarCache(limits.cache_bytes)
        self._queue = _TurnQueue()
        self._jobs: dict[CacheKey, _Job] = {}
        self._lock = threading.Lock()
        json_text = tokenizer_info.serialize_json()
        self._threads = [threading.Thread(target=self._serve, args=(_Worker(json_text, limits),),
                                          name=f"slora-grammar-{i}", daemon=True) for i in range(limits.workers)]
        for thread in self._threads:
            thread.start()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int],  # noqa: ANN401
                      limits: CompileLimits) -> "GrammarService":
        """A service for a Hugging Face tokenizer, logits `vocab_size` wide, ending at `eos_token_ids`."""
        from slora.sampling.grammar import stop_ids, tokenizer_info
        return cls(tokenizer_info(tokenizer, vocab_size, stop_ids(tokenizer, eos_token_ids)), limits)

    @property
    def cache_bytes(self) -> int:
        with self._lock:
            return self._cache.bytes

    def submit(self, tenant: str, spec: StructuredOutput) -> Future:
        """A Future of `spec`'s CompiledGrammar for `tenant`: done at once from the cache, shared with the
        tenant's compile of the same spec in progress, or queued. GrammarQueueFull past the tenant's bound."""
        from slora.sampling.grammar import CompiledGrammar
        key = (tenant, spec)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                done: Future = Future()
                done.set_result(CompiledGrammar(spec, cached))
                return done
            if key in self._jobs:
                self._jobs[key].waiters += 1
                return self._jobs[key].future
            if sum(k[0] == tenant for k in self._jobs) >= self.limits.max_pending_per_tenant:
                raise GrammarQueueFull(f"{self.limits.max_pending_per_tenant} structured-output compiles of this "
                                       "tenant are in progress; retry when they are done")
            job = self._jobs[key] = _Job(key)
        self._queue.put(job)
        return job.future

    def abandon(self, future: Future) -> None:
        """One client of `future` left: with no other, its compile is dropped, or stopped if it runs."""
        with self._lock:
            job = next((j for j in self._jobs.values() if j.future is future), None)
            if job is None:
                return
            job.waiters -= 1
            if job.waiters > 0 or job.running:
                return                                # a running compile sees waiters == 0 at its next poll
            del self._jobs[job.key]
        if self._queue.remove(job):
            job.future.cancel()

    def close(self) -> None:
        self._queue.close()
        for thread in self._threads:
            thread.join(timeout=15)

    def _serve(self, worker: _Worker) -> None:
        """One worker's loop. Its process is started before a job comes, and again right after one stopped it,
        so that a compile seldom waits for a start (seconds: xgrammar imports torch)."""
        try:
            while True:
                worker.warm()
                job = self._queue.take()
                if job is None:
                    return
                self._run(worker, job)
        finally:
            worker.stop()

    def _run(self, worker: _Worker, job: _Job) -> None:
        try:
            answer = worker.compile(job.key[1], lambda: job.waiters <= 0)
            grammar = self._grammar(job.key[1], answer)
        except Exception as exc:  # the job's error goes to its clients, never to this thread
            self._finish(job, error=exc)
            return
        self._finish(job, result=grammar)

    def _grammar(self, spec: StructuredOutput, answer: tuple[str, Any]) -> Any:  # noqa: ANN401 - xgrammar's
        import xgrammar as xgr
        status, payload = answer
        if status == "invalid":
            raise ValueError(payload)
        if status == "too_large":
            raise GrammarLimitError(f"the {spec.kind} compiles to {payload / MIB:.0f} MiB, over the server's limit "
                                    f"of {self.limits.max_grammar_bytes / MIB:g} MiB (--grammar-max-bytes); "
                                    "simplify it", "grammar_max_bytes")
        return xgr.CompiledGrammar.deserialize_json(payload, self._info)

    def _finish(self, job: _Job, result: Any = None, error: BaseException | None = None) -> None:  # noqa: ANN401
        from slora.sampling.grammar import CompiledGrammar
        with self._lock:
            self._jobs.pop(job.key, None)
            if result is not None:
                self._cache.put(job.key, result, result.memory_size_bytes)
        if job.future.cancelled():
            return
        if error is not None:
            job.future.set_exception(error)
        else:
            job.future.set_result(CompiledGrammar(job.key[1], result))
