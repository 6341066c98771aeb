"""The scheduler and page pool on random workloads, drawn by Hypothesis, without a model: prompts that share
prefixes on a few adapters, in pools small enough that KV, cached pages and adapters evict each other, with
samples forked after their prompt (copy-on-write), preemption by recompute and by swap, max_loras, aborts and
adapters unloaded mid-run, under each scheduling policy, with requests of a few tenants (of unequal weights)
and priorities. After every step the pool's invariants hold (Scheduler.check), and in the end
every request has ended with no KV page held."""
import random

import pytest

pytest.importorskip("hypothesis", reason="hypothesis is not installed (the GPU machine's case): pip install hypothesis")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from slora.core.page_pool import PageAllocator  # noqa: E402
from slora.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput  # noqa: E402
from slora.core.sequence import AdapterRef, Sequence, SequenceStatus  # noqa: E402
from slora.sampling.params import SamplingParams  # noqa: E402

VOCAB = 50                    # few token ids: outputs repeat, so decode pages get matched too
MAX_STEPS = 3000
ABORT_CHANCE, UNLOAD_CHANCE = 0.03, 0.02      # per step

configs = st.builds(
    SchedulerConfig, page_size=st.sampled_from([4, 8, 16]), watermark=st.sampled_from([0.0, 0.01, 0.1]),
    max_num_seqs=st.sampled_from([2, 4, 16]), max_num_batched_tokens=st.sampled_from([8, 16, 64, 512]),
    preemption_mode=st.sampled_from(["recompute", "swap"]), swap_pages=st.sampled_from([0, 4, 64]),
    enable_prefix_caching=st.booleans(), max_loras=st.sampled_from([None, 1, 2, 3]),
    scheduling_policy=st.sampled_from(["fcfs", "priority", "vtc"]))
token_lists = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[Scheduler, list[tuple[int, Sequence]]]:
    """A scheduler over its own pool, and the sequences that fit it with the step each arrives at."""
    config = draw(configs)
    scheduler = Scheduler(config, PageAllocator(draw(st.sampled_from([24, 32, 48, 96])), config.page_size))
    scheduler.set_weight("heavy", draw(st.sampled_from([1.0, 3.0])))
    adapters = [AdapterRef(f"v{i}", draw(st.integers(1, 8))) for i in range(draw(st.integers(1, 5)))]
    shared = draw(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=48))
    arrivals = []
    for i in range(draw(st.integers(2, 30))):
        prompt = shared[:draw(st.integers(0, len(shared)))] + draw(token_lists)
        adapter = draw(st.sampled_from([None, *adapters]))
        samples = draw(st.integers(1, min(3, config.max_num_seqs)))
        params = SamplingParams(max_tokens=draw(st.integers(1, 24)), temperature=1.0, seed=1, n=samples,
                                ignore_eos=True)
        tenant = draw(st.sampled_from([None, "heavy", "light"]))
        priority = 0 if config.scheduling_policy == "fcfs" else draw(st.integers(0, 2))
        if _fits(scheduler, len(prompt), adapter):
            arrivals.append((draw(st.integers(0, 20)), Sequence(i + 1, f"r{i}", prompt, params, adapter,
                                                                tenant=tenant, priority=priority)))
    return scheduler, arrivals


def _fits(scheduler: Scheduler, prompt_len: int, adapter: AdapterRef | None) -> bool:
    try:
        scheduler.check_fits(prompt_len, adapter)
    except ValueError:
        return False
    return True


def disturb(scheduler: Scheduler, live: list[Sequence], rng: random.Random) -> None:
    """Before a step, now and then: a request aborted, an adapter version unloaded (freed once idle)."""
    running = [seq for seq in live if seq.status is not SequenceStatus.FINISHED]
    if running and rng.random() < ABORT_CHANCE:
        scheduler.finish(rng.choice(running), "abort")
    versions = sorted({seq.adapter.version for seq in live if seq.adapter is not None})
    if versions and rng.random() < UNLOAD_CHANCE:
        scheduler.adapters.retire(rng.choice(versions))


def forked(scheduler: Scheduler, parent: Sequence) -> list[Sequence]:
    """The other samples of a request, forked from its first as its prompt completes (as the engine does)."""
    if parent.params.n == 1 or parent.sample_index != 0 or parent.output_token_ids:
        return []
    children = [Sequence(1000 + 10 * parent.seq_id + i, parent.request_id, list(parent.prompt_token_ids),
                         parent.params, parent.adapter, sample_index=i, tenant=parent.tenant,
                         priority=parent.priority) for i in range(1, parent.params.n)]
    for child in children:
        scheduler.fork(parent, child)
    return children


def compute(scheduler: Scheduler, out: SchedulerOutput, rng: random.Random) -> list[Sequence]:
    """What the engine does with a step: its tokens computed, a token sampled where a row completes (for
    each sample of a request whose prompt just completed); the samples forked."""
    children = []
    for seq in out.rejected:
        scheduler.finish(seq, "length")
    for item in out.scheduled:
        completes = item.completes
        scheduler.on_computed(item.seq, item.num_tokens)
        if not completes:
            continue
        family = [item.seq, *forked(scheduler, item.seq)]
        children += family[1:]
        for seq in family:
            seq.output_token_ids.append(rng.randrange(VOCAB))
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                scheduler.finish(seq, "length")
    return children


@settings(max_examples=400, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(workload=workloads(), rng=st.randoms(use_true_random=False))
def test_random_workloads_keep_the_pool_whole_and_end(workload, rng: random.Random):  # noqa: ANN001
    scheduler, arrivals = workload
    live: list[Sequence] = []
    for step in range(MAX_STEPS):
        arriving = [seq for at, seq in arrivals if at == step]
        for seq in arriving:
            scheduler.add(seq)
        live += arriving
        if step > 20 and not scheduler.has_unfinished():
            break
        disturb(scheduler, live, rng)
        live += compute(scheduler, scheduler.schedule(), rng)
        scheduler.check()
    assert not scheduler.has_unfinished(), f"requests still unfinished after {MAX_STEPS} steps"
    assert scheduler.allocator.stats().kv_pages == 0, "KV pages held after every request ended"
