"""The bounded, tenant-fair pool of tokenizer threads that all tokenizer work of the API runs on."""
import asyncio
import copy
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, Protocol, TypeVar

from slora.api.errors import rate_limited, unavailable

T = TypeVar("T")


class Tokenizer(Protocol):
    """What the API uses of a Hugging Face tokenizer."""

    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def apply_chat_template(self, conversation: list[dict[str, str]], **kwargs: Any) -> Any: ...  # noqa: ANN401


class TokenizationCancelled(Exception):
    """The request's client went away: its tokenizer work stopped before the next prompt."""


class _TokenizerCopy(NamedTuple):
    source: Tokenizer            # the API's tokenizer it was copied from
    own: Tokenizer               # this worker thread's copy


TokenizerWork = Callable[[Tokenizer, threading.Event], T]


class Tokenization:
    """Tokenizer work of every tenant on a bounded pool: `workers` threads, each with its own copy of the
    tokenizer (HF fast tokenizers are not thread-safe). Requests waiting for a thread are served round-robin
    across tenants (each tenant has its own FIFO), so a tenant with a long queue delays another by about one
    request per busy tenant, not by its whole queue. At most `max_pending` requests wait in all, and at most
    `max(1, max_pending // 2)` of one tenant, so one tenant cannot fill the queue alone; beyond either bound,
    429. A request cancelled while it waits leaves its tenant's queue at once; one cancelled while its work
    runs stops before its next prompt (the work checks its `cancelled` event), freeing the thread."""

    def __init__(self, workers: int, max_pending: int, retry_after_s: int) -> None:
        self.max_pending = max_pending
        self.max_pending_per_tenant = max(1, max_pending // 2)
        self.retry_after_s = retry_after_s
        # Threads are taken here, on the event loop, so the executor never queues work itself: its queue could
        # be neither bounded nor fair, and cancelling there would not free anything.
        self._free_threads = workers
        # Tenant -> its waiters in arrival order; the dict's order is the rotation (next tenant served first).
        self._queues: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()
        self._executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="slora-tokenize")
        self._running: set[threading.Event] = set()
        self._local = threading.local()
        self._copy_lock = threading.Lock()

    @property
    def waiting(self) -> int:
        """Requests waiting for a thread, of all tenants."""
        return sum(len(queue) for queue in self._queues.values())

    def waiting_of(self, tenant_id: str) -> int:
        return len(self._queues.get(tenant_id, ()))

    async def run(self, tenant_id: str, tokenizer: Tokenizer, work: TokenizerWork[T]) -> T:
        """`work(own copy of tokenizer, cancelled)` on a worker thread, once one is free and it is
        `tenant_id`'s turn."""
        await self._take_thread(tenant_id)
        loop = asyncio.get_running_loop()
        cancelled = threading.Event()
        try:
            future = self._executor.submit(self._on_worker, tokenizer, work, cancelled)
        except RuntimeError:                     # closed: the server is shutting down
            self._give_thread()
            raise unavailable("the server is shutting down; retry later", self.retry_after_s) from None
        self._running.add(cancelled)
        future.add_done_callback(lambda _: _call_on_loop(loop, self._thread_done, cancelled))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            cancelled.set()                      # the thread is given back once the work has stopped
            raise
        except TokenizationCancelled:            # not by this caller, so by close(): the server stops
            raise unavailable("the server is shutting down; retry later", self.retry_after_s) from None

    async def _take_thread(self, tenant_id: str) -> None:
        if self._free_threads > 0:               # then nobody waits: a freed thread goes to a waiter first
            self._free_threads -= 1
            return
        self._check_room(tenant_id)
        turn: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._queues.setdefault(tenant_id, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._give_thread()              # handed a thread just as it was cancelled: pass it on
            else:
                self._leave_queue(tenant_id, turn)
            raise

    def _check_room(self, tenant_id: str) -> None:
        if self.waiting_of(tenant_id) >= self.max_pending_per_tenant:
            raise rate_limited(f"This tenant already has {self.max_pending_per_tenant} requests waiting for the "
                               "tokenizer (the per-tenant limit, half the tokenizer queue); retry later.",
                               self.retry_after_s)
        if self.waiting >= self.max_pending:
            raise rate_limited(f"The tokenizer queue is full ({self.max_pending} requests waiting); retry later.",
                               self.retry_after_s)

    def _leave_queue(self, tenant_id: str, turn: asyncio.Future[None]) -> None:
        queue = self._queues.get(tenant_id)
        if queue is not None and turn in queue:  # not there if a freed thread already skipped it
            queue.remove(turn)
            if not queue:
                del self._queues[tenant_id]

    def _give_thread(self) -> None:
        """A freed thread goes to the next waiter in rotation, else back to the free ones."""
        turn = self._next_turn()
        if turn is None:
            self._free_threads += 1
        else:
            turn.set_result(None)

    def _next_turn(self) -> asyncio.Future[None] | None:
        """The first live waiter of the tenant first in rotation; that tenant then goes last."""
        while self._queues:
            tenant_id, queue = next(iter(self._queues.items()))
            turn = queue.popleft()
            if not queue:
                del self._queues[tenant_id]
            if turn.done():                      # cancelled, its task not yet resumed to leave: skip it
                continue
            if queue:
                self._queues.move_to_end(tenant_id)   # its next waiter goes behind the other tenants' first
            return turn
        return None

    def _thread_done(self, cancelled: threading.Event) -> None:
        self._running.discard(cancelled)
        self._give_thread()

    def _on_worker(self, source: Tokenizer, work: TokenizerWork[T], cancelled: threading.Event) -> T:
        if cancelled.is_set():
            raise TokenizationCancelled()
        return work(self._own_copy(source), cancelled)

    def _own_copy(self, source: Tokenizer) -> Tokenizer:
        held: _TokenizerCopy | None = getattr(self._local, "tokenizer", None)
        if held is None or held.source is not source:
            with self._copy_lock:                # copies read the source; never two at once
                held = self._local.tokenizer = _TokenizerCopy(source, copy.deepcopy(source))
        return held.own

    def close(self) -> None:
        for cancelled in list(self._running):   # running work stops at its next prompt
            cancelled.set()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _call_on_loop(loop: asyncio.AbstractEventLoop, fn: Callable[..., None], *args: Any) -> None:  # noqa: ANN401
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:                         # the loop is closed: nobody waits for the thread any more
        pass
