"""A job's engine requests: added one per prompt, their outputs gathered as they come, aborted if it ends early."""
import asyncio
import contextlib
import logging
import re
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from slora.api.async_engine import AsyncEngine, EngineUnavailable, RequestStream
from slora.api.errors import APIError, bad_request, model_not_found, unavailable
from slora.api.jobs import Job
from slora.api.request_params import param_named, without_class_name
from slora.api.tenants import Tenant
from slora.core.outputs import ADAPTER_UNAVAILABLE, GRAMMAR_TOO_SLOW, RequestError, RequestOutput
from slora.execution.adapter_manager import UnknownAdapterError

logger = logging.getLogger(__name__)
# Words of an engine refusal (ValueError from add_request) of the request's structured output, not its prompt.
_STRUCTURE_WORDS = re.compile(r"schema|regex|regular expression|grammar|json|choice|structured", re.IGNORECASE)
# Words of an engine refusal of the request's sequences per prompt (a beam width, n or best_of), not its prompt.
_SAMPLES_WORDS = re.compile(r"max_beam_width|max_num_seqs")
# Whether the adapter resolver loaded an adapter of that name for the tenant (GenerationService.resolved).
Resolved = Callable[[Tenant, str], Awaitable[bool]]


class JobRunner:
    """Runs jobs on the engine. An engine request that fails fails its job with the APIError the client is told."""

    def __init__(self, engine: AsyncEngine, retry_after_s: int, resolved: Resolved) -> None:
        self.engine = engine
        self.retry_after_s = retry_after_s
        self.resolved = resolved

    async def submit(self, job: Job) -> None:
        for index, prompt in enumerate(job.prompts):
            try:
                stream = await self._generate(job, index, prompt)
            except UnknownAdapterError:
                raise model_not_found(job.model) from None
            except EngineUnavailable:
                raise unavailable("the server is not serving now; retry later", self.retry_after_s) from None
            except ValueError as exc:
                raise bad_request(without_class_name(exc), param=_refused_param(job, exc)) from None
            job.streams.append(stream)

    async def _generate(self, job: Job, index: int, prompt: list[int]) -> RequestStream:
        """One engine request of the job; an adapter the caller lacks is loaded by the resolver, then tried again."""
        try:
            return await self.engine.generate(job.request_id(index), prompt, job.params, job.adapter,
                                              job.tenant.namespace, job.grammar, job.priority)
        except UnknownAdapterError:
            if job.adapter is None or not await self.resolved(job.tenant, job.adapter):
                raise
        return await self.engine.generate(job.request_id(index), prompt, job.params, job.adapter, job.tenant.namespace,
                                          job.grammar, job.priority)

    async def outputs(self, job: Job) -> AsyncGenerator[tuple[int, RequestOutput], None]:
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

    async def collect(self, job: Job) -> None:
        try:
            async with contextlib.aclosing(self.outputs(job)) as outputs:
                async for _ in outputs:
                    pass
        except EngineUnavailable:
            raise unavailable("the engine stopped while generating; retry later", self.retry_after_s) \
                from None
        if job.aborted():
            raise unavailable("the server is shutting down; retry later", self.retry_after_s)


    def abort_unfinished(self, job: Job) -> None:
        """Abort the job's engine requests that still run (a client that left frees their pages at once)."""
        for index, stream in enumerate(job.streams):
            if index not in job.finals:
                self.engine.abort(stream.request_id)


def _refused_param(job: Job, exc: ValueError) -> str:
    """The field an engine refusal of the job is about: n or best_of when it has too many sequences per prompt,
    its structured output when the message speaks of one (the engine could not compile it), else the field
    SamplingParams names, else the prompt."""
    if _SAMPLES_WORDS.search(str(exc)):
        return job.samples_param
    if job.structured_param is not None and _STRUCTURE_WORDS.search(str(exc)):
        return job.structured_param
    return param_named(exc) or job.prompt_param
