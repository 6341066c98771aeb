"""Completions and chat completions: validation, tokenization, admission, engine requests, and the answer
as one JSON object or as server-sent events."""
import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from slora.api import protocol
from slora.api.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from slora.api.errors import APIError, bad_request, internal_error, model_not_found, unavailable
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from slora.api.settings import ServerSettings
from slora.api.streaming import ClientGone, EventStreamResponse, unless_disconnected
from slora.api.tenants import Tenant
from slora.engine import UnknownAdapterError
from slora.outputs import RequestOutput
from slora.sampling_params import SamplingParams

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

    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def token_reservation(self, max_tokens_given: bool) -> int:
        """Tokens charged to the tenant's rate at admission: the prompt, and max_tokens for every sample of every
        prompt. Without an explicit max_tokens (chat's default is the rest of the context) at most
        _UNSPECIFIED_RESERVE per sample is reserved; the difference to what ran is settled at the end."""
        per_sample = self.params.max_tokens if max_tokens_given else min(self.params.max_tokens, _UNSPECIFIED_RESERVE)
        return self.prompt_tokens() + len(self.prompts) * self.params.n * per_sample

    def tokens_used(self) -> int:
        """What the tenant's token rate is finally charged: nothing for a request refused before it ran."""
        return 0 if self.outcome == "rejected" else self.prompt_tokens() + self.completion_tokens()

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return sum(out.num_cached_tokens for out in self.finals.values())


class Tokenization:
    """Tokenizer work on one dedicated thread: it keeps the event loop free and never uses the API's
    tokenizer copy from two threads at once."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slora-tokenize")

    async def run(self, fn: Callable[[], T]) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Text -> ids exactly as the offline `LLM.encode` does, so both give the same tokens."""
    return list(tokenizer.encode(text))


def render_chat(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    template = tokenizer.chat_template or DEFAULT_CHAT_TEMPLATE
    text = tokenizer.apply_chat_template(messages, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


class GenerationService:
    def __init__(self, engine: AsyncEngine, settings: ServerSettings, admission: Admission,
                 metrics: ServerMetrics, tokenization: Tokenization) -> None:
        self.engine = engine
        self.settings = settings
        self.admission = admission
        self.metrics = metrics
        self.tokenization = tokenization

    # ---- entry points ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, tenant: Tenant, request: Request) -> Response:
        self._check_common(body)
        prompts = await self._completion_prompts(body.prompt)
        job = self._job("completion", body, tenant, prompts, body.max_tokens, "prompt")
        return await self._run(job, request)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, request: Request) -> Response:
        self._check_common(body)
        prompt = await self._chat_prompt(body)
        job = self._job("chat", body, tenant, [prompt], body.token_limit, "messages")
        return await self._run(job, request)

    # ---- validation --------------------------------------------------------------------------------------
    def _check_common(self, body: SamplingRequest) -> None:
        unsupported = body.unsupported()
        if unsupported is not None:
            raise bad_request(unsupported[1], param=unsupported[0])
        if not 1 <= body.n <= self.settings.max_n:
            raise bad_request(f"n must be between 1 and {self.settings.max_n}", param="n")
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > self.settings.max_stop_sequences:
            raise bad_request(f"at most {self.settings.max_stop_sequences} stop sequences are allowed", param="stop")
        if any(not s or len(s) > self.settings.max_stop_length for s in stops):
            raise bad_request(f"stop sequences must be 1 to {self.settings.max_stop_length} characters",
                              param="stop")

    def _tokenizer(self, what: str) -> Any:
        tokenizer = self.engine.info.tokenizer
        if tokenizer is None:
            raise bad_request(f"this model has no tokenizer: {what} needs one; give prompts as token ids",
                              param="prompt" if what == "text prompts" else "messages")
        return tokenizer

    async def _completion_prompts(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if not prompt:
            raise bad_request("prompt must not be empty", param="prompt")
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], list):
            return [list(p) for p in prompt]
        tokenizer = self._tokenizer("text prompts")
        return await self.tokenization.run(lambda: [encode_text(tokenizer, p) for p in prompt])

    async def _chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self._tokenizer("chat")
        messages = [{"role": "system" if m.role == "developer" else m.role, "content": m.text(),
                     **({"name": m.name} if m.name else {})} for m in body.messages]
        try:
            return await self.tokenization.run(lambda: render_chat(tokenizer, messages, body.add_generation_prompt))
        except (ValueError, TypeError, KeyError) as exc:
            raise bad_request(f"the chat template could not render these messages: {exc}", param="messages") \
                from None
        except Exception as exc:       # jinja2 template errors (raise_exception in the template) are user errors
            if type(exc).__module__.startswith("jinja2"):
                raise bad_request(f"the chat template refused these messages: {exc}", param="messages") from None
            raise

    def _job(self, kind: str, body: SamplingRequest, tenant: Tenant, prompts: list[list[int]],
             max_tokens: int | None, prompt_param: str) -> Job:
        if len(prompts) * body.n > self.settings.max_choices:
            raise bad_request(f"prompts x n must be at most {self.settings.max_choices}", param="n")
        params = self._params(body, prompts, max_tokens, prompt_param)
        adapter = None if body.model == self.engine.info.model_name else body.model
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream_options is not None and not body.stream:
            raise bad_request("stream_options is only allowed with stream=true", param="stream_options")
        job = Job(kind, body.model, adapter, tenant, prompts, params, body.stream, include_usage,
                  body.return_token_ids, body.user)
        job.reserved_tokens = job.token_reservation(max_tokens is not None)
        return job

    def _params(self, body: SamplingRequest, prompts: list[list[int]], max_tokens: int | None,
                prompt_param: str) -> SamplingParams:
        context = self.engine.info.max_model_len
        longest = max(len(p) for p in prompts)
        if longest == 0:
            raise bad_request("the prompt is empty", param=prompt_param)
        if longest >= context:
            raise bad_request(f"This model's maximum context length is {context} tokens, but the prompt has "
                              f"{longest} tokens (at least one token must be generated).", param=prompt_param,
                              code="context_length_exceeded")
        if max_tokens is None:
            max_tokens = context - longest
        limit = self.settings.max_tokens_limit or context
        if max_tokens < 1 or max_tokens > limit:
            raise bad_request(f"max_tokens must be between 1 and {limit}", param="max_tokens")
        if longest + max_tokens > context:
            raise bad_request(f"This model's maximum context length is {context} tokens. However, you requested "
                              f"{longest + max_tokens} tokens ({longest} in the prompt, {max_tokens} for the "
                              "completion).", param="max_tokens", code="context_length_exceeded")
        try:
            return SamplingParams(
                max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p, top_k=0 if body.top_k is None else body.top_k,
                seed=body.seed, stop=body.stop or [], stop_token_ids=body.stop_token_ids or [], n=body.n,
                ignore_eos=body.ignore_eos)
        except ValueError as exc:
            found = _PARAM_IN_MESSAGE.search(str(exc))
            message = str(exc).replace("SamplingParams.", "")
            raise bad_request(message, param=found.group(1) if found else None) from None

    # ---- running -------------------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if not self.engine.accepting:
            raise unavailable(f"the server is {self.engine.state.value}; retry later", self.settings.retry_after_s)

    async def _run(self, job: Job, request: Request) -> Response:
        self._require_ready()
        self.admission.charge_tokens(job.tenant, job.reserved_tokens)
        try:
            await self.admission.acquire(job.tenant)
        except BaseException:
            self.admission.settle_tokens(job.tenant, job.reserved_tokens, 0)   # never admitted: it used nothing
            raise
        try:
            await self._submit(job)
        except BaseException as exc:
            job.outcome = "rejected" if isinstance(exc, APIError) else "error"
            self._close(job)
            raise
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
                stream = await self.engine.generate(job.request_id(index), prompt, job.params, job.adapter,
                                                    job.tenant.namespace)
            except UnknownAdapterError:
                raise model_not_found(job.model) from None
            except EngineUnavailable:
                raise unavailable("the server is not serving now; retry later", self.settings.retry_after_s) \
                    from None
            except ValueError as exc:
                raise bad_request(str(exc), param="messages" if job.kind == "chat" else "prompt") from None
            job.streams.append(stream)

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
        if job.first_token is None and any(o.token_ids for o in output.outputs):
            job.first_token = time.perf_counter()
        if output.finished:
            job.finals[index] = output
        return output

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
        build = protocol.chat_choice if job.kind == "chat" else protocol.completion_choice
        choices = []
        for index in range(len(job.prompts)):
            out = job.finals[index]
            for sample in out.outputs:
                extra = (sample.token_ids, out.prompt_token_ids) if job.return_token_ids else (None, None)
                choices.append(build(job.choice_index(index, sample.index), sample.text, sample.finish_reason,
                                     *extra))
        return protocol.response_object(job.object_name, job.response_id, job.created, job.model, choices,
                                        self._usage(job))

    @staticmethod
    def _usage(job: "Job") -> dict:
        return protocol.usage(job.prompt_tokens(), job.completion_tokens(), job.cached_tokens())

    # ---- streaming -----------------------------------------------------------------------------------------
    async def _events(self, job: Job) -> AsyncGenerator[str, None]:
        progress: dict[int, ChoiceProgress] = {}
        try:
            if job.kind == "chat":
                for choice in range(len(job.prompts) * job.params.n):
                    yield self._chunk(job, [protocol.chat_delta_choice(choice, {"role": "assistant", "content": ""},
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
            text, tokens, finished = state.advance(sample.text, sample.token_ids, sample.finish_reason,
                                                   job.params.stop)
            if not text and not tokens and not finished:
                continue
            token_ids = tokens if job.return_token_ids else None
            reason = sample.finish_reason if finished else None
            if job.kind == "chat":
                delta = {"content": text} if text or not finished else {}
                choice_obj = protocol.chat_delta_choice(choice, delta, reason, token_ids)
            else:
                choice_obj = protocol.completion_choice(choice, text, reason, token_ids)
            events.append(self._chunk(job, [choice_obj]))
        return events

    @staticmethod
    def _chunk(job: Job, choices: list[dict[str, Any]]) -> str:
        return sse(protocol.response_object(job.chunk_name, job.response_id, job.created, job.model, choices,
                                            None, include_usage_key=job.include_usage))

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
