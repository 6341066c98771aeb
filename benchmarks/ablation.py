"""Unified versus partitioned memory, simulated: one pool that holds both KV and adapter
weights (slora's scheduler as it is) against the same number of pages split into a fixed adapter region
and a fixed KV region (memsim.PartitionedScheduler), on the same trace, as the number of adapters grows.

Workload: S-LoRA's synthetic trace (workloads.py) with ranks mixed from {8, 16, 32, 64}, uniform adapter
popularity (alpha = 1), Gamma arrivals with cv = 1 at a rate above what the pool can serve, so that the
batch is bounded by memory. Adapters are Llama-3-8B LoRAs on q, k, v, o (rank 8: 7 pages of 16 tokens,
13.6 MB; rank 64: 52 pages, 109 MB). Cost: memsim's decode/recompute model plus each adapter load at
adapter bytes / 50 GB/s host-to-device; the decode step also reads each distinct adapter of the batch.

    python benchmarks/ablation.py [--quick] [--out benchmarks/results/cpu/ablation.json] [--plot FILE.png]
"""
import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import RESULTS, print_table, pyplot, save_figure, write_rows
from memsim import UNCAPPED_TOKENS, CostModel, PartitionedScheduler, StepMeter, sim_requests
from workloads import slora_trace

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler, SchedulerConfig
from slora.core.sequence import AdapterRef
from slora.core.simulator import simulate

PAGE_SIZE = 16
WATERMARK = 0.01
LOG = logging.getLogger("benchmarks.ablation")


@dataclass(frozen=True)
class Setup:
    num_requests: int
    rate: float                              # requests/s
    budget_gb: float                         # the whole pool: KV and adapters
    adapter_counts: tuple[int, ...]
    adapter_fractions: tuple[float, ...]     # adapter region of each partitioned variant


def full_setup() -> Setup:
    return Setup(2000, 100.0, 10.0, (1, 10, 50, 100, 200, 500, 1000, 2000), (0.1, 0.3))


def quick_setup() -> Setup:
    return Setup(300, 100.0, 4.0, (1, 100), (0.1, 0.3))


@dataclass(frozen=True)
class Variant:
    adapter_fraction: float | None           # None: the unified pool

    @property
    def name(self) -> str:
        return "unified" if self.adapter_fraction is None else "partitioned"

    @property
    def label(self) -> str:
        return self.name if self.adapter_fraction is None else f"partitioned {self.adapter_fraction:.0%}"


def build_scheduler(variant: Variant, num_pages: int, max_seqs: int) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=UNCAPPED_TOKENS,
                             enable_prefix_caching=False,
                             page_size=PAGE_SIZE, watermark=WATERMARK)
    if variant.adapter_fraction is None:
        return Scheduler(config, PageAllocator(num_pages, PAGE_SIZE))
    adapter_pages = int(num_pages * variant.adapter_fraction)
    return PartitionedScheduler(config, PageAllocator(num_pages - adapter_pages, PAGE_SIZE),
                                adapter_allocator=PageAllocator(adapter_pages, PAGE_SIZE))


def run_one(variant: Variant, setup: Setup, num_adapters: int, cost: CostModel) -> dict[str, Any]:
    started = time.perf_counter()
    trace = slora_trace(setup.num_requests, num_adapters, setup.rate, cv=1.0, alpha=1.0, rank_mix=True)
    model = cost.model
    ranks = {r.adapter: r.rank for r in trace}
    refs = {a: AdapterRef(f"adapter-{a}", model.adapter_pages(rank, PAGE_SIZE)) for a, rank in ranks.items()}
    meter = StepMeter(cost, {refs[a].version: model.adapter_bytes(rank) for a, rank in ranks.items()})
    num_pages = int(setup.budget_gb * 1e9 // (PAGE_SIZE * model.kv_bytes_per_token))
    scheduler = build_scheduler(variant, num_pages, setup.num_requests)
    result = simulate(scheduler, sim_requests(trace, lambda index, rank: refs[index]), meter)
    expected = sum(r.output_len for r in trace)
    assert result.output_tokens == expected, "a request was rejected: the pool cannot hold it"
    LOG.info("%s, %d adapters: %d steps, %.1f simulated s, %.1f s wall", variant.label, num_adapters,
             result.steps, result.elapsed, time.perf_counter() - started)
    return {"variant": variant.name, "adapter_fraction": variant.adapter_fraction, "num_adapters": num_adapters,
            "mean_batch": result.mean_batch, "tokens_per_s": result.output_tokens / result.elapsed,
            "adapter_loads": meter.adapter_loads, "adapter_evictions": scheduler.adapters.num_evictions,
            "preemptions": scheduler.num_preemptions, "load_s": meter.seconds_loading}


def run_ablation(setup: Setup) -> list[dict[str, Any]]:
    cost = CostModel()
    variants = [Variant(None), *(Variant(f) for f in setup.adapter_fractions)]
    return [run_one(v, setup, n, cost) for n in setup.adapter_counts for v in variants]


def label(row: dict[str, Any]) -> str:
    return Variant(row["adapter_fraction"]).label


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"variant": label(r), **{k: v for k, v in r.items() if k not in ("variant", "adapter_fraction")}}
            for r in rows]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean batch, throughput and adapter evictions against the number of adapters, one line per variant."""
    plt = pyplot()
    if plt is None:
        return
    keys = (("mean_batch", "mean running batch"), ("tokens_per_s", "output tokens/s"),
            ("adapter_evictions", "adapter evictions"))
    fig, axes = plt.subplots(1, len(keys), figsize=(15, 4.5))
    for name in dict.fromkeys(label(r) for r in rows):
        mine = [r for r in rows if label(r) == name]
        for ax, (key, _) in zip(axes, keys):
            ax.plot([r["num_adapters"] for r in mine], [r[key] for r in mine], marker="o", label=name)
    for ax, (_, title) in zip(axes, keys):
        ax.set_xscale("log")
        ax.set_xlabel("number of adapters")
        ax.set_title(title)
    axes[0].legend()
    fig.suptitle("Unified vs partitioned pool, S-LoRA trace (ranks 8-64), simulated Llama-3-8B on an H200-like "
                 "cost model")
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300 requests, 4 GB, 1 and 100 adapters (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu" / "ablation.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows = run_ablation(quick_setup() if args.quick else full_setup())
    write_rows(args.out, rows)
    print_table(table_rows(rows))
    plot(rows, args.plot or args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
