"""benchmarks/throughput.py and benchmarks/serving.py run end to end in their --quick mode (as CI runs them)
and write what the README promises. Speed is never asserted, only the structure and sense of the results."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S, load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def load_workloads():
    return load_benchmark("workloads.py", "bench_workloads_quick")


def run_quick(script: str, out: Path, marker: str) -> dict:
    done = subprocess.run([sys.executable, str(BENCHMARKS / script), "--quick", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert marker in done.stdout                          # the table
    if HAS_MATPLOTLIB:
        assert out.with_suffix(".png").stat().st_size > 0
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def throughput(tmp_path_factory) -> dict:
    return run_quick("throughput.py", tmp_path_factory.mktemp("throughput") / "throughput.json", "slora_req_s")


@pytest.fixture(scope="module")
def serving(tmp_path_factory) -> dict:
    return run_quick("serving.py", tmp_path_factory.mktemp("serving") / "serving.json", "ttft_p50_ms")


def trace_of(data: dict, num_requests: int, num_adapters: int, rate: float = 1.0) -> list:
    trace = data["trace"]
    return load_workloads().slora_trace(num_requests, num_adapters, rate, cv=trace["cv"], alpha=trace["alpha"],
                                        rank_mix=trace["rank_mix"], length_range=tuple(trace["length_range"]),
                                        seed=trace["seed"])


def test_throughput_structure_and_token_counts(throughput):
    assert throughput["benchmark"] == "throughput" and throughput["quick"] and throughput["device"] == "cpu"
    assert throughput["trace"]["lengths_scaled_down"]
    rows = throughput["rows"]
    counts = [r["num_adapters"] for r in rows]
    assert counts == sorted(counts) and len(counts) >= 3 and 5 in counts
    for row in rows:
        trace = trace_of(throughput, row["requests"], row["num_adapters"])
        expected = sum(r.output_len for r in trace)
        assert row["expected_output_tokens"] == expected
        assert row["slora_output_tokens"] == expected               # every request ran to its length
        assert row["distinct_adapters"] == len({r.adapter for r in trace}) <= row["num_adapters"]
        assert row["slora_req_s"] > 0 and row["slora_tok_s"] > 0
        assert row["slora_tok_s"] == pytest.approx(row["slora_req_s"] * expected / row["requests"])
        steps = row["slora_steps"][0]                                # the decode roofline report (item 6)
        assert sum(steps["tokens"].values()) >= expected                # every output token came from a step
        assert steps["decode_bytes"] > 0 and row["slora_decode_tb_s"] > 0
        assert 0 < row["slora_decode_time_share"] <= 1
        if row["peft_req_s"] is None:
            assert row["peft_status"].startswith("not measured")
        else:
            assert row["peft_status"] == "measured"
            assert row["peft_output_tokens"] == expected
            assert row["speedup_req_s"] == pytest.approx(row["slora_req_s"] / row["peft_req_s"])
    assert throughput["peft_measured_at"], "PEFT must be measured at least at the smallest count"
    kept = throughput["slora_kept"]
    assert kept["from"] == 5 and kept["to"] == max(counts) and kept["ratio"] > 0


def test_serving_structure_and_sanity(serving):
    assert serving["benchmark"] == "serving" and serving["quick"] and serving["device"] == "cpu"
    rows = serving["rows"]
    assert [r["rate"] for r in rows] == serving["trace"]["rates"] and len(rows) >= 2
    for row in rows:
        trace = trace_of(serving, row["requests"], serving["adapters"]["count"], row["rate"])
        assert row["completed"] == row["requests"] == len(trace), row["failures"]
        assert row["failures"] == []
        assert row["output_tokens"] == row["expected_output_tokens"] == sum(r.output_len for r in trace)
        assert row["req_s"] > 0 and row["tok_s"] > 0
        for metric in ("ttft_s", "tpot_s", "latency_s"):
            p = row[metric]
            assert 0 <= p["p50"] <= p["p90"] <= p["p99"], (metric, p)
        assert row["ttft_s"]["p99"] <= row["latency_s"]["p99"]
        assert 0.0 <= row["slo_attainment"] <= 1.0
        assert row["decode_tb_s"] > 0 and row["decode_pct_copy_bw"] > 0   # read from the server's /metrics
