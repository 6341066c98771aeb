"""Host time of the device copies an engine step makes, by what came before them.

In step_host.py's engine the staged send (one pinned host-to-device copy) cost the H200's host 103-191 µs a
step, while stage_host.py's loop staged a whole step in 40 µs. The loop sends back to back; the engine
sends once per step, after the host waited for the GPU, and in step_host.py's `--idle-ms` after a sleep too.
This script times one call at a time, on an otherwise idle GPU, under three regimes:
- `loop`: calls back to back (as stage_host.py's loop);
- `after_sync`: each call after `torch.cuda.synchronize()`, which returns at once on the idle GPU: it does
  not reproduce a wait for queued GPU work, as the engine's for a step's sampled ids;
- `after_idle`: each call after a synchronize and a sleep of `--idle-ms` (as step_host.py `--idle-ms`).

The calls are the step's three copies: `send` (a pinned host buffer of each `--sizes` byte count to the
device, non-blocking, with an event recorded after it, as `StagedBuffers.send`), `feed` (64 int64 ids copied
on the device, as `feed_tokens`) and `to_host` (64 int64 ids into pinned memory, non-blocking, with an event
recorded after them: `HostCopy` also makes a new event and takes its buffer per step, which this reuses); and
`empty_launch` (an empty tensor's `add_`, which launches nothing) for the cost of any first call. Each row
gives the median and p90 µs over `--calls` calls, CUDA only.

    python benchmarks/experiments/copy_host.py [--quick] [--calls 200] [--idle-ms 20]
                                               [--sizes 4096,65536,262144,1048576] [--out FILE]
"""
import argparse
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, print_table, write_json  # noqa: E402

REGIMES = ("loop", "after_sync", "after_idle")
IDS = 64                           # a decode step's sampled ids


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = tuple(int(part) for part in text.split(",") if part.strip())
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"--sizes takes positive byte counts, got {text!r}")
    return sizes


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--calls must be >= 1, got {value}")
    return value


def before_call(regime: str, idle_s: float) -> Callable[[], None]:
    """What runs, untimed, before each timed call of a regime."""
    if regime == "loop":
        return lambda: None
    if regime == "after_sync":
        return torch.cuda.synchronize

    def sync_then_sleep() -> None:
        torch.cuda.synchronize()
        time.sleep(idle_s)
    return sync_then_sleep


def timed_us(call: Callable[[], object], before: Callable[[], None], calls: int) -> list[float]:
    """µs of each call, with `before` run untimed ahead of each."""
    call()                                                # first-use costs stay out of the rows
    torch.cuda.synchronize()
    samples = []
    for _ in range(calls):
        before()
        start = time.perf_counter()
        call()
        samples.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return samples


def copy_with_event(target: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
    """`source` copied into `target`, non-blocking, with an event recorded after it (StagedBuffers.send and
    HostCopy both record one)."""
    event = torch.cuda.Event()

    def copy() -> None:
        target.copy_(source, non_blocking=True)
        event.record()
    return copy


def send_call(nbytes: int) -> Callable[[], None]:
    """A pinned host buffer copied to the device (StagedBuffers.send)."""
    return copy_with_event(torch.empty(nbytes, dtype=torch.uint8, device="cuda"),
                           torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True))


def feed_call() -> Callable[[], None]:
    """Ids copied on the device into the leading rows of a larger buffer (feed_tokens' common case)."""
    sampled = torch.zeros(IDS, dtype=torch.int64, device="cuda")
    input_ids = torch.zeros(4 * IDS, dtype=torch.int64, device="cuda")
    return lambda: input_ids[:IDS].copy_(sampled)


def to_host_call() -> Callable[[], None]:
    """Ids copied into pinned host memory (HostCopy)."""
    return copy_with_event(torch.empty(IDS, dtype=torch.int64, pin_memory=True),
                           torch.zeros(IDS, dtype=torch.int64, device="cuda"))


def empty_launch_call() -> Callable[[], None]:
    empty = torch.empty(0, device="cuda")
    return lambda: empty.add_(1)


def calls_of(sizes: tuple[int, ...]) -> dict[str, Callable[[], None]]:
    return {**{f"send {n} B": send_call(n) for n in sizes}, "feed": feed_call(), "to_host": to_host_call(),
            "empty_launch": empty_launch_call()}


def rows_of(calls: dict[str, Callable[[], None]], count: int, idle_s: float) -> list[dict[str, object]]:
    rows = []
    for regime in REGIMES:
        before = before_call(regime, idle_s)
        for name, call in calls.items():
            samples = sorted(timed_us(call, before, count))
            rows.append({"call": name, "regime": regime, "median_us": statistics.median(samples),
                         "p90_us": samples[int(0.9 * (len(samples) - 1))]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="20 calls a row, 1 ms idle")
    parser.add_argument("--calls", type=positive_int, default=200)
    parser.add_argument("--idle-ms", type=float, default=20.0)
    parser.add_argument("--sizes", type=parse_sizes, default=(4096, 65536, 262144, 1048576))
    parser.add_argument("--out", default=None, help="JSON file (default: results/copy_host.json)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not torch.cuda.is_available():
        raise SystemExit("copy_host.py times CUDA copies: it needs a GPU")
    count, idle_ms = (20, 1.0) if args.quick else (args.calls, args.idle_ms)
    rows = rows_of(calls_of(args.sizes), count, idle_ms / 1e3)
    print_table(rows)
    write_json(Path(args.out or RESULTS / "copy_host.json"),
               {"benchmark": "copy_host", "calls_per_row": count, "idle_ms": idle_ms, "regimes": list(REGIMES),
                "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
