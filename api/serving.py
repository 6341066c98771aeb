"""Completions and chat completions: GenerationService, which coordinates each request from body to answer."""
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from slora.api import tool_calls
from slora.api.async_engine import AsyncEngine, EngineInfo, EngineUnavailable
from slora.api.errors import APIError, model_not_found, unavailable
from slora.api.grammars import GrammarCompiles
from slora.api.job_runs import JobRunner
from slora.api.jobs import Job, outcome_of, record
from slora.api.limits import Admission
from slora.api.metrics import ServerMetrics
from slora.api.protocol import ChatCompletionRequest, CompletionRequest, SamplingRequest
from slora.api.request_checks import RequestChecks, check_priority, structured_output
from slora.api.request_params import to_sampling_params
from slora.api.response_models import ChatCompletion, Completion
from slora.api.responses import JobAnswers, TokenTexts
from slora.api.settings import ServerSettings
from slora.api.stream_events import JobEvents
from slora.api.streaming import ClientGone, EventStreamResponse, unless_disconnected
from slora.api.tenants import Tenant
from slora.api.tokenizer_pool import Tokenization
from slora.api.tokenizing import PromptTokenizer

Answer = TypeVar("Answer", Completion, ChatCompletion)
# Loads the adapter a request names when the caller has none of that name (AdapterService.resolve): whether
# it loaded one.
AdapterResolver = Callable[[Tenant, str], Awaitable[bool]]


class GenerationService:
    """Turns a request into a Job (its prompts as tokens, its SamplingParams), admits it, runs its engine
    requests and answers it; each step's rules live in the module named for it."""

    def __init__(self, engine: AsyncEngine, settings: ServerSettings, admission: Admission,
                 metrics: ServerMetrics, tokenization: Tokenization, resolver: AdapterResolver | None = None) -> None:
        self.engine = engine
        self.settings = settings
        self.admission = admission
        self.metrics = metrics
        self.tokenization = tokenization
        self.checks = RequestChecks(settings)
        self.resolver = resolver                 # with --enable-lora-resolver
        self.grammars = GrammarCompiles(settings)
        self.runner = JobRunner(engine, settings.retry_after_s, self.resolved)
        self._token_texts: TokenTexts | None = None

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
        if found is None and not await self.resolved(tenant, adapter):
            raise model_not_found(model)

    async def resolved(self, tenant: Tenant, adapter: str) -> bool:
        return self.resolver is not None and await self.resolver(tenant, adapter)

    # ---- entry points ------------------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, tenant: Tenant, request: Request) -> Completion | Response:
        self.check_request(body, body.num_prompts, body.text_chars, "prompt")
        return await self._serve(request, lambda: self._completion_job(body, tenant), JobAnswers.completion)

    async def chat(self, body: ChatCompletionRequest, tenant: Tenant, request: Request) -> ChatCompletion | Response:
        self.check_request(body, 1, body.text_chars, "messages")
        return await self._serve(request, lambda: self._chat_job(body, tenant), JobAnswers.chat)

    def check_request(self, body: SamplingRequest, num_prompts: int, text_chars: int, prompt_param: str) -> None:
        """The run-time checks of the raw request (RequestChecks), before any tokenizer work is done for it."""
        self.checks.check(body, num_prompts, text_chars, prompt_param, self._info.vocab_size, self._info.tokenizer)
        check_priority(body.priority, self._info.scheduling_policy)

    async def chat_prompt(self, body: ChatCompletionRequest, tenant: Tenant) -> list[int]:
        """The chat request's prompt, as the chat route runs it."""
        return await self._prompts(tenant).chat(body)

    # ---- the job -----------------------------------------------------------------------------------------
    def _prompts(self, tenant: Tenant) -> PromptTokenizer:
        return PromptTokenizer(self.tokenization, self._info.tokenizer, tenant.id)

    async def _completion_job(self, body: CompletionRequest, tenant: Tenant) -> Job:
        prompts_of = self._prompts(tenant)
        # vLLM's default for completions: special tokens added.
        given = await prompts_of.completion(body.prompt, body.add_special_tokens is not False)
        prompts = _truncated(body, given)
        echo_logprobs = bool(body.echo) and body.logprobs is not None
        prompt_logprobs = body.prompt_logprobs
        if echo_logprobs:                    # the engine computes what the answer shows of the prompt
            prompt_logprobs = max(body.logprobs or 0, prompt_logprobs or 0)
        job = self._job("completion", body, tenant, prompts, body.token_limit, "prompt", logprobs=body.logprobs,
                        prompt_logprobs=prompt_logprobs)
        job.echo_logprobs = echo_logprobs
        if body.echo:                        # a truncated prompt is echoed as what is left of it
            job.echo = await prompts_of.echo(body.prompt if prompts == given else prompts, prompts)
        return job

    async def _chat_job(self, body: ChatCompletionRequest, tenant: Tenant) -> Job:
        prompt = await self.chat_prompt(body, tenant)
        prompts = _truncated(body, [prompt])
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

    def _job(self, kind: str, body: SamplingRequest, tenant: Tenant, prompts: list[list[int]],
             max_tokens: int | None, prompt_param: str, logprobs: int | None = None,
             prompt_logprobs: int | None = None) -> Job:
        structured_param, structured = structured_output(body)
        limit = self.checks.max_tokens(prompts, max_tokens, prompt_param, self._info.max_model_len)
        params = to_sampling_params(body, limit, logprobs, prompt_logprobs, structured, structured_param)
        adapter = self.adapter_of(body.model)
        options = body.stream_options
        include_usage = bool(options and options.include_usage)
        shown = self.base_names[0] if adapter is None else body.model      # what the answer says it is
        job = Job(kind, shown, adapter, tenant, prompts, params, bool(body.stream), include_usage,
                  bool(body.return_token_ids), body.user)
        job.continuous_usage = bool(options and options.continuous_usage_stats)
        job.priority = body.priority
        job.logprobs = logprobs
        job.prompt_logprobs = body.prompt_logprobs
        job.tokens_as_ids = bool(body.return_tokens_as_token_ids)
        job.structured_param = structured_param
        job.samples_param = "best_of" if body.best_of is not None else "n"
        job.prompt_param = prompt_param
        job.reserved_tokens = job.token_reservation(max_tokens is not None)
        return job

    # ---- running -------------------------------------------------------------------------------------------
    def _require_ready(self) -> None:
        if not self.engine.accepting:
            raise unavailable(f"the server is {self.engine.state.value}; retry later", self.settings.retry_after_s)

    async def _serve(self, request: Request, prepare: Callable[[], Awaitable[Job]],
                     answer: Callable[[JobAnswers], Answer]) -> Answer | Response:
        """Tokenize (`prepare`), admit and submit a job, then answer it. A client that goes away while any of
        that waits is noticed there too, and its work is cancelled where it is (in the tokenizer queue or
        between two prompts, in admission, or while its engine requests are added)."""
        try:
            job = await unless_disconnected(request.receive, self._admitted(prepare))
        except ClientGone:
            return Response(status_code=499)      # nobody reads it
        return await self._answer(job, request, answer)

    async def _admitted(self, prepare: Callable[[], Awaitable[Job]]) -> Job:
        job = await prepare()
        self._require_ready()
        if job.params.structured is not None:       # compiled before admission: waiting holds no seat, no page
            job.grammar = await self.grammars.compile(self._info, job.tenant.id, job.params.structured,
                                                      job.structured_param)
        self.admission.charge_tokens(job.tenant, job.reserved_tokens)
        try:
            await self.admission.acquire(job.tenant, job.seats)
        except BaseException:
            self.admission.settle_tokens(job.tenant, job.reserved_tokens, 0)   # never admitted: it used nothing
            raise
        try:
            await self.runner.submit(job)
        except BaseException as exc:
            job.outcome = outcome_of(exc)
            self._close(job)
            raise
        return job

    def close(self) -> None:
        self.grammars.close()

    async def _answer(self, job: Job, request: Request, answer: Callable[[JobAnswers], Answer]) -> Answer | Response:
        answers = JobAnswers(job, self.token_texts)
        if job.stream:
            events = JobEvents(job, answers, lambda: self.runner.outputs(job))
            return EventStreamResponse(events.events(), lambda gone: self._on_stream_closed(job, gone))
        try:
            await unless_disconnected(request.receive, self.runner.collect(job))
        except ClientGone:
            job.outcome = "disconnected"
            return Response(status_code=499)      # nobody reads it; the request is already aborted below
        except APIError:
            job.outcome = "error"
            raise
        finally:
            self._close(job)
        return answer(answers)

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
        self.runner.abort_unfinished(job)
        self.admission.release(job.tenant, job.seats)
        self.admission.settle_tokens(job.tenant, job.reserved_tokens, job.tokens_used())
        record(job, self.metrics)


def _truncated(body: SamplingRequest, prompts: list[list[int]]) -> list[list[int]]:
    keep = body.truncate_prompt_tokens
    return prompts if keep is None else [p[-keep:] for p in prompts]

