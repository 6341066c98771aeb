"""Wall time of the engine's steps by kind, for profiling where end-to-end time goes.

A step's time runs from scheduling to the sampled tokens on the host: the sampler's copy to the host
waits for the step's GPU work, so the time includes it (and any Triton compilation the step caused)."""
import time
from dataclasses import dataclass, field

from slora.scheduler import ScheduledSeq

STEP_KINDS = ("prefill", "decode", "mixed")


def step_kind(scheduled: list[ScheduledSeq]) -> str:
    """decode: one token per sequence (the CUDA-graph path); prefill: no such row; mixed: both."""
    single = sum(1 for item in scheduled if item.num_tokens == 1)
    if single == len(scheduled):
        return "decode"
    return "prefill" if single == 0 else "mixed"


@dataclass
class StepStats:
    steps: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0.0))
    tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STEP_KINDS, 0))
    slowest_seconds: float = 0.0
    slowest_kind: str | None = None

    def record(self, scheduled: list[ScheduledSeq], seconds: float) -> None:
        kind = step_kind(scheduled)
        self.steps[kind] += 1
        self.seconds[kind] += seconds
        self.tokens[kind] += sum(item.num_tokens for item in scheduled)
        if seconds > self.slowest_seconds:
            self.slowest_seconds, self.slowest_kind = seconds, kind

    def as_dict(self) -> dict[str, object]:
        return {"steps": dict(self.steps), "seconds": dict(self.seconds), "tokens": dict(self.tokens),
                "slowest_seconds": self.slowest_seconds, "slowest_kind": self.slowest_kind}


class StepTimer:
    """`with timer.time(scheduled):` around a step's forward and sampling."""

    def __init__(self, stats: StepStats, scheduled: list[ScheduledSeq]) -> None:
        self.stats, self.scheduled = stats, scheduled

    def __enter__(self) -> "StepTimer":
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stats.record(self.scheduled, time.perf_counter() - self.start)
