"""How fast this machine's host runs the kinds of work an engine step does, to compare two machines.

step_host.py found the GPU machine's host building a step's inputs in 0.52 ms where the 2-core CPU machine
took 0.09 ms, hot on both. This script times small units of that work alone, in one process with no engine:
plain Python (a dict filled, a list comprehension), numpy over a step's rows and tokens (an array from a
list, the slot arithmetic over 512 tokens) and a small torch op on the CPU, each in µs a call, the best of
--repeats runs of --iterations calls (common.best_us_per_call, as the other host-side experiments time
theirs). If every unit is slower by the same factor, the machine is slower; if only some are, the
difference is in those libraries' builds. It also records what could explain a slow host: the CPU's model
and clock, the cores this process may use, torch's threads, the cgroup's CPU quota, and how often the
cgroup was throttled while the units ran.

    python benchmarks/experiments/host_speed.py [--quick] [--iterations 2000] [--repeats 5] [--out FILE]
"""
import argparse
import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, best_us_per_call, parse_call_timing, print_table, write_json  # noqa: E402

CGROUP = Path("/sys/fs/cgroup")


def fill_dict() -> Callable[[], object]:
    stored: dict[int, int] = {}      # one per run, refilled by every call

    def fill() -> None:
        for i in range(1000):
            stored[i] = i
    return fill


def list_comprehension() -> Callable[[], object]:
    rows = list(range(64))
    return lambda: [r * 2 + 1 for r in rows]


def array_from_list() -> Callable[[], object]:
    rows = list(range(64))
    return lambda: np.array(rows)


def slot_arithmetic() -> Callable[[], object]:
    positions, table = np.arange(512), np.arange(64)    # [tokens], [pages]: a row's block table
    return lambda: table[positions // 16] * 16 + positions % 16


def torch_add() -> Callable[[], object]:
    x = torch.zeros(512)
    return lambda: x.add_(1)


# Each makes, per run, the unit's call (best_us_per_call's `make`).
UNITS: dict[str, Callable[[], Callable[[], object]]] = {
    "python_dict_1000": fill_dict, "python_list_comp_64": list_comprehension,
    "numpy_array_from_list_64": array_from_list, "numpy_slots_512": slot_arithmetic,
    "torch_cpu_add_512": torch_add,
}


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpuinfo(field: str) -> str | None:
    """The first core's `field` in /proc/cpuinfo ("model name", "cpu MHz"; None where it has none)."""
    for line in (read_text(Path("/proc/cpuinfo")) or "").splitlines():
        name, _, value = line.partition(":")
        if name.strip() == field:
            return value.strip()
    return None


def throttling(cgroup: Path) -> dict[str, int]:
    """The cgroup's CPU throttling counters (cgroup v2's cpu.stat), empty where there are none."""
    fields = (line.split() for line in (read_text(cgroup / "cpu.stat") or "").splitlines())
    return {name: int(value) for name, value in fields if name.startswith(("nr_throttled", "throttled_"))}


def host() -> dict[str, str | int | float | None]:
    return {"python": sys.version, "python_config": sysconfig.get_config_var("CONFIG_ARGS"),
            "cpu_model": cpuinfo("model name"), "cpu_mhz": cpuinfo("cpu MHz"), "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "numpy": np.__version__, "torch": torch.__version__, "cgroup_cpu_max": read_text(CGROUP / "cpu.max")}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="JSON file (default: results/host_speed.json)")
    args, timing = parse_call_timing(parser, argv, iterations=2000, quick_iterations=20)
    before = throttling(CGROUP)
    rows = [{"unit": name, "us": best_us_per_call(make, timing)} for name, make in UNITS.items()]
    after = throttling(CGROUP)
    data = {"benchmark": "host_speed", "host": host(), "runs_per_timing": timing.iterations,
            "timings": timing.repeats, "rows": rows,
            "throttled_during": {k: after[k] - before.get(k, 0) for k in after}}
    print_table(rows)
    write_json(Path(args.out or RESULTS / "host_speed.json"), data)


if __name__ == "__main__":
    main()
