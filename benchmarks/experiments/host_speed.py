"""How fast this machine's host runs the kinds of work an engine step does, to compare two machines.

step_host.py found the GPU machine's host building a step's inputs in 0.52 ms where the 2-core CPU machine
took 0.09 ms, hot on both. This script times small units of that work alone, in one process with no engine:
plain Python (a dict filled, a list comprehension), numpy over a step's rows and tokens (an array from a
list, the slot arithmetic over 512 tokens) and a small torch op on the CPU. If every unit is slower by the
same factor, the machine is slower; if only some are, the difference is in those libraries' builds. It also
records what could explain a slow host: the CPU's clock, the cores this process may use, torch's threads,
the cgroup's CPU quota, and how often the cgroup was throttled while the units ran.

    python benchmarks/experiments/host_speed.py [--quick] [--out FILE]
"""
import argparse
import logging
import os
import platform
import statistics
import sys
import sysconfig
import timeit
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, print_table, write_json  # noqa: E402

logger = logging.getLogger("benchmarks.host_speed")
CGROUP = Path("/sys/fs/cgroup")


class Unit(NamedTuple):
    setup: str
    statement: str


UNITS = {
    "python_dict_1000": Unit("d = {}", "for i in range(1000): d[i] = i"),
    "python_list_comp_64": Unit("rows = list(range(64))", "[r * 2 + 1 for r in rows]"),
    "numpy_array_from_list_64": Unit("import numpy as np; rows = list(range(64))", "np.array(rows)"),
    "numpy_slots_512": Unit("import numpy as np; pos = np.arange(512); table = np.arange(64)",
                            "table[pos // 16] * 16 + pos % 16"),
    "torch_cpu_add_512": Unit("import torch; x = torch.zeros(512)", "x.add_(1)"),
}


def unit_us(unit: Unit, number: int, repeats: int) -> float:
    """The median µs of one run of the unit's statement, over `repeats` timings of `number` runs each."""
    times = timeit.repeat(unit.statement, unit.setup, number=number, repeat=repeats)
    return 1e6 * statistics.median(times) / number


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def cpu_mhz() -> float | None:
    """The first core's clock now, as /proc/cpuinfo reports it (None where it does not)."""
    for line in (read_text(Path("/proc/cpuinfo")) or "").splitlines():
        if line.startswith("cpu MHz"):
            return float(line.split(":")[1])
    return None


def throttling(cgroup: Path) -> dict[str, int]:
    """The cgroup's CPU throttling counters (cgroup v2's cpu.stat), empty where there are none."""
    fields = (line.split() for line in (read_text(cgroup / "cpu.stat") or "").splitlines())
    return {name: int(value) for name, value in fields if name.startswith(("nr_throttled", "throttled_"))}


def host() -> dict[str, str | int | float | None]:
    return {"python": sys.version, "python_config": sysconfig.get_config_var("CONFIG_ARGS"),
            "processor": platform.processor(), "cpu_mhz": cpu_mhz(), "cpu_count": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "torch_threads": torch.get_num_threads(),
            "numpy": np.__version__, "torch": torch.__version__, "cgroup_cpu_max": read_text(CGROUP / "cpu.max")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="few runs (CI)")
    parser.add_argument("--out", default=None, help="JSON file (default: results/host_speed.json)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    number, repeats = (20, 3) if args.quick else (2000, 15)
    before = throttling(CGROUP)
    rows = [{"unit": name, "us": unit_us(unit, number, repeats)} for name, unit in UNITS.items()]
    after = throttling(CGROUP)
    data = {"benchmark": "host_speed", "host": host(), "runs_per_timing": number, "timings": repeats,
            "rows": rows, "throttled_during": {k: after[k] - before.get(k, 0) for k in after}}
    print_table(rows)
    write_json(Path(args.out or RESULTS / "host_speed.json"), data)


if __name__ == "__main__":
    main()
