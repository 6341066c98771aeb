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


# Bounds (seconds) of the adapter load histogram; the engine buckets its load times by them.
ADAPTER_LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(frozen=True)
class DurationCounts:
    """A histogram of durations as the engine keeps it: `counts[i]` of those <= `bounds[i]` and above the bound
    before (not cumulative), the last count for those above every bound; `total` their sum in seconds."""

    bounds: tuple[float, ...] = ADAPTER_LOAD_BUCKETS
    counts: tuple[int, ...] = (0,) * (len(ADAPTER_LOAD_BUCKETS) + 1)
    total: float = 0.0


class AdapterName(NamedTuple):
    """One registry name of an adapter version."""

    name: str
    owner: str | None                  # its namespace (the tenant); None: un-owned (single-user, demo adapters)
    public: bool


@dataclass(frozen=True)
class AdapterPlacement:
    """Where one adapter version is, for the router series of /metrics: in the pool (pinned while running
    sequences use it), in host memory, neither (on disk), with the names that point at it and the namespaces
    that may be told its residency (those that loaded it first or ran it: another tenant's use of the same
    weights is not told)."""

    in_pool: bool
    on_host: bool
    pinned: bool
    names: tuple[AdapterName, ...]
    used_by: frozenset[str | None]


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
    taken_at: float = 0.0            # time.time() when it was taken
    # The adapters the router series name: versions in the pool or in host memory, and those of the running and
    # waiting sequences (bounded by them, never every registered name); (tenant, version) of each sequence.
    adapter_placements: dict[str, AdapterPlacement] = field(default_factory=dict)
    running_adapters: frozenset[tuple[str | None, str]] = frozenset()
    waiting_adapters: frozenset[tuple[str | None, str]] = frozenset()
    adapter_slots: int = 0           # distinct adapters one batch may run: max_loras, else max_num_seqs
    pinned_adapter_pages: int = 0    # pool pages of adapters that running sequences use (nothing reclaims them)
    adapter_load_seconds: DurationCounts = field(default_factory=DurationCounts)   # versions into host memory
    # A cluster's ingress: its replicas' latest snapshots by replica id, their adapters under the cluster's names
    # (an engine's own is empty).
    replicas: dict[str, "EngineSnapshot"] = field(default_factory=dict)
