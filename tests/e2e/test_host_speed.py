"""benchmarks/experiments/host_speed.py: the host's speed on an engine step's kinds of work, to compare machines."""
import json

from benchmark_modules import load_benchmark

host_speed = load_benchmark("experiments/host_speed.py", "host_speed_script")


def test_quick_run_times_every_unit_and_records_the_host(tmp_path):
    out = tmp_path / "host_speed.json"
    host_speed.main(["--quick", "--repeats", "3", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [row["unit"] for row in result["rows"]] == list(host_speed.UNITS)
    assert all(row["us"] > 0 for row in result["rows"])
    assert (result["runs_per_timing"], result["timings"]) == (20, 3)
    assert result["host"]["usable_cores"] >= 1 and result["host"]["torch_threads"] >= 1


def test_throttling_reads_only_the_throttle_counters(tmp_path):
    (tmp_path / "cpu.stat").write_text("usage_usec 900\nuser_usec 600\nnr_periods 40\nnr_throttled 7\n"
                                       "throttled_usec 1200\n")
    assert host_speed.throttling(tmp_path) == {"nr_throttled": 7, "throttled_usec": 1200}


def test_throttling_is_empty_without_a_cgroup_v2_stat(tmp_path):
    assert host_speed.throttling(tmp_path) == {}
