"""Completions and chat completions: validation, tokenization, admission, engine requests, and the answer
as one JSON object or as server-sent events."""
import asyncio
import contextlib
import copy
import functools
import inspect
import json
import logging
import re
import threading
import time
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from slora.api import protocol, tool_calls
from slora.api.async_engine import AsyncEngine, EngineInfo, EngineUnavailable, RequestStream
from slora.api.errors import APIError, bad_request, internal_error, model_not_found, rate_limited, unavailable
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from slora.api.settings import ServerSettings
from slora.api.streaming import ClientGone, EventStreamResponse, unless_disconnected
from slora.api.tenants import Tenant
from slora.core.outputs import ADAPTER_UNAVAILABLE, GRAMMAR_TOO_SLOW, CompletionOutput, RequestError, RequestOutput
from slora.execution.adapter_manager import UnknownAdapterError
from slora.sampling.grammar_service import GrammarLimitError, GrammarQueueFull, GrammarService
from slora.sampling.params import SamplingParams
from slora.sampling.structured_output import StructuredOutput

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar

logger = logging.getLogger(__name__)
# Tokens per sample reserved against a tenant's token rate when a request gives no max_tokens (then settled).
_UNSPECIFIED_RESERVE = 256
request_log = logging.getLogger("slora.api.requests")
T = TypeVar("T")

# Used when the tokenizer has no chat template (documented in the README): one block per message,
# "<|role|>\n{content}{eos}\n", then "<|assistant|>\n" to ask for the answer.
DEFAULT_CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n"
                         "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")
DONE_EVENT = "data: [DONE]\n\n"
_PARAM_IN_MESSAGE = re.compile(r"SamplingParams\.(\w+)")
# Words of an engine refusal (ValueError from add_request) of the request's structured output, not its prompt.
_STRUCTURE_WORDS = re.compile(r"schema|regex|regular expression|grammar|json|choice|structured", re.IGNORECASE)


def _outcome_of(exc: BaseException) -> str:
    """The metrics outcome of a job that failed before it was answered."""
    if isinstance(exc, APIError):
        return "rejected"
    return "disconnected" if isinstance(exc, asyncio.CancelledError) else "error"


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def withhold(text: str, stops: list[str]) -> str:
    """The part of a running sample's text that is safe to send: without a trailing partial UTF-8
    character (decoded as U+FFFD, which the next token may complete) and without a suffix that may be the
    start of a stop string (which would then be cut from the final text)."""
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    text = text[:end]
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                end = min(end, len(text) - k)
                break
    return text[:end]


@dataclass
class ChoiceProgress:
    """What has been sent of one choice (one sample of one prompt)."""

    sent_text: str = ""
    sent_tokens: int = 0
    finish_reason: str | None = None
    started: bool = False                  # its first event (with the echo, if any) went out
    text_offset: int = 0                   # of the next token in its logprobs (legacy completions format)

    def advance(self, text: str, token_ids: list[int], finish_reason: str | None,
                stops: list[str]) -> tuple[str, list[int], bool]:
        """(text delta, token delta, whether it just finished) for a new cumulative output."""
        visible = text if finish_reason is not None else withhold(text, stops)
        delta = ""
        if visible.startswith(self.sent_text):
            delta = visible[len(self.sent_text):]
            self.sent_text = visible
        new_tokens = token_ids[self.sent_tokens:]
        self.sent_tokens = len(token_ids)
        just_finished = finish_reason is not None and self.finish_reason is None
        self.finish_reason = finish_reason or self.finish_reason
        return delta, new_tokens, just_finished


@dataclass
class Job:
    """One HTTP generation request: one engine request per prompt, each with `params.n` samples."""

    kind: str                                  # "completion" | "chat"
    model: str
    adapter: str | None
    tenant: Tenant
    prompts: list[list[int]]
    params: SamplingParams
    stream: bool
    include_usage: bool
    return_token_ids: bool
    user: str | None
    response_id: str = ""
    created: int = field(default_factory=protocol.now)
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    streams: list[RequestStream] = field(default_factory=list)
    finals: dict[int, RequestOutput] = field(default_factory=dict)
    outcome: str = "ok"
    closed: bool = False
    reserved_tokens: int = 0                   # charged to the tenant's token rate at admission
    continuous_usage: bool = False             # every streamed chunk carries the usage so far
    echo: list[str] | None = None              # per prompt, the text its answers start with
    echo_logprobs: bool = False                # completions: the prompt's tokens come first in logprobs
    logprobs: int | None = None                # top logprobs per position in the answer (None: no logprobs)
    prompt_logprobs: int | None = None         # vLLM's prompt_logprobs in the answer
    tokens_as_ids: bool = False                # tokens in logprobs as "token_id:<id>"
    structured_param: str | None = None        # the field that asked for a structured output
    grammar: "CompiledGrammar | None" = None   # that structured output, compiled
    prompt_param: str = "prompt"
    sent_tokens: dict[tuple[int, int], int] = field(default_factory=dict)   # streamed tokens per choice
    tool_parser: tool_calls.ToolParser | None = None   # chat: how calls are read out of the answer (None: not)
    legacy_functions: bool = False             # chat: the request used `functions`; calls in function_call too

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.response_id = self.response_id or protocol.new_id(prefix)

    @property
    def object_name(self) -> str:
        return "chat.completion" if self.kind == "chat" else "text_completion"

    @property
    def chunk_name(self) -> str:
        return "chat.completion.chunk" if self.kind == "chat" else "text_completion"

    def request_id(self, prompt_index: int) -> str:
        return f"{self.response_id}-{prompt_index}"

    def choice_index(self, prompt_index: int, sample_index: int) -> int:
        return prompt_index * self.params.n + sample_index

    def completion_tokens(self) -> int:
        return sum(len(o.token_ids) for out in self.finals.values() for o in out.outputs)

    def streamed_tokens(self) -> int:
        """Output tokens of every choice so far (while streaming)."""
        return sum(self.sent_tokens.values())

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def token_reservation(self, max_tokens_given: bool) -> int:
        """Tokens charged to the tenant's rate at admission: the prompt, and max_tokens for every sample of every
        prompt. Without an explicit max_tokens (chat's default is the rest of the context) at most
        _UNSPECIFIED_RESERVE per sample is reserved; the difference to what ran is settled at the end."""
        per_sample = self.params.max_tokens if max_tokens_given else min(self.params.max_tokens, _UNSPECIFIED_RESERVE)
        return self.prompt_tokens() + len(self.prompts) * self.params.num_samples * per_sample

    def tokens_used(self) -> int:
        """What the tenant's token rate is finally charged: nothing for a request refused before it ran."""
        return 0 if self.outcome == "rejected" else self.prompt_tokens() + self.completion_tokens()

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return sum(out.num_cached_tokens for out in self.finals.values())


def _calls_fields(job: Job, calls: tuple[tool_calls.ToolCall, ...]) -> dict[str, Any]:
    """The message fields of an answer's calls: tool_calls, and for a legacy request (`functions`) also
    function_call, the first call, where such clients read it (the legacy form has one call)."""
    made = [call.as_openai() for call in calls]
    fields: dict[str, Any] = {"tool_calls": made}
    if job.legacy_functions:
        fields["function_call"] = dict(made[0]["function"])
    return fields


def _calls_reason(job: Job) -> str:
    """The finish_reason of an answer that made calls: OpenAI's legacy "function_call" for `functions`."""
    return "function_call" if job.legacy_functions else "tool_calls"


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


def encode_text(tokenizer: Tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Text -> ids exactly as the offline `LLM.encode` does (by default), so both give the same tokens."""
    if not add_special_tokens:
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer.encode(text))


def encode_texts(tokenizer: Tokenizer, texts: list[str], cancelled: threading.Event,
                 add_special_tokens: bool = True) -> list[list[int]]:
    """Each prompt's ids; stops between prompts once `cancelled` is set."""
    ids = []
    for text in texts:
        if cancelled.is_set():
            raise TokenizationCancelled()
        ids.append(encode_text(tokenizer, text, add_special_tokens))
    return ids


def decode_prompts(tokenizer: Tokenizer, prompts: list[list[int]], cancelled: threading.Event) -> list[str]:
    """Each token-id prompt's text (for echo); stops between prompts once `cancelled` is set."""
    texts = []
    for prompt in prompts:
        if cancelled.is_set():
            raise TokenizationCancelled()
        texts.append(tokenizer.decode(prompt))
    return texts


def render_chat(tokenizer: Tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool,
                continue_final_message: bool = False, add_special_tokens: bool = False,
                **template_kwargs: Any) -> list[int]:   # noqa: ANN401 - the template's variables
    """The chat template's text of `messages`, as ids. `template_kwargs` (tools, documents, the request's
    chat_template_kwargs) are the template's; keys that are none of its variables are left out."""
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    extra = {key: value for key, value in template_kwargs.items() if value is not None}
    if continue_final_message:
        extra["continue_final_message"] = True
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt, **extra)
    return encode_text(tokenizer, text, add_special_tokens)


def template_reserved_names(tokenizer: Tokenizer) -> frozenset[str]:
    """Names chat_template_kwargs may not use: the parameters of `apply_chat_template` itself (tokenize,
    chat_template, tools, ...), which would change how it runs rather than what the template sees."""
    return _reserved_names(type(tokenizer))


@functools.lru_cache(maxsize=16)
def _reserved_names(tokenizer_class: type[Tokenizer]) -> frozenset[str]:
    try:
        parameters = list(inspect.signature(tokenizer_class.apply_chat_template).parameters.values())
    except (AttributeError, TypeError, ValueError):
        parameters = []
    names = {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names | {"conversation", "messages", "chat_template", "tokenize", "add_generation_prompt",
                              "continue_final_message", "tools", "documents", "return_dict", "tokenizer_kwargs"})


class TokenTexts:
    """Each token id's text for logprobs, as vLLM shows it: the id decoded alone, special tokens included.
    Decoded once per id with a copy of the tokenizer used only on the event loop, then remembered."""

    def __init__(self, tokenizer: Tokenizer | None) -> None:
        self._source = tokenizer
        self._tokenizer: Any = None
        self._texts: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            if self._source is None:
                return f"token_id:{token_id}"
            if self._tokenizer is None:
                self._tokenizer = copy.deepcopy(self._source)   # never shared with the tokenizer threads
            text = self._texts[token_id] = self._tokenizer.decode([token_id])
        return text

    @staticmethod
    def as_id(token_id: int) -> str:
        return f"token_id:{token_id}"


# Loads the adapter a request names when the caller has none of that name (AdapterService.resolve): whether
# it loaded one.
AdapterResolver = Callable[[Tenant, str], Awaitable[bool]]


class GenerationService:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, admission: Admission,
                 metrics: ServerMetrics, tokenization: Tokenization, resolver: AdapterResolver | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.admission = admission
        self.metrics = metrics
        self.tokenization = tokenization
        self.resolver = resolver                 # with --enable-lora-resolver
        self._token_texts: TokenTexts | None = None
        self._grammars: GrammarService | None = None     # started by the first structured request
        self._grammars_lock = asyncio.Lock()

    @property
    def token_texts(self) -> TokenTexts:
        if self._token_texts is None:
            self._token_texts = TokenTexts(self._info.tokenizer)
        return self._token_texts

    @property
    def _info(self) -> EngineInfo:
        info = self.engine.info
        assert info is not None, "the routes run only once the engine is up (ServerContext.require_engine)"
        return info

    # ---- the request's model ---------------------------------------------------------------------------------
    @property
    def base_names(self) -> tuple[str, ...]:
        """What the base model answers to (ServerSettings.base_names_of); the first is the one answers echo."""
        return self.settings.base_names_of(self._info.model_name)

    def adapter_of(self, model: str) -> str | None:
        """The adapter a request's `model` names; None for the base model."""
        return None if model in self.base_names else model

    async def require_model(self, model: str, tenant: Tenant) -> None:
        """404 unless `model` is the base model or an adapter the tenant may use (loaded by the resolver if
        need be): for routes that use no engine request, where add_request would make that check."""
        adapter = self.adapter_of(model)
        if adapter is None:
            return
        try:
            found = await self.engine.call(lambda engine: engine.adapters.lookup(adapter, tenant.namespace))
        except EngineUnavailable:
            raise unavailable("the server is not serving now; retry later", self.settings.retry_after_s) from None
        if found is None and not await self._resolved(tenant, adapter):
            raise model_not_found(model)

    async def _resolved(self, tenant: Tenant, adapter: str) -> bool:
        return self.resolver is not None and await self.resolver(tenant, adapter)

    # ---- entry points ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, tenant: Tenant, request: Request) -> Response:
        self.check_request(body, body.num_prompts, body.text_chars, "prompt")
        return await self._serve(request, lambda: self._completion_job(body, tenant))

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, request: Request) -> Response:
        self.check_request(body, 1, body.text_chars, "messages")
        return await self._serve(request, lambda: self._chat_job(body, tenant))

    async def _completion_job(self, body: CompletionRequest, tenant: Tenant) -> Job:
        add_special_tokens = body.add_special_tokens is not False      # vLLM's default for completions: true
        given = await self._completion_prompts(body.prompt, tenant, add_special_tokens)
        prompts = self._truncated(body, given)
        echo_logprobs = bool(body.echo) and body.logprobs is not None
        prompt_logprobs = body.prompt_logprobs
        if echo_logprobs:                    # the engine computes what the answer shows of the prompt
            prompt_logprobs = max(body.logprobs or 0, prompt_logprobs or 0)
        job = self._job("completion", body, tenant, prompts, body.token_limit, "prompt", logprobs=body.logprobs,
                        prompt_logprobs=prompt_logprobs)
        job.echo_logprobs = echo_logprobs
        if body.echo:                        # a truncated prompt is echoed as what is left of it
            job.echo = await self._echo_texts(body.prompt if prompts == given else prompts, prompts, tenant)
        return job

    async def _chat_job(self, body: ChatCompletionRequest, tenant: Tenant) -> Job:
        prompt = await self.chat_prompt(body, tenant)
        prompts = self._truncated(body, [prompt])
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        job = self._job("chat", body, tenant, prompts, body.token_limit, "messages", logprobs=logprobs,
                        prompt_logprobs=body.prompt_logprobs)
        job.tool_parser = tool_calls.parser_for(body.effective_tools(), body.effective_tool_choice(),
                                                self.settings.enable_auto_tool_choice)
        job.legacy_functions = body.legacy_functions
        if body.echo:
            # vLLM's echo: the answer starts with the last message when that message has the answer's role.
            role = "assistant" if body.add_generation_prompt else body.messages[-1].role
            last = body.messages[-1]
            job.echo = [last.text() if last.role == role else ""]
        return job

    @staticmethod
    def _truncated(body: SamplingRequest, prompts: list[list[int]]) -> list[list[int]]:
        keep = body.truncate_prompt_tokens
        return prompts if keep is None else [p[-keep:] for p in prompts]

    async def _echo_texts(self, prompt: str | list[str] | list[int] | list[list[int]], prompts: list[list[int]],
                          tenant: Tenant) -> list[str]:
        """The text each prompt's answers start with: the prompt as given, or decoded from its ids."""
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str):
            return [p for p in prompt if isinstance(p, str)]
        tokenizer = self._info.tokenizer
        if tokenizer is None:
            return ["" for _ in prompts]
        return await self.tokenization.run(tenant.id, tokenizer,
                                           lambda own, cancelled: decode_prompts(own, prompts, cancelled))

    # ---- validation --------------------------------------------------------------------------------------
    def check_request(self, body: SamplingRequest, num_prompts: int, text_chars: int, prompt_param: str) -> None:
        """The run-time limits (the settings, tighter than the models' hard caps) on the raw request, before
        any tokenizer work is done for it."""
        self._check_samples(body, num_prompts)
        self._check_stops(body.stop_list)
        if text_chars > self.settings.max_prompt_chars:
            raise bad_request(f"{prompt_param} has {text_chars} characters of text; the limit is "
                              f"{self.settings.max_prompt_chars} per request (max_prompt_chars)", param=prompt_param,
                              code="request_too_large")
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise bad_request("best_of greater than n is not supported with stream=true (the best samples are "
                              "known only at the end)", param="best_of")
        if body.stream and body.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not available with stream=true", param="prompt_logprobs")
        self._check_token_ids(body)
        if isinstance(body, ChatCompletionRequest):
            self._check_chat(body)

    def _check_samples(self, body: SamplingRequest, num_prompts: int) -> None:
        if body.n > self.settings.max_n:
            raise bad_request(f"n must be between 1 and {self.settings.max_n}", param="n")
        if body.best_of is not None and body.best_of > self.settings.max_n:
            raise bad_request(f"best_of must be between n and {self.settings.max_n}", param="best_of")
        samples, name = (body.best_of, "best_of") if body.best_of is not None else (body.n, "n")
        if num_prompts * samples > self.settings.max_choices:
            raise bad_request(f"prompts x {name} must be at most {self.settings.max_choices}, got {num_prompts} x "
                              f"{samples}", param=name)

    def _check_token_ids(self, body: SamplingRequest) -> None:
        vocab = self._info.vocab_size
        outside = sorted(token for token in body.logit_bias_ids if token >= vocab)
        if outside:
            raise bad_request(f"logit_bias names token id {outside[0]}, outside the vocabulary [0, {vocab})"
                              + (f" ({len(outside)} such ids)" if len(outside) > 1 else ""), param="logit_bias")

    def _check_chat(self, body: ChatCompletionRequest) -> None:
        if body.continue_final_message and body.add_generation_prompt:
            raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                              param="continue_final_message")
        if body.continue_final_message and body.messages[-1].role != "assistant":
            raise bad_request("continue_final_message needs the last message to be the assistant's",
                              param="continue_final_message")
        self._check_tools(body)
        if body.chat_template_kwargs and self._info.tokenizer is not None:
            reserved = template_reserved_names(self._info.tokenizer)
            clashes = sorted(key for key in body.chat_template_kwargs if key in reserved)
            if clashes:
                raise bad_request(f"chat_template_kwargs may not set {clashes[0]!r}: it is a parameter of the "
                                  "template call, not a template variable", param="chat_template_kwargs")

    @staticmethod
    def _check_tools(body: ChatCompletionRequest) -> None:
        """tools or the legacy functions, not both; a forced tool choice needs tools and names one of them."""
        if body.tools is not None and body.functions is not None:
            raise bad_request("tools and functions cannot both be given: functions is the deprecated form of tools",
                              param="functions")
        if body.tool_choice is not None and body.function_call is not None:
            raise bad_request("tool_choice and function_call cannot both be given: function_call is the deprecated "
                              "form of tool_choice", param="function_call")
        forced, param = body.forced_tool(), body.tool_choice_param
        tools = body.effective_tools()
        if forced is not None and not tools:
            given = '"required"' if forced == "required" else "a named function"
            raise bad_request(f"{param} {given} needs tools (or functions) to call", param=param)
        if isinstance(forced, protocol.NamedFunction) and forced.name not in {t.function.name for t in tools or ()}:
            raise bad_request(f"{param} names the function {forced.name!r}, which is not among the request's "
                              f"{'tools' if body.tools is not None else 'functions'}", param=param)

    def _check_stops(self, stops: list[str]) -> None:
        if len(stops) > self.settings.max_stop_sequences:
            raise bad_request(f"at most {self.settings.max_stop_sequences} stop sequences are allowed", param="stop")
        if any(len(s) > self.settings.max_stop_length for s in stops):
            raise bad_request(f"stop sequences must be 1 to {self.settings.max_stop_length} characters",
                              param="stop")

    def _tokenizer(self, what: str) -> Tokenizer:
        tokenizer = self._info.tokenizer
        if tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what} needs one; give prompts as token ids",
                              param="prompt" if what == "text prompts" else "messages")
        return tokenizer

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]],
                                  tenant: Tenant, add_special_tokens: bool = True) -> list[list[int]]:
        texts = [prompt] if isinstance(prompt, str) else prompt
        if isinstance(texts[0], int):            # CompletionRequest refuses empty lists
            return [list(texts)]
        if isinstance(texts[0], list):
            return [list(p) for p in texts]
        tokenizer = self._tokenizer("text prompts")
        return await self.tokenization.run(
            tenant.id, tokenizer, lambda own, cancelled: encode_texts(own, texts, cancelled, add_special_tokens))

    async def chat_prompt(self, body: ChatCompletionRequest, tenant: Tenant) -> list[int]:
        tokenizer = self._tokenizer("chat")
        messages = [m.template_dict() for m in body.messages]
        variables: dict[str, Any] = {"tools": body.template_tools(), "documents": body.documents,
                                     "reasoning_effort": body.reasoning_effort, **(body.chat_template_kwargs or {})}
        try:
            return await self.tokenization.run(
                tenant.id, tokenizer, lambda own, _: render_chat(
                    own, messages, body.add_generation_prompt, bool(body.continue_final_message),
                    bool(body.add_special_tokens), **variables))
        except (ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") \
                from None
        except Exception as exc:       # jinja2 template errors (raise_exception in the template) are user errors
            if type(exc).__module__.startswith("jinja2"):
                raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
            raise

    def _job(self, kind: str, body: SamplingRequest, tenant: Tenant, prompts: list[list[int]],
             max_tokens: int | None, prompt_param: str, logprobs: int | None = None,
             prompt_logprobs: int | None = None) -> Job:
        structured_param, structured = self._structured(body)
        params = self._params(body, prompts, max_tokens, prompt_param, logprobs, prompt_logprobs, structured)
        adapter = self.adapter_of(body.model)
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        shown = self.base_names[0] if adapter is None else body.model      # what the answer says it is
        job = Job(kind, shown, adapter, tenant, prompts, params, bool(body.stream), include_usage,
                  bool(body.return_token_ids), body.user)
        job.continuous_usage = bool(options and options.continuous_usage_stats)
        job.logprobs = logprobs
        job.prompt_logprobs = body.prompt_logprobs
        job.tokens_as_ids = bool(body.return_tokens_as_token_ids)
        job.structured_param = structured_param
        job.prompt_param = prompt_param
        job.reserved_tokens = job.token_reservation(max_tokens is not None)
        return job

    @staticmethod
    def _structured(body: SamplingRequest) -> tuple[str | None, StructuredOutput | None]:
        """The one structured output the request asks for (response_format, guided_*, structured_outputs)."""
        try:
            given = body.structured_outputs_given()
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        names = [name for name, _ in given]
        forced = next((name for name in names if name in ("tool_choice", "function_call")), None)
        if forced is not None and len(given) > 1:
            other = next(name for name in names if name != forced)
            kinds = '"required" or a named function' if forced == "tool_choice" else "a named function"
            raise bad_request(f"{forced} and {other} cannot both be given: a forced {forced} ({kinds}) makes the "
                              "answer the call's JSON, a structured output of its own", param=other)
        if len(given) > 1:
            raise bad_request(f"{' and '.join(names)} cannot both be given: a request takes one structured output",
                              param=names[1])
        return given[0] if given else (None, None)

    def _params(self, body: SamplingRequest, prompts: list[list[int]], max_tokens: int | None,
                prompt_param: str, logprobs: int | None = None, prompt_logprobs: int | None = None,
                structured: StructuredOutput | None = None) -> SamplingParams:
        context = self._info.max_model_len
        longest = max(len(p) for p in prompts)
        if longest == 0:
            raise bad_request("the prompt is empty", param=prompt_param)
        if max_tokens == 0:                  # the prompt alone (a loglikelihood): it may fill the context
            if longest > context:
                raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has "
                                  f"{longest} tokens.", param=prompt_param, code="context_length_exceeded")
        elif longest >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has "
                              f"{longest} tokens (at least one token must be generated).", param=prompt_param,
                              code="context_length_exceeded")
        limit = self.settings.max_tokens_limit or context
        if max_tokens is None:               # as much as the context leaves, within the server's limit
            max_tokens = min(limit, context - longest)
        if max_tokens > limit:
            raise bad_request(f"max_tokens must be between 0 and {limit}", param="max_tokens")
        if longest + max_tokens > context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                              "completion).", param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop_list, stop_token_ids=body.stop_token_ids or [], n=body.n,
                ignore_eos=bool(body.ignore_eos), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                presence_penalty=body.presence_penalty or 0.0, frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                min_tokens=body.min_tokens or 0, min_p=body.min_p or 0.0, logit_bias=body.logit_bias_ids,
                best_of=body.best_of, structured=structured)
        except ValueError as exc:
            found = _PARAM_IN_MESSAGE.search(str(exc))
            message = str(exc).replace("SamplingParams.", "")
            raise bad_request(message, param=found.group(1) if found else None) from None

    # ---- running -------------------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if not self.engine.accepting:
            raise unavailable(f"the server is {self.engine.state.value}; retry later", self.settings.retry_after_s)

    async def _serve(self, request: Request, prepare: Callable[[], Awaitable[Job]]) -> Response:
        """Tokenize (`prepare`), admit and submit a job, then answer it. A client that goes away while any of
        that waits is noticed there too, and its work is cancelled where it is (in the tokenizer queue or
        between two prompts, in admission, or while its engine requests are added)."""
        try:
            job = await unless_disconnected(request.receive, self._admitted(prepare))
        except ClientGone:
            return Response(status_code=499)      # nobody reads it
        return await self._answer(job, request)

    async def _admitted(self, prepare: Callable[[], Awaitable[Job]]) -> Job:
        job = await prepare()
        self._require_ready()
        if job.params.structured is not None:       # compiled before admission: waiting holds no seat, no page
            job.grammar = await self._compiled(job, job.params.structured)
        self.admission.charge_tokens(job.tenant, job.reserved_tokens)
        try:
            await self.admission.acquire(job.tenant)
        except BaseException:
            self.admission.settle_tokens(job.tenant, job.reserved_tokens, 0)   # never admitted: it used nothing
            raise
        try:
            await self._submit(job)
        except BaseException as exc:
            job.outcome = _outcome_of(exc)
            self._close(job)
            raise
        return job

    async def _compiled(self, job: Job, spec: StructuredOutput) -> "CompiledGrammar":
        """The job's structured output compiled by the grammar workers, off the engine's thread; a 400 naming the
        limit it passes, a 429 while the tenant has too many compiles pending. A client that leaves abandons it."""
        service = await self._grammar_service()
        try:
            future = service.submit(job.tenant.id, spec)
        except GrammarQueueFull as exc:
            raise rate_limited(str(exc), self.settings.retry_after_s) from None
        waiting = asyncio.wrap_future(future)
        # Read by nobody once this client leaves (the shield keeps the shared compile from being cancelled).
        waiting.add_done_callback(lambda done: done.cancelled() or done.exception())
        try:
            return await asyncio.shield(waiting)     # shared with the tenant's other waiters
        except asyncio.CancelledError:
            service.abandon(future)
            raise
        except GrammarLimitError as exc:
            raise bad_request(str(exc), param=job.structured_param, code="grammar_too_complex") from None
        except ValueError as exc:
            raise bad_request(str(exc), param=job.structured_param) from None

    async def _grammar_service(self) -> GrammarService:
        """The compile workers, started on first use (the tokenizer's tables take a moment to build)."""
        async with self._grammars_lock:
            if self._grammars is None:
                info = self._info
                if info.tokenizer is None:
                    raise bad_request("structured output needs the model's tokenizer, and this model has none")
                self._grammars = await asyncio.to_thread(GrammarService.for_tokenizer, info.tokenizer, info.vocab_size,
                                                         info.eos_token_ids, self.settings.compile_limits())
            return self._grammars

    def close(self) -> None:
        if self._grammars is not None:
            self._grammars.close()

    async def _answer(self, job: Job, request: Request) -> Response:
        if job.stream:
            return EventStreamResponse(self._events(job), lambda gone: self._on_stream_closed(job, gone))
        try:
            await unless_disconnected(request.receive, self._collect(job))
        except ClientGone:
            job.outcome = "disconnected"
            return Response(status_code=499)      # nobody reads it; the request is already aborted below
        except APIError:
            job.outcome = "error"
            raise
        finally:
            self._close(job)
        return JSONResponse(self._response(job))

    async def _submit(self, job: Job) -> None:
        for index, prompt in enumerate(job.prompts):
            try:
                stream = await self._generate(job, index, prompt)
            except UnknownAdapterError:
                raise model_not_found(job.model) from None
            except EngineUnavailable:
                raise unavailable("the server is not serving now; retry later", self.settings.retry_after_s) \
                    from None
            except ValueError as exc:
                message = str(exc).replace("SamplingParams.", "")
                param = job.prompt_param
                if job.structured_param is not None and _STRUCTURE_WORDS.search(message):
                    param = job.structured_param     # the engine could not compile the structured output
                elif (found := _PARAM_IN_MESSAGE.search(str(exc))) is not None:
                    param = found.group(1)
                raise bad_request(message, param=param) from None
            job.streams.append(stream)

    async def _generate(self, job: Job, index: int, prompt: list[int]) -> RequestStream:
        """One engine request of the job; an adapter the caller lacks is loaded by the resolver, then tried again."""
        try:
            return await self.engine.generate(job.request_id(index), prompt, job.params, job.adapter,
                                              job.tenant.namespace, job.grammar)
        except UnknownAdapterError:
            if job.adapter is None or not await self._resolved(job.tenant, job.adapter):
                raise
        return await self.engine.generate(job.request_id(index), prompt, job.params, job.adapter, job.tenant.namespace,
                                          job.grammar)

    async def _outputs(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """(prompt index, cumulative output) as they come, over all of the job's engine requests."""
        if len(job.streams) == 1:
            async for output in job.streams[0]:
                yield 0, self._observe(job, 0, output)
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def forward(index: int, stream: RequestStream) -> None:
            try:
                async for output in stream:
                    queue.put_nowait((index, output))
            except Exception as exc:  # handed to the consumer, which raises it
                queue.put_nowait((index, exc))
        tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(job.streams)]
        try:
            while len(job.finals) < len(job.streams):
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                yield index, self._observe(job, index, item)
        finally:
            for task in tasks:
                task.cancel()

    def _observe(self, job: Job, index: int, output: RequestOutput) -> RequestOutput:
        """Record an output; raise the APIError of an engine request that failed, which fails the job."""
        if job.first_token is None and any(o.token_ids for o in output.outputs):
            job.first_token = time.perf_counter()
        if output.finished:
            job.finals[index] = output
        if output.error is not None:
            raise self._failure(job, output.request_id, output.error)
        return output

    @staticmethod
    def _failure(job: Job, request_id: str, error: RequestError) -> APIError:
        """What the client is told about an engine request that failed (the engine's message may name server
        paths or internals, so it goes to the log only)."""
        logger.warning("request %s failed in the engine (%s): %s", request_id, error.code, error.message)
        if error.code == GRAMMAR_TOO_SLOW:
            return APIError(400, error.message[:1].upper() + error.message[1:] + ".", code="grammar_too_slow",
                            param=job.structured_param)
        if error.code == ADAPTER_UNAVAILABLE:
            return APIError(409, f"The adapter `{job.model}` can no longer be used: its files on the server changed "
                                 "or vanished since it was loaded. Its owner must load the adapter again.",
                            code="adapter_unavailable", param="model")
        return APIError(500, "The server failed while generating this request (other requests were not "
                             "affected); retry it, and report the problem if it persists.", code="internal_error")

    async def _collect(self, job: Job) -> None:
        try:
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for _ in outputs:
                    pass
        except EngineUnavailable:
            raise unavailable("the engine stopped while generating; retry later", self.settings.retry_after_s) \
                from None
        if self._aborted(job):
            raise unavailable("the server is shutting down; retry later", self.settings.retry_after_s)

    @staticmethod
    def _aborted(job: Job) -> bool:
        return any(o.finish_reason == "abort" for out in job.finals.values() for o in out.outputs)

    def _response(self, job: Job) -> dict[str, Any]:
        choices = []
        for index in range(len(job.prompts)):
            out = job.finals[index]
            echo = job.echo[index] if job.echo else ""
            for position, sample in enumerate(out.outputs):      # best_of: the best first
                ids = {"token_ids": sample.token_ids, "prompt_token_ids": out.prompt_token_ids} \
                    if job.return_token_ids else {}
                choice = job.choice_index(index, position)
                if job.kind == "chat":
                    choices.append(self._chat_choice(job, choice, echo, sample, ids))
                    continue
                logprobs, _ = self._completion_logprobs(job, out, sample, 0, job.echo_logprobs)
                extra = None
                if job.prompt_logprobs is not None:
                    extra = {"prompt_logprobs": self._prompt_logprobs(job, out)}
                choices.append(protocol.completion_choice(choice, echo + sample.text, sample.finish_reason, **ids,
                                                          logprobs=logprobs, extra=extra))
        extra = None
        if job.kind == "chat" and job.prompt_logprobs is not None:      # vLLM puts it beside the choices
            extra = {"prompt_logprobs": self._prompt_logprobs(job, job.finals[0])}
        return protocol.response_object(job.object_name, job.response_id, job.created, job.model, choices,
                                        self._usage(job), extra=extra)

    def _chat_choice(self, job: Job, choice: int, echo: str, sample: CompletionOutput,
                     ids: dict[str, list[int]]) -> dict[str, Any]:
        """One chat choice; with tool parsing, the calls in its text as message.tool_calls (and the first as
        the legacy message.function_call for a request that gave `functions`)."""
        logprobs = self._chat_logprobs(job, sample, 0)
        parsed = None if job.tool_parser is None else job.tool_parser.parse(sample.text)
        if parsed is None or not parsed.tool_calls:
            return protocol.chat_choice(choice, echo + sample.text, sample.finish_reason, **ids, logprobs=logprobs)
        made = protocol.chat_choice(choice, echo + (parsed.content or ""), _calls_reason(job), **ids,
                                    logprobs=logprobs)
        made["message"]["content"] = made["message"]["content"] or None
        made["message"].update(_calls_fields(job, parsed.tool_calls))
        return made

    def _token_text(self, job: Job) -> protocol.TokenText:
        return TokenTexts.as_id if job.tokens_as_ids else self.token_texts

    def _chat_logprobs(self, job: Job, sample: CompletionOutput, start: int,
                       end: int | None = None) -> dict[str, Any] | None:
        """The chat logprobs of sample tokens [start:end]."""
        if job.logprobs is None:
            return None
        end = len(sample.token_ids) if end is None else end
        logprobs = None if sample.logprobs is None else sample.logprobs[start:end]
        return protocol.chat_logprobs(sample.token_ids[start:end], logprobs, job.logprobs, self._token_text(job))

    def _completion_logprobs(self, job: Job, out: RequestOutput, sample: CompletionOutput, start: int,
                             with_prompt: bool, end: int | None = None,
                             offset: int = 0) -> tuple[dict[str, Any] | None, int]:
        """The legacy logprobs of sample tokens [start:end], after the prompt's with `with_prompt` (echo), and the
        text offset after them."""
        if job.logprobs is None:
            return None, offset
        end = len(sample.token_ids) if end is None else end
        token_ids = sample.token_ids[start:end]
        logprobs = protocol.padded(token_ids, None if sample.logprobs is None else sample.logprobs[start:end])
        if with_prompt:
            token_ids = out.prompt_token_ids + token_ids
            logprobs = protocol.padded(out.prompt_token_ids, out.prompt_logprobs) + logprobs
        return protocol.completion_logprobs(token_ids, logprobs, job.logprobs, self._token_text(job), offset)

    def _prompt_logprobs(self, job: Job, out: RequestOutput) -> list[dict[str, dict[str, Any]] | None] | None:
        return protocol.prompt_logprobs(out.prompt_token_ids, out.prompt_logprobs, job.prompt_logprobs or 0,
                                        self._token_text(job))

    @staticmethod
    def _usage(job: "Job") -> dict:
        return protocol.usage(job.prompt_tokens(), job.completion_tokens(), job.cached_tokens())

    # ---- streaming -----------------------------------------------------------------------------------------
    async def _events(self, job: Job) -> AsyncGenerator[str, None]:
        progress: dict[int, ChoiceProgress] = {}
        try:
            if job.kind == "chat":
                echo = job.echo[0] if job.echo else ""
                for choice in range(len(job.prompts) * job.params.n):
                    yield self._chunk(job, [protocol.chat_delta_choice(choice, {"role": "assistant", "content": echo},
                                                                       None)])
            async with contextlib.aclosing(self._outputs(job)) as outputs:
                async for index, output in outputs:
                    for event in self._delta_events(job, index, output, progress):
                        yield event
            if self._aborted(job):
                job.outcome = "shutdown"
                yield unavailable("the server is shutting down; retry later").sse_event()
            elif job.include_usage:
                yield sse(protocol.response_object(job.chunk_name, job.response_id, job.created, job.model, [],
                                                   self._usage(job)))
        except EngineUnavailable:
            job.outcome = "error"
            yield unavailable("the engine stopped while generating").sse_event()
        except APIError as exc:
            job.outcome = "error"
            yield exc.sse_event()
        except Exception:             # a bug must not leave the client hanging: report it in the stream
            logger.exception("stream %s failed", job.response_id)
            job.outcome = "error"
            yield internal_error().sse_event()
        yield DONE_EVENT

    def _delta_events(self, job: Job, index: int, output: RequestOutput,
                      progress: dict[int, ChoiceProgress]) -> list[str]:
        events = []
        for sample in output.outputs:
            if sample.finish_reason == "abort":
                continue
            choice = job.choice_index(index, sample.index)
            state = progress.setdefault(choice, ChoiceProgress())
            start = state.sent_tokens
            parsing = job.tool_parser is not None
            # With tool parsing the text from the first <tool_call> on (a forced call: all) waits for the end.
            shown = job.tool_parser.streamable(sample.text) if job.tool_parser is not None else sample.text
            text, tokens, finished = state.advance(shown, sample.token_ids, sample.finish_reason, job.params.stop)
            if not text and not tokens and not finished:
                continue
            first, state.started = not state.started, True
            job.sent_tokens[(index, sample.index)] = state.sent_tokens
            token_ids = tokens if job.return_token_ids else None
            reason = sample.finish_reason if finished else None
            if job.kind == "chat":
                delta: dict[str, Any] = {"content": text} if text or not finished else {}
                if parsing and finished:
                    delta, reason = self._final_tool_delta(job, sample, state, text, reason)
                choice_obj = protocol.chat_delta_choice(choice, delta, reason, token_ids,
                                                        self._chat_logprobs(job, sample, start, state.sent_tokens))
            else:
                logprobs, state.text_offset = self._completion_logprobs(
                    job, output, sample, start, first and job.echo_logprobs, state.sent_tokens, state.text_offset)
                echo = job.echo[index] if job.echo and first else ""
                choice_obj = protocol.completion_choice(choice, echo + text, reason, token_ids, logprobs=logprobs)
            events.append(self._chunk(job, [choice_obj]))
        return events

    @staticmethod
    def _final_tool_delta(job: Job, sample: CompletionOutput, state: ChoiceProgress, text: str,
                          reason: str | None) -> tuple[dict[str, Any], str | None]:
        """The last delta of a streamed choice with tool parsing: the content held back (from the first
        <tool_call> on) that is not a call, and the calls, all at once; `text` is what streamable() let out in
        this chunk."""
        assert job.tool_parser is not None, "only for jobs that parse tool calls"
        parsed = job.tool_parser.parse(sample.text)
        content = parsed.content or ""
        held = content[len(state.sent_text):] if content.startswith(state.sent_text) else ""
        state.sent_text += held
        delta: dict[str, Any] = {"content": text + held} if text or held else {}
        if not parsed.tool_calls:
            return delta, reason
        fields = _calls_fields(job, parsed.tool_calls)
        fields["tool_calls"] = [{"index": i, **call} for i, call in enumerate(fields["tool_calls"])]
        delta.update(fields)
        return delta, _calls_reason(job)

    @staticmethod
    def _chunk(job: Job, choices: list[dict[str, Any]]) -> str:
        usage = protocol.usage(job.prompt_tokens(), job.streamed_tokens()) if job.continuous_usage else None
        return sse(protocol.response_object(job.chunk_name, job.response_id, job.created, job.model, choices,
                                            usage, include_usage_key=job.include_usage or job.continuous_usage))

    def _on_stream_closed(self, job: Job, disconnected: bool) -> None:
        if disconnected and len(job.finals) < len(job.streams):
            job.outcome = "disconnected"
        self._close(job)

    # ---- the end of a job ----------------------------------------------------------------------------------
    def _close(self, job: Job) -> None:
        """Abort what still runs (a disconnected client frees its pages at once), release the tenant's slot,
        record metrics and log the request. Runs exactly once per admitted job."""
        if job.closed:
            return
        job.closed = True
        for index, stream in enumerate(job.streams):
            if index not in job.finals:
                self.engine.abort(stream.request_id)
        self.admission.release(job.tenant)
        self.admission.settle_tokens(job.tenant, job.reserved_tokens, job.tokens_used())
        self._record(job)

    def _record(self, job: Job) -> None:
        end = time.perf_counter()
        completion_tokens = job.completion_tokens()
        self.metrics.requests.inc(outcome=job.outcome)
        self.metrics.prompt_tokens.inc(job.prompt_tokens())
        self.metrics.generation_tokens.inc(completion_tokens)
        if job.outcome == "ok":
            self.metrics.e2e.observe(end - job.arrival)
        if job.first_token is not None:
            self.metrics.ttft.observe(job.first_token - job.arrival)
            longest = max((len(o.token_ids) for out in job.finals.values() for o in out.outputs), default=0)
            if longest > 1:
                self.metrics.tpot.observe((end - job.first_token) / (longest - 1))
        request_log.info(json.dumps({
            "event": "request", "id": job.response_id, "route": job.kind, "tenant": job.tenant.id,
            "model": job.model, "adapter": job.adapter, "user": job.user, "stream": job.stream,
            "prompts": len(job.prompts), "n": job.params.n, "prompt_tokens": job.prompt_tokens(),
            "completion_tokens": completion_tokens, "outcome": job.outcome,
            "finish_reasons": sorted({o.finish_reason or "none" for out in job.finals.values() for o in out.outputs}),
            "ttft_s": None if job.first_token is None else round(job.first_token - job.arrival, 4),
            "latency_s": round(end - job.arrival, 4)}))
