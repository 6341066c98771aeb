"""One HTTP generation request while it runs (a Job), and what is recorded of it at its end."""
import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from slora.api import tool_calls
from slora.api.async_engine import RequestStream
from slora.api.errors import APIError
from slora.api.metrics import ServerMetrics
from slora.api.response_models import new_id, now
from slora.api.tenants import Tenant
from slora.core.outputs import RequestOutput
from slora.sampling.params import SamplingParams

if TYPE_CHECKING:
    from slora.sampling.grammar import CompiledGrammar

# Tokens per sample reserved against a tenant's token rate when a request gives no max_tokens (then settled).
_UNSPECIFIED_RESERVE = 256
request_log = logging.getLogger("slora.api.requests")


def outcome_of(exc: BaseException) -> str:
    """The metrics outcome of a job that failed before it was answered."""
    if isinstance(exc, APIError):
        return "rejected"
    return "disconnected" if isinstance(exc, asyncio.CancelledError) else "error"


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
    priority: int = 0                          # among the tenant's own requests, lower is admitted first
    response_id: str = ""
    created: int = field(default_factory=now)
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
    samples_param: str = "n"                   # the field that gave the sequences per prompt (n or best_of)
    grammar: "CompiledGrammar | None" = None   # that structured output, compiled
    prompt_param: str = "prompt"
    sent_tokens: dict[tuple[int, int], int] = field(default_factory=dict)   # streamed tokens per choice
    tool_parser: tool_calls.ToolParser | None = None   # chat: how calls are read out of the answer (None: not)
    legacy_functions: bool = False             # chat: the request used `functions`; calls in function_call too

    def __post_init__(self) -> None:
        prefix = "chatcmpl" if self.kind == "chat" else "cmpl"
        self.response_id = self.response_id or new_id(prefix)

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

    @property
    def seats(self) -> int:
        """Sequences it holds in the engine's batch (prompts × samples that run), counted against its tenant's
        max_concurrent: one request of 16 prompts with n=4 takes as much of the batch as 64 of one."""
        return len(self.prompts) * self.params.num_samples

    def token_reservation(self, max_tokens_given: bool) -> int:
        """Tokens charged to the tenant's rate at admission: the prompt, and max_tokens for every sample of every
        prompt. Without an explicit max_tokens (chat's default is the rest of the context) at most
        _UNSPECIFIED_RESERVE per sample is reserved; the difference to what ran is settled at the end."""
        per_sample = self.params.max_tokens if max_tokens_given else min(self.params.max_tokens, _UNSPECIFIED_RESERVE)
        return self.prompt_tokens() + self.seats * per_sample

    def tokens_used(self) -> int:
        """What the tenant's token rate is finally charged: nothing for a request refused before it ran."""
        return 0 if self.outcome == "rejected" else self.prompt_tokens() + self.completion_tokens()

    def cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache."""
        return sum(out.num_cached_tokens for out in self.finals.values())

    def aborted(self) -> bool:
        """Whether the engine aborted any of its samples (the server is shutting down)."""
        return any(o.finish_reason == "abort" for out in self.finals.values() for o in out.outputs)


def record(job: Job, metrics: ServerMetrics) -> None:
    """The job's metrics and its line in the request log."""
    end = time.perf_counter()
    completion_tokens = job.completion_tokens()
    metrics.requests.labels(outcome=job.outcome).inc()
    metrics.prompt_tokens.inc(job.prompt_tokens())
    metrics.generation_tokens.inc(completion_tokens)
    if job.outcome == "ok":
        metrics.e2e.observe(end - job.arrival)
    if job.first_token is not None:
        metrics.ttft.observe(job.first_token - job.arrival)
        longest = max((len(o.token_ids) for out in job.finals.values() for o in out.outputs), default=0)
        if longest > 1:
            metrics.tpot.observe((end - job.first_token) / (longest - 1))
    request_log.info(json.dumps({
        "event": "request", "id": job.response_id, "route": job.kind, "tenant": job.tenant.id,
        "model": job.model, "adapter": job.adapter, "user": job.user, "stream": job.stream,
        "prompts": len(job.prompts), "n": job.params.n, "prompt_tokens": job.prompt_tokens(),
        "completion_tokens": completion_tokens, "outcome": job.outcome,
        "finish_reasons": sorted({o.finish_reason or "none" for out in job.finals.values() for o in out.outputs}),
        "ttft_s": None if job.first_token is None else round(job.first_token - job.arrival, 4),
        "latency_s": round(end - job.arrival, 4)}))
