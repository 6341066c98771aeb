"""benchmarks/memsim.py: the cost model's numbers and the two alternative memory policies, checked
against the pool's invariants at every simulated step."""
import pytest
from benchmark_modules import load_benchmark

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import SchedulerConfig
from slora.core.sequence import AdapterRef
from slora.core.simulator import SimRequest, simulate


@pytest.fixture(scope="module")
def ms():
    return load_benchmark("memsim.py", "bench_memsim")


def checked(meter):
    def cost(out, scheduler):
        scheduler.check()
        return meter(out, scheduler)
    return cost


def test_llama3_8b_cost_model(ms):
    cost = ms.CostModel()
    assert cost.model.kv_bytes_per_token == 131_072
    assert [cost.model.adapter_pages(r, 16) for r in (8, 16, 32, 64)] == [7, 13, 26, 52]
    assert cost.model.adapter_bytes(8) == 8 * 26_624 * 32 * 2
    assert cost.decode_s(1000) == pytest.approx((16.06e9 + 1000 * 131_072) / 3.35e12)
    assert cost.recompute_s(1000) == pytest.approx(1000 * 2 * 8.03e9 / (0.5 * 989e12))
    assert cost.load_s(50e9) == pytest.approx(1.0)


def test_reserving_scheduler_allocates_everything_at_admission(ms):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=ms.UNCAPPED_TOKENS, page_size=1, watermark=0)
    scheduler = ms.ReservingScheduler(config, PageAllocator(100, 1), reserve_tokens=40)
    meter = ms.StepMeter(ms.CostModel())
    result = simulate(scheduler, [SimRequest(10, 5)] * 5, checked(meter))
    assert result.output_tokens == 25 and scheduler.num_preemptions == 0
    assert max(result.batch_sizes) == 2                  # 100 slots hold two reservations of 40
    assert meter.end_waste == [40 - 14] * 5              # 14 slots written: prompt + output - 1
    oracle = ms.ReservingScheduler(config, PageAllocator(100, 1))
    oracle_meter = ms.StepMeter(ms.CostModel())
    oracle_result = simulate(oracle, [SimRequest(10, 5)] * 5, checked(oracle_meter))
    assert max(oracle_result.batch_sizes) == 5 and oracle_meter.end_waste == [1] * 5


def test_partitioned_scheduler_keeps_regions_apart(ms):
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=ms.UNCAPPED_TOKENS, page_size=4, watermark=0,
                             enable_prefix_caching=False)
    scheduler = ms.PartitionedScheduler(config, PageAllocator(40, 4), adapter_allocator=PageAllocator(10, 4))
    adapters = [AdapterRef(f"a{i}", 4) for i in range(3)]
    requests = [SimRequest(6, 6, adapters[i % 3], arrival=0.1 * i) for i in range(9)]
    meter = ms.StepMeter(ms.CostModel(), {a.version: 1000 for a in adapters})
    result = simulate(scheduler, requests, checked(meter))
    assert result.output_tokens == 54
    assert scheduler.adapters.num_evictions > 0           # three adapters of 4 pages share 10 pages
    assert scheduler.allocator.stats().adapter_pages == 0
    assert scheduler.allocator.num_free == 40
    assert meter.adapter_loads == scheduler.adapters.num_loads
