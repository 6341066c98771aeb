"""Wall time of the engine's steps by kind, for profiling where end-to-end time goes.

A step's time runs from its forward's launch to its sampled tokens on the host: the copy to the host
waits for the step's GPU work, so the time includes it (and any Triton compilation the step caused).
Under overlapped scheduling a step starts before the one before it ends; each is charged from that end."""
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from slora.core.scheduler import ScheduledSeq

STEP_KINDS = ("prefill", "decode", "mixed")


def step_kind(scheduled: list[ScheduledSeq]) -> str:
    """decode: one token per sequence (the CUDA-graph path); prefill: no such row; mixed: both."""
    single = sum(1 for item in scheduled if item.num_tokens == 1)
    if single == len(scheduled):
        return "decode"
    return "prefill" if single == 0 else "mixed"


@dataclass(frozen=True)
class DecodeBytes:
    """The bytes a decode step must read, the numerator of its roofline (the kernels issue's definition):
    every weight once (of the input embedding table only the batch's rows), the KV of every live token,
    and each distinct adapter of the step once."""

    weight_bytes: int                       # every weight but the untied input embedding table
    embedding_row_bytes: int                # one row of the input embedding table
    kv_bytes_per_token: int
    adapter_bytes: Callable[[str], int]     # by adapter version

    def of(self, scheduled: list[ScheduledSeq], versions: Iterable[str]) -> int:
        """Bytes of a decode step over `scheduled`, whose distinct adapter versions are `versions`."""
        context = sum(item.seq.num_computed_tokens + item.num_tokens for item in scheduled)
        return (self.weight_bytes + len(scheduled) * self.embedding_row_bytes + context * self.kv_bytes_per_token
                + sum(map(self.adapter_bytes, versions)))


@dataclass
class StepStats:
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    slowest_seconds: float = 0.0
    slowest_kind: str | None = None
    decode_bytes: int = 0                  # bytes the decode steps had to read (DecodeBytes)

    @property
    def decode_bandwidth(self) -> float | None:
        """Bytes per second the decode steps achieved against what they had to read."""
        return self.decode_bytes / self.seconds["decode"] if self.seconds["decode"] > 0 else None

    def record(self, kind: str, scheduled: list[ScheduledSeq], seconds: float, decode_bytes: int = 0) -> None:
        self.decode_bytes += decode_bytes
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        self.tokens[kind] += sum(item.num_tokens for item in scheduled)
        if seconds > self.slowest_seconds:
            self.slowest_seconds, self.slowest_kind = seconds, kind

    def as_dict(self) -> dict[str, object]:
        return {"steps": dict(self.steps), "seconds": dict(self.seconds), "tokens": dict(self.tokens),
                "slowest_seconds": self.slowest_seconds, "slowest_kind": self.slowest_kind,
                "decode_bytes": self.decode_bytes, "decode_bandwidth_bytes_per_s": self.decode_bandwidth}


class StepTimer:
    """Started as a step's forward is launched; `stop` once its sampled tokens are on the host."""

    def __init__(self, stats: StepStats, scheduled: list[ScheduledSeq], versions: Iterable[str],
                 decode_bytes: DecodeBytes) -> None:
        self.stats, self.scheduled = stats, scheduled
        self.kind = step_kind(scheduled)
        # Now, before the step: its forward moves the sequences' computed-token counts.
        self.bytes = decode_bytes.of(scheduled, versions) if self.kind == "decode" else 0

        self.start = time.perf_counter()

    def stop(self, since: float = 0.0) -> float:
        """Record the step's time from its start, or from `since` (when the step before ended) if that is
        later: overlapped steps are each charged the time they added. Returns the time now."""
        now = time.perf_counter()
        self.stats.record(self.kind, self.scheduled, now - max(self.start, since), self.bytes)
        return now
