"""Running the real scheduler and page pool without a model: each step costs what a step-cost function
says (DESIGN §6). Used by tests and by `benchmarks/simulate.py`."""
from collections.abc import Callable
from dataclasses import dataclass, field

from slora.core.scheduler import Scheduler, SchedulerOutput
from slora.core.sequence import AdapterRef, Sequence
from slora.sampling.params import SamplingParams

StepCost = Callable[[SchedulerOutput, Scheduler], float]
StepObserver = Callable[[SchedulerOutput, float], None]      # a step's output and the clock once it ran


@dataclass(frozen=True)
class SimRequest:
    prompt_len: int
    output_len: int
    adapter: AdapterRef | None = None
    arrival: float = 0.0
    tenant: str | None = None
    priority: int = 0


@dataclass
class SimResult:
    elapsed: float = 0.0
    steps: int = 0
    output_tokens: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    finish_times: list[float] = field(default_factory=list)
    first_token_times: dict[int, float] = field(default_factory=dict)    # request index -> clock at its first token
    recomputed_tokens: int = 0
    high_water: dict[int, int] = field(default_factory=dict, repr=False)   # seq_id -> tokens ever computed

    @property
    def mean_batch(self) -> float:
        return sum(self.batch_sizes) / max(1, len(self.batch_sizes))


def simulate(scheduler: Scheduler, requests: list[SimRequest], step_cost: StepCost,
             max_steps: int = 1_000_000, observe: StepObserver | None = None) -> SimResult:
    """Feed `requests` (by arrival time) to `scheduler` until all finish; tokens are dummies (id 0). `observe`
    sees each step's output once it ran, before the sequences advance."""
    pending = sorted(enumerate(requests), key=lambda item: item[1].arrival)
    result, clock, cursor = SimResult(), 0.0, 0
    while (cursor < len(pending) or scheduler.has_unfinished()) and result.steps < max_steps:
        while cursor < len(pending) and pending[cursor][1].arrival <= clock:
            scheduler.add(_sequence(*pending[cursor]))
            cursor += 1
        if not scheduler.has_unfinished():
            clock = pending[cursor][1].arrival
            continue
        out = scheduler.schedule()
        clock += step_cost(out, scheduler)
        if observe is not None:
            observe(out, clock)
        _advance(scheduler, out, result, clock)
    result.elapsed = clock
    return result


def _sequence(index: int, request: SimRequest) -> Sequence:
    params = SamplingParams(max_tokens=request.output_len, temperature=0, ignore_eos=True)
    # Distinct tokens per request, so the prefix cache finds no sharing the trace does not have.
    return Sequence(index, f"sim-{index}", [index] * request.prompt_len, params, request.adapter,
                    tenant=request.tenant, priority=request.priority)


def _advance(scheduler: Scheduler, out: SchedulerOutput, result: SimResult, clock: float) -> None:
    result.steps += 1
    result.batch_sizes.append(len(out.scheduled))
    for seq in out.rejected:
        scheduler.finish(seq, "length")
    for item in out.scheduled:
        seq, completes = item.seq, item.completes
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + item.num_tokens
        # tokens below the sequence's high-water mark were computed before a preemption
        result.recomputed_tokens += max(0, min(end, result.high_water.get(seq.seq_id, 0)) - start)
        result.high_water[seq.seq_id] = max(end, result.high_water.get(seq.seq_id, 0))
        scheduler.on_computed(seq, item.num_tokens)
        if completes:
            seq.output_token_ids.append(0)
            result.output_tokens += 1
            result.first_token_times.setdefault(seq.seq_id, clock)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
                result.finish_times.append(clock)
