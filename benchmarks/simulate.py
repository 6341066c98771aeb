"""The memory-accounting study: the project's own scheduler and page pool, driven by a
step-cost function instead of a model (see memsim.py for the cost model of Llama-3-8B on an H200).

Workload: the long-tailed trace (workloads.py), all requests arriving at time 0, base model only.
Policies, each for a KV budget of 60 GB and 20 GB:
  reserve  every request reserves the maximum length (4,096 tokens) at admission;
  oracle   every request reserves exactly its final length (prompt + output);
  paged    slora's scheduler, pages of 16/32/128/512 tokens, admission watermarks 0%, 1%, 5%.
Reserve and oracle run on the same scheduler with one-token pages (so reservations are exact) and all
of a request's slots allocated when it is admitted (memsim.ReservingScheduler). No policy caps the
number of running sequences or the batched tokens: memory is the only bound.

    python benchmarks/simulate.py [--quick] [--out benchmarks/results/cpu/simulate.json] [--plot FILE.png]
"""
import argparse
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import RESULTS, print_table, pyplot, save_figure, write_rows
from memsim import UNCAPPED_TOKENS, CostModel, ReservingScheduler, StepMeter, sim_requests
from workloads import long_tail_trace

from slora.core.page_pool import PageAllocator
from slora.core.scheduler import Scheduler, SchedulerConfig
from slora.core.simulator import simulate

MAX_LEN = 4096
LOG = logging.getLogger("benchmarks.simulate")


@dataclass(frozen=True)
class Policy:
    name: str                       # "reserve" | "oracle" | "paged"
    page_size: int | None = None    # paged only
    watermark: float = 0.0

    @property
    def label(self) -> str:
        return self.name if self.page_size is None else f"paged {self.page_size}/{self.watermark:.0%}"


@dataclass(frozen=True)
class Study:
    num_requests: int
    budgets_gb: tuple[float, ...]
    policies: tuple[Policy, ...]


def full_study() -> Study:
    paged = tuple(Policy("paged", size, wm) for size in (16, 32, 128, 512) for wm in (0.0, 0.01, 0.05))
    return Study(2000, (60.0, 20.0), (Policy("reserve"), Policy("oracle"), *paged))


def quick_study() -> Study:
    paged = (Policy("paged", 16, 0.01), Policy("paged", 512, 0.0))
    return Study(300, (10.0,), (Policy("reserve"), Policy("oracle"), *paged))


def build_scheduler(policy: Policy, budget_bytes: float, cost: CostModel, max_seqs: int) -> Scheduler:
    page_size = policy.page_size or 1
    num_pages = int(budget_bytes // (page_size * cost.model.kv_bytes_per_token))
    config = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=UNCAPPED_TOKENS,
                             enable_prefix_caching=False,
                             page_size=page_size, watermark=policy.watermark)
    allocator = PageAllocator(num_pages, page_size)
    if policy.name == "paged":
        return Scheduler(config, allocator)
    reserve = MAX_LEN if policy.name == "reserve" else None
    return ReservingScheduler(config, allocator, reserve_tokens=reserve)


def run_one(policy: Policy, budget_gb: float, requests: list, cost: CostModel) -> dict[str, Any]:
    started = time.perf_counter()
    scheduler = build_scheduler(policy, budget_gb * 1e9, cost, len(requests))
    meter = StepMeter(cost)
    result = simulate(scheduler, sim_requests(requests), meter)
    assert not scheduler.has_unfinished(), "the simulation stopped before every request finished"
    assert result.recomputed_tokens == meter.recomputed_tokens
    LOG.info("%s at %s GB: %d steps, %.1f simulated s, %.1f s wall", policy.label, budget_gb, result.steps,
             result.elapsed, time.perf_counter() - started)
    return {"policy": policy.name, "page_size": policy.page_size, "watermark": policy.watermark,
            "budget_gb": budget_gb, "mean_batch": result.mean_batch, "utilisation": meter.utilisation,
            "tokens_per_s": result.output_tokens / result.elapsed, "preemptions": scheduler.num_preemptions,
            "recomputed_tokens": result.recomputed_tokens, "mean_end_waste": meter.mean_end_waste}


def run_study(study: Study) -> list[dict[str, Any]]:
    requests = long_tail_trace(study.num_requests, max_total=MAX_LEN)
    cost = CostModel()
    return [run_one(policy, budget, requests, cost) for budget in study.budgets_gb for policy in study.policies]


def label(row: dict[str, Any]) -> str:
    return Policy(row["policy"], row["page_size"], row["watermark"]).label


def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"policy": label(r), **{k: v for k, v in r.items() if k not in ("policy", "page_size", "watermark")}}
            for r in rows]


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    """Mean running batch and output tokens/s per policy, one bar group per budget."""
    plt = pyplot()
    if plt is None:
        return
    labels = list(dict.fromkeys(label(r) for r in rows))
    budgets = list(dict.fromkeys(r["budget_gb"] for r in rows))
    fig, axes = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(labels)), 7), sharex=True)
    width = 0.8 / len(budgets)
    for b, budget in enumerate(budgets):
        by_label = {label(r): r for r in rows if r["budget_gb"] == budget}
        xs = [i + b * width for i in range(len(labels))]
        for ax, key in zip(axes, ("mean_batch", "tokens_per_s")):
            ax.bar(xs, [by_label[lab][key] if lab in by_label else 0 for lab in labels], width,
                   label=f"{budget:g} GB")
    axes[0].set_ylabel("mean running batch")
    axes[1].set_ylabel("output tokens/s")
    axes[1].set_xticks([i + width * (len(budgets) - 1) / 2 for i in range(len(labels))], labels,
                       rotation=45, ha="right")
    for ax in axes:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.25)
    axes[0].legend(title="KV budget", loc="upper center", ncol=len(budgets))
    axes[0].set_title("Long-tail trace, simulated Llama-3-8B on an H200-like cost model")
    save_figure(fig, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="300 requests, 10 GB, 4 policies (CI)")
    parser.add_argument("--out", type=Path, default=RESULTS / "cpu" / "simulate.json")
    parser.add_argument("--plot", type=Path, default=None, help="PNG path (default: --out with .png)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    rows = run_study(quick_study() if args.quick else full_study())
    write_rows(args.out, rows)
    print_table(table_rows(rows))
    plot(rows, args.plot or args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
