"""The simulated benchmarks run end to end in their --quick mode (as CI runs them) and write what the
README promises. Speed is never asserted here, only the shape and sense of the results."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SIMULATE_KEYS = {"policy", "page_size", "watermark", "budget_gb", "mean_batch", "utilisation", "tokens_per_s",
                 "preemptions", "recomputed_tokens", "mean_end_waste"}
ABLATION_KEYS = {"variant", "adapter_fraction", "num_adapters", "mean_batch", "tokens_per_s", "adapter_loads",
                 "adapter_evictions", "preemptions", "load_s"}
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def run_quick(script: str, out: Path) -> list[dict]:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mean_batch" in done.stdout                  # the table
    if HAS_MATPLOTLIB:
        assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def simulate_rows(tmp_path_factory) -> list[dict]:
    return run_quick("simulate.py", tmp_path_factory.mktemp("simulate") / "simulate.json")


@pytest.fixture(scope="module")
def ablation_rows(tmp_path_factory) -> list[dict]:
    return run_quick("ablation.py", tmp_path_factory.mktemp("ablation") / "ablation.json")


def test_simulate_writes_exactly_the_documented_keys(simulate_rows):
    assert isinstance(simulate_rows, list) and simulate_rows
    for row in simulate_rows:
        assert set(row) == SIMULATE_KEYS
        assert row["policy"] in {"reserve", "oracle", "paged"}
        assert (row["page_size"] is None) == (row["policy"] != "paged")
    assert {r["policy"] for r in simulate_rows} == {"reserve", "oracle", "paged"}


def test_simulate_paging_beats_reservation(simulate_rows):
    for budget in {r["budget_gb"] for r in simulate_rows}:
        rows = [r for r in simulate_rows if r["budget_gb"] == budget]
        reserve = next(r for r in rows if r["policy"] == "reserve")
        paged16 = [r for r in rows if r["policy"] == "paged" and r["page_size"] == 16]
        assert paged16
        for row in paged16:
            assert row["mean_batch"] > reserve["mean_batch"]
            assert row["utilisation"] > reserve["utilisation"]
            assert row["mean_end_waste"] < reserve["mean_end_waste"]
        assert reserve["preemptions"] == 0 and reserve["recomputed_tokens"] == 0


def test_simulate_metrics_are_in_range(simulate_rows):
    for row in simulate_rows:
        assert 0 < row["utilisation"] <= 1
        assert row["mean_batch"] > 0 and row["tokens_per_s"] > 0
        assert row["preemptions"] >= 0 and row["recomputed_tokens"] >= 0 and row["mean_end_waste"] >= 0
        if row["policy"] == "paged":
            assert row["mean_end_waste"] < row["page_size"]
        if row["preemptions"] == 0:
            assert row["recomputed_tokens"] == 0


def test_ablation_structure(ablation_rows):
    assert isinstance(ablation_rows, list) and ablation_rows
    for row in ablation_rows:
        assert set(row) == ABLATION_KEYS
        assert row["variant"] in {"unified", "partitioned"}
        assert (row["adapter_fraction"] is None) == (row["variant"] == "unified")
        assert row["mean_batch"] > 0 and row["tokens_per_s"] > 0
        assert row["adapter_loads"] >= 1 and row["adapter_evictions"] >= 0
    counts = sorted({r["num_adapters"] for r in ablation_rows})
    assert len(counts) >= 2
    for count in counts:                                 # every variant at every adapter count
        variants = [(r["variant"], r["adapter_fraction"]) for r in ablation_rows if r["num_adapters"] == count]
        assert ("unified", None) in variants and len(variants) >= 2
    one = [r for r in ablation_rows if r["num_adapters"] == 1]
    assert all(r["adapter_loads"] == 1 and r["adapter_evictions"] == 0 for r in one)


def test_ablation_unified_pool_batches_at_least_as_many(ablation_rows):
    for count in {r["num_adapters"] for r in ablation_rows}:
        rows = [r for r in ablation_rows if r["num_adapters"] == count]
        unified = next(r for r in rows if r["variant"] == "unified")
        assert all(unified["mean_batch"] >= r["mean_batch"] for r in rows)


@pytest.mark.parametrize("script", ["kernel_bench.py", "sharing.py", "offline.py"])
def test_other_benchmarks_quick_modes_run_and_write_rows(script, quick_benchmark):
    # The README says every script's --quick runs in CI: these too, on the CPU (kernel_bench.py times the
    # torch references there). The session's one run of each (test_sharing_benchmark.py checks sharing.py's).
    done, out = quick_benchmark(script)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["rows"]


def test_decode_benchmark_quick_says_it_needs_a_gpu_on_the_cpu(tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "decode.py"), "--quick", "--out", str(tmp_path / "d.json")],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "no GPU here" in done.stderr and not (tmp_path / "d.json").exists()


def test_page_alloc_quick_times_every_call(tmp_path):
    """benchmarks/experiments/page_alloc.py (the allocator's bulk calls) runs on the CPU, a row per call."""
    out = tmp_path / "alloc.json"
    script = BENCHMARKS / "experiments" / "page_alloc.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--pages", "4", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["pages"], result["iterations"], result["repeats"]) == (4, 50, 1)      # --quick's sizes
    rows = result["rows"]
    assert [r["call"] for r in rows] == ["4 pages from the free list", "4 pages evicting cached KV",
                                         "1 page evicting cached KV", "register 4 pages' hashes"]
    assert all(r["us_per_call"] > 0 for r in rows)


def test_stage_host_quick_times_building_and_staging_both_step_kinds(tmp_path):
    """benchmarks/experiments/stage_host.py (a graphed step's input work) runs on the CPU, a row per call."""
    out = tmp_path / "stage.json"
    script = BENCHMARKS / "experiments" / "stage_host.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert (result["decodes"], result["chunk_tokens"], result["iterations"], result["repeats"]) == (64, 448, 20, 1)
    rows = result["rows"]
    assert [r["call"] for r in rows] == ["decode step: build", "decode step: stage", "chunk step: build",
                                         "chunk step: stage"]
    assert all(r["us_per_call"] > 0 for r in rows)


def test_host_overhead_quick_times_every_step_kind(tmp_path):
    """benchmarks/experiments/host_overhead.py (the LoRA wrappers' host time with the kernels stubbed) runs on
    the CPU."""
    out = tmp_path / "host.json"
    script = BENCHMARKS / "experiments" / "host_overhead.py"
    done = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["step"] for r in rows] == ["decode, 64 adapters", "mixed, 5 adapters", "mixed, 66 adapters"]
    # Every group of every layer reached its shrink and expand launch (4 groups x 2 layers, 2 kernels each).
    assert [r["launches"] for r in rows] == [16, 16, 16]
