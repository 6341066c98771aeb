"""What `LLM.generate` and `Engine.step` return."""
from dataclasses import dataclass, field
from typing import NamedTuple

from slora.core.fair_share import TenantShare


class TokenLogprob(NamedTuple):
    """One position's token: its logprob (of the raw logits), its rank in the vocabulary (1 = the most
    likely), and the `k` most likely tokens there as (token_id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None          # "stop" | "length" | "abort" | "error" | None while running
    logprobs: list[TokenLogprob] | None = None   # one per token, with SamplingParams.logprobs
    cumulative_logprob: float = 0.0    # sum of its tokens' logprobs (best_of ranks samples by it)


ADAPTER_UNAVAILABLE = "adapter_unavailable"
INTERNAL_ERROR = "internal_error"
GRAMMAR_TOO_SLOW = "grammar_too_slow"


@dataclass(frozen=True)
class RequestError:
    """Why the engine failed one request (finish_reason "error"); the other requests are unaffected.
    `code` is "adapter_unavailable" (its adapter's files changed or vanished: the client's to fix),
    "grammar_too_slow" (its structured output's grammar went over the per-token budget: the client's to fix) or
    "internal_error" (a fault inside the engine while handling this request alone)."""

    code: str
    message: str

    def __post_init__(self) -> None:
        assert self.code in (ADAPTER_UNAVAILABLE, INTERNAL_ERROR, GRAMMAR_TOO_SLOW), \
            f"unknown request error code {self.code!r}"


@dataclass
class RequestOutput:
    """One request. `token_ids`, `text` and `finish_reason` are those of its first sample; all samples
    (n > 1) are in `outputs`."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    error: RequestError | None = None  # set when the engine failed this request: its unfinished samples
                                       # end with "error" (one that had already ended keeps its reason)
    # With SamplingParams.prompt_logprobs: one per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters of the engine at one moment (the server publishes one per step, so /metrics never waits)."""

    pool: dict[str, int]
    sequences_running: int
    sequences_waiting: int
    requests: int
    preemptions: int
    adapter_pool_loads: int
    adapter_pool_evictions: int
    adapters_registered: int
    adapters_host: int
    adapters_pool: int
    steps: dict[str, int]            # engine steps by kind (prefill, decode, mixed)
    step_seconds: dict[str, float]   # their wall time
    decode_bytes: int                # bytes the decode steps had to read (weights, live KV, adapters)
    tenants: dict[str | None, TenantShare] = field(default_factory=dict)   # service per tenant (None: no tenant)
