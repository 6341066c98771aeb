"""Fair share between tenants (virtual token counters) in the scheduler alone, driven by the simulator.

The service each tenant gets is counted here from what the steps scheduled, not read from the scheduler's
counters: prompt tokens computed cost W_P each, generated tokens W_Q, an adapter brought into the pool its
pages' tokens at W_P; a tenant's service is that divided by its weight. VTC's bound (Sheng et al., OSDI 2024,
Theorem 4.4): while two tenants both wait, their services differ by at most 2 * max(W_P * L_in, W_Q * M),
L_in the longest prompt charged at once (and, here, an adapter's pages with it), M the tokens a running batch
holds.
"""
import random
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pytest

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from slora.core.sequence import AdapterRef, Sequence
from slora.core.simulator import SimRequest, simulate
from slora.sampling.params import SamplingParams

if TYPE_CHECKING:
    from slora.engine import Engine

W_P, W_Q = 1.0, 2.0
PAGE = 16
POOL_PAGES = 200                 # room for a full batch of the longest sequences: no preemption blurs the count
MAX_SEQS = 8


def scheduler_of(policy: str, num_pages: int = POOL_PAGES, **config) -> Scheduler:
    cfg = SchedulerConfig(**{"page_size": PAGE, "watermark": 0.0, "max_num_seqs": MAX_SEQS,
                             "max_num_batched_tokens": 512, "scheduling_policy": policy, **config})
    return Scheduler(cfg, PageAllocator(num_pages, PAGE))


@dataclass
class ServiceLog:
    """Each tenant's weighted service after every step, and which tenants were waiting then."""

    owner_of_version: dict[str, str]
    weights: dict[str, float]
    service: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    steps: list[tuple[dict[str, float], set[str]]] = field(default_factory=list)

    def observer(self, scheduler: Scheduler):  # noqa: ANN201
        def observe(out: SchedulerOutput, clock: float) -> None:
            for item in out.scheduled:
                tenant = item.seq.tenant
                self.service[tenant] += (W_P * item.prompt_tokens + W_Q * item.completes) / self.weights[tenant]
            for version, pages in out.adapters_to_load:
                tenant = self.owner_of_version[version]
                self.service[tenant] += W_P * len(pages) * PAGE / self.weights[tenant]
            self.steps.append((dict(self.service), {seq.tenant for seq in scheduler.waiting}))
        return observe

    def while_all_wait(self, tenants: list[str]) -> list[dict[str, float]]:
        """The services after each step, up to the first step after which one of `tenants` no longer waits."""
        services = []
        for service, waiting in self.steps:
            if not set(tenants) <= waiting:
                break
            services.append(service)
        return services


def trace(tenants: dict[str, int], rng: random.Random, adapters: dict[str, list[AdapterRef]]) -> list[SimRequest]:
    """Every request at time 0, tenant by tenant (the first tenant's flood ahead of the others' in arrival),
    prompts of 8-256 tokens and outputs of 8-128, each on one of its tenant's adapters or none."""
    requests = []
    for tenant, count in tenants.items():
        for _ in range(count):
            adapter = rng.choice([None, *adapters.get(tenant, [])])
            requests.append(SimRequest(rng.randint(8, 256), rng.randint(8, 128), adapter, 0.0, tenant))
    return requests


def run(policy: str, tenants: dict[str, int], weights: dict[str, float] | None = None,
        adapters: dict[str, list[AdapterRef]] | None = None, seed: int = 0) -> tuple[ServiceLog, Scheduler]:
    weights = weights or dict.fromkeys(tenants, 1.0)
    adapters = adapters or {}
    scheduler = scheduler_of(policy)
    for tenant, weight in weights.items():
        scheduler.set_weight(tenant, weight)
    owners = {ref.version: tenant for tenant, refs in adapters.items() for ref in refs}
    log = ServiceLog(owners, weights)
    requests = trace(tenants, random.Random(seed), adapters)
    simulate(scheduler, requests, lambda out, s: 1.0, observe=log.observer(scheduler))
    assert scheduler.num_preemptions == 0, "a preemption's recomputation would blur the service counted here"
    return log, scheduler


def bound(adapter_pages: int = 0) -> float:
    """2 * max(W_P * L_in, W_Q * M): M, the tokens a running batch holds, is 8 sequences of at most 256 + 128."""
    longest_charge = W_P * (256 + adapter_pages * PAGE)
    batch_tokens = min(POOL_PAGES * PAGE, MAX_SEQS * (256 + 128))
    return 2 * max(longest_charge, W_Q * batch_tokens)


def largest_gap(services: list[dict[str, float]], tenants: list[str]) -> float:
    return max(max(s.get(t, 0.0) for t in tenants) - min(s.get(t, 0.0) for t in tenants) for s in services)


def test_two_backlogged_tenants_stay_within_the_bound_under_vtc_and_not_under_fcfs():
    tenants = {"a": 300, "b": 300}
    vtc, _ = run("vtc", tenants)
    fcfs, _ = run("fcfs", tenants)
    vtc_services = vtc.while_all_wait(["a", "b"])
    fcfs_services = fcfs.while_all_wait(["a", "b"])
    assert len(vtc_services) > 500, "the tenants waited together long enough to tell"
    assert largest_gap(vtc_services, ["a", "b"]) <= bound()
    # First come, first served: a's earlier flood is served while b waits, the gap growing past the bound.
    assert largest_gap(fcfs_services, ["a", "b"]) > 3 * bound()


def test_eight_tenants_of_mixed_lengths_and_adapters_stay_within_the_bound():
    names = [f"t{i}" for i in range(8)]
    adapters = {name: [AdapterRef(f"{name}-v{j}", 1 + (i + j) % 4) for j in range(2)] for i, name in enumerate(names)}
    log, scheduler = run("vtc", dict.fromkeys(names, 80), adapters=adapters, seed=1)
    services = log.while_all_wait(names)
    assert len(services) > 300
    assert largest_gap(services, names) <= bound(adapter_pages=4)
    assert scheduler.adapters.num_loads > len(names), "adapters were brought in (and charged) more than once"
    fcfs, _ = run("fcfs", dict.fromkeys(names, 80), adapters=adapters, seed=1)
    assert largest_gap(fcfs.while_all_wait(names), names) > bound(adapter_pages=4)


def test_weights_one_and_three_share_the_engine_one_to_three():
    log, _ = run("vtc", {"light": 60, "heavy": 180}, weights={"light": 1.0, "heavy": 3.0})
    services = log.while_all_wait(["light", "heavy"])
    # Weighted services stay level; the raw service of the heavy tenant is three times the light one's.
    raw_light, raw_heavy = services[-1]["light"] * 1.0, services[-1]["heavy"] * 3.0
    assert raw_heavy / raw_light == pytest.approx(3.0, rel=0.10)
    assert largest_gap(services, ["light", "heavy"]) <= bound()


def counter_of(scheduler: Scheduler, tenant: str) -> float:
    return scheduler.shares()[tenant].counter


def sequence(seq_id: int, tenant: str, prompt_len: int = 16, max_tokens: int = 8, priority: int = 0,
             adapter: AdapterRef | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [seq_id] * prompt_len, SamplingParams(max_tokens=max_tokens),
                    adapter, tenant=tenant, priority=priority)


def test_the_waiting_tenant_with_the_smallest_counter_is_admitted_first():
    scheduler = scheduler_of("vtc", max_num_seqs=1)
    scheduler.add(sequence(1, "a"))
    scheduler.add(sequence(2, "a"))
    scheduler.add(sequence(3, "b"))
    first = scheduler.schedule().scheduled[0].seq
    assert first.seq_id == 1                                   # equal counters: the older request
    scheduler.finish(first, "abort")
    assert scheduler.schedule().scheduled[0].seq.seq_id == 3   # a was charged 16 prompt tokens, b nothing


def test_a_tenant_returning_from_idle_is_lifted_to_the_waiting_ones_counter():
    scheduler = scheduler_of("vtc", max_num_seqs=1)
    for i in range(3):
        scheduler.add(sequence(i, "busy", prompt_len=64))
    running = scheduler.schedule().scheduled[0].seq
    scheduler.finish(running, "abort")
    scheduler.add(sequence(9, "idle"))
    assert counter_of(scheduler, "idle") == counter_of(scheduler, "busy") == 64 * W_P + W_Q
    assert scheduler.schedule().scheduled[0].seq.tenant == "busy"   # no credit for idling: the older goes first


def test_priority_orders_a_tenants_own_requests_but_not_across_tenants():
    scheduler = scheduler_of("vtc", max_num_seqs=1)
    scheduler.add(sequence(1, "a", priority=5))
    scheduler.add(sequence(2, "a", priority=0))
    scheduler.add(sequence(3, "b", priority=9))
    order = []
    for _ in range(3):
        seq = scheduler.schedule().scheduled[0].seq
        order.append(seq.seq_id)
        scheduler.finish(seq, "abort")
    # a's priority-0 request goes before its priority-5 one; b's priority 9 still takes its turn before a's second.
    assert order == [2, 3, 1]


def test_the_priority_policy_orders_everything_by_priority_then_arrival():
    scheduler = scheduler_of("priority", max_num_seqs=1)
    for seq_id, tenant, priority in [(1, "a", 2), (2, "b", 1), (3, "a", 1), (4, "b", 0)]:
        scheduler.add(sequence(seq_id, tenant, priority=priority))
    order = []
    for _ in range(4):
        seq = scheduler.schedule().scheduled[0].seq
        order.append(seq.seq_id)
        scheduler.finish(seq, "abort")
    assert order == [4, 2, 3, 1]


def test_fcfs_refuses_a_priority_it_would_ignore():
    with pytest.raises(ValueError, match="priority"):
        scheduler_of("fcfs").check_priority(1)
    scheduler_of("priority").check_priority(1)
    scheduler_of("fcfs").check_priority(0)


def admitted_then_decoding(scheduler: Scheduler, seqs: list[Sequence]) -> tuple[list[int], list[int]]:
    """The sequences' ids in the order admitted, then those preempted in the next step (each prompt of 16
    tokens fills a page of the 5; its first decode needs a second page)."""
    for seq in seqs:
        scheduler.add(seq)
    out = scheduler.schedule()
    for item in out.scheduled:
        scheduler.on_computed(item.seq, item.num_tokens)
        item.seq.output_token_ids.append(0)
    return [item.seq.seq_id for item in out.scheduled], [seq.seq_id for seq in scheduler.schedule().preempted]


def test_the_preemption_victim_is_the_newest_sequence_of_the_tenant_with_the_largest_counter():
    scheduler = scheduler_of("vtc", num_pages=5, max_num_seqs=4)
    scheduler.set_weight("light", 2.0)                       # light's charges count half
    seqs = [sequence(1, "heavy"), sequence(2, "heavy"), sequence(3, "light"), sequence(4, "light")]
    admitted, preempted = admitted_then_decoding(scheduler, seqs)
    assert admitted == [1, 3, 4, 2]               # light's counter grows half as fast: it gets two turns
    assert counter_of(scheduler, "heavy") > counter_of(scheduler, "light")
    # 1 takes the free page; 3 needs one: heavy has the larger counter, so its newest sequence, 2, gives way
    # (under fcfs the newest of all, 4, would); then 4 needs one and only it is left to give.
    assert preempted == [2, 4]


def test_fcfs_preempts_the_newest_sequence():
    scheduler = scheduler_of("fcfs", num_pages=5, max_num_seqs=4)
    seqs = [sequence(1, "heavy"), sequence(2, "heavy"), sequence(3, "light"), sequence(4, "light")]
    admitted, preempted = admitted_then_decoding(scheduler, seqs)
    assert admitted == [1, 2, 3, 4]
    assert preempted == [4, 3]


def test_bringing_an_adapter_into_the_pool_is_charged_to_its_tenant_once():
    scheduler = scheduler_of("vtc")
    ref = AdapterRef("v-a", 3)
    scheduler.add(sequence(1, "a", adapter=ref))
    scheduler.add(sequence(2, "a", adapter=ref))
    scheduler.schedule()
    share = scheduler.shares()["a"]
    assert share.adapter_pages == 3                         # resident once for both
    assert share.counter == W_P * (3 * PAGE + 2 * 16) + W_Q * 2      # adapter + two prompts + two first tokens


def test_recomputation_after_a_preemption_is_charged_to_nobody():
    scheduler = scheduler_of("fcfs", num_pages=2, max_num_seqs=2)
    first, second = sequence(1, "a"), sequence(2, "b")
    scheduler.add(first)
    scheduler.add(second)
    for item in scheduler.schedule().scheduled:               # two prompts of one page each: the pool is full
        scheduler.on_computed(item.seq, item.num_tokens)
        item.seq.output_token_ids.append(0)
    out = scheduler.schedule()                                # first's decode needs a page: second goes
    assert out.preempted == [second]
    before = scheduler.shares()["b"]
    scheduler.finish(first, "abort")
    out = scheduler.schedule()                                # second comes back: its 17 tokens computed again
    assert [item.num_tokens for item in out.scheduled] == [17]
    after = scheduler.shares()["b"]
    assert after.prompt_tokens == before.prompt_tokens == 16
    assert after.output_tokens == before.output_tokens + 1    # only the token it now generates


# ---- the engine (tiny model, CPU) --------------------------------------------------------------------------
def tiny_engine(policy: str) -> "Engine":
    from slora.config import EngineConfig
    from slora.engine import Engine
    return Engine(EngineConfig(model="slora-tiny-llama", max_num_seqs=1, scheduling_policy=policy))


def finishing_order(engine: "Engine") -> list[str]:
    order = []
    while engine.has_unfinished():
        order += [out.request_id for out in engine.step() if out.finished]
    return order


def test_the_engine_admits_by_priority_and_fcfs_refuses_a_priority_without_keeping_the_request():
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    engine = tiny_engine("priority")
    for request_id, priority in [("late", 5), ("soon", -1), ("middle", 0)]:
        engine.add_request(request_id, [1, 2, 3], params, priority=priority)
    assert finishing_order(engine) == ["soon", "middle", "late"]
    fcfs = tiny_engine("fcfs")
    with pytest.raises(ValueError, match="priority"):
        fcfs.add_request("r", [1, 2, 3], params, priority=1)
    assert not fcfs.has_unfinished()
    fcfs.check()


def test_vtc_changes_the_order_of_service_and_not_one_token():
    """Greedy outputs of two tenants' requests are the same under vtc as under fcfs (order never changes what a
    sequence computes), while the order in which they finish differs."""
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    requests = [(f"a{i}", "a", [5 + i, 9, 2]) for i in range(3)] + [("b0", "b", [7, 7, 1])]
    results = {}
    for policy in ("fcfs", "vtc"):
        engine = tiny_engine(policy)
        for request_id, tenant, prompt in requests:
            engine.add_request(request_id, prompt, params, owner=tenant, stream=False)
        order, tokens = [], {}
        while engine.has_unfinished():
            for out in engine.step():
                order.append(out.request_id)
                tokens[out.request_id] = out.outputs[0].token_ids
        results[policy] = order, tokens
    assert results["fcfs"][1] == results["vtc"][1]
    assert results["fcfs"][0] == ["a0", "a1", "a2", "b0"]
    assert results["vtc"][0] == ["a0", "b0", "a1", "a2"]          # b's turn comes after a's first request
