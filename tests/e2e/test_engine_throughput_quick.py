"""benchmarks/engine_throughput.py (issue 22's six workloads) runs end to end in its --quick mode on the CPU, as
CI runs it, and writes the rows it promises. Speed is never asserted, only the structure and the token counts."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S, load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
WORKLOADS = ["decode_base", "decode_32_adapters", "prefill", "mixed_base", "mixed_32_adapters", "slora_trace"]


@pytest.fixture(scope="module")
def result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("engine_throughput") / "engine_throughput.json"
    script = BENCHMARKS / "engine_throughput.py"
    command = [sys.executable, str(script), "--quick", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "gen_tok_s" in done.stdout and "slora_trace" in done.stdout          # the table
    return json.loads(out.read_text())


def test_context_fields(result):
    assert result["benchmark"] == "engine_throughput" and result["quick"] and result["device"] == "cpu"
    assert result["machine"] and result["date"] and result["model"]
    assert result["partial"] is False
    assert result["engine"]["max_num_seqs"] == 256 and result["engine"]["max_loras"] == 32
    assert result["engine"]["max_lora_rank"] == 16
    assert 0 < result["trace"]["alpha"] < 1                                     # power law, not uniform


def test_every_workload_ran_every_token(result):
    rows = result["rows"]
    assert [r["workload"] for r in rows] == WORKLOADS
    for row in rows:
        assert row["requests"] > 0 and row["gen_tokens"] > 0
        assert row["wall_s"] > 0 and row["gen_tok_s"] > 0 and row["req_s"] > 0
        assert row["gen_tok_s"] == pytest.approx(row["gen_tokens"] / row["wall_s"])
        assert row["vllm_gen_tok_s"] > 0 and row["vs_vllm"] is None             # no ratio off a full-size GPU run
        assert sum(row["steps"]["tokens"].values()) >= row["gen_tokens"]       # every token came from a step
        if row["workload"] != "slora_trace":
            assert row["gen_tokens"] == row["requests"] * row["output_len"]
    by_name = {r["workload"]: r for r in rows}
    assert by_name["prefill"]["output_len"] == 1 and by_name["prefill"]["vllm_req_s"] == 42
    assert by_name["decode_base"]["adapters"] == by_name["mixed_base"]["adapters"] == 0
    many = result["sizes"]["many_adapters"]
    for name in ("decode_32_adapters", "mixed_32_adapters"):
        assert by_name[name]["adapters"] == min(many, by_name[name]["requests"])
        assert by_name[name]["adapter_set"]["rank"] == 16 and len(by_name[name]["adapter_set"]["targets"]) == 7


def test_trace_row_matches_its_generator(result):
    trace = result["trace"]
    workloads = load_benchmark("workloads.py", "bench_workloads_engine")
    requests = workloads.slora_trace(trace["num_requests"], trace["num_adapters"], 1.0, cv=trace["cv"],
                                     alpha=trace["alpha"], length_range=tuple(trace["length_range"]),
                                     seed=trace["seed"])
    row = result["rows"][-1]
    assert row["requests"] == len(requests)
    assert row["gen_tokens"] == sum(r.output_len for r in requests)
    assert row["prompt_tokens"] == sum(r.prompt_len for r in requests)
    assert row["adapters"] == len({r.adapter for r in requests})
    assert row["adapter_set"]["rank"] == 8 and row["adapter_set"]["targets"] == ["q_proj", "k_proj", "v_proj", "o_proj"]


def test_host_time_by_kind_charges_each_call_to_the_step_it_launched():
    """Call i launches step i and takes step i-1's tokens (which is when step i-1's kind is recorded): the
    first call, which launched the prefill, is charged to the prefill, the next ones to decodes; the second
    pass (under cProfile) names the functions of its decode calls."""
    from slora import LLM, SamplingParams
    from slora.models.builtin import TINY_MODEL

    bench = load_benchmark("engine_throughput.py", "bench_engine_throughput")
    engine = LLM(TINY_MODEL).engine
    for i in range(2):
        engine.add_request(f"r{i}", list(range(3, 23)), SamplingParams(max_tokens=8, temperature=0,
                                                                         ignore_eos=True), stream=False)
    by_kind = bench.host_ms_by_kind(engine, 3, "cpu")
    assert {kind: row["steps"] for kind, row in by_kind.items()} == {"prefill, eager (> 0 tokens)": 1, "decode": 1}
    assert by_kind["prefill, eager (> 0 tokens)"]["top_own_time"] == []      # the profiled pass had none
    functions = [row["function"] for row in by_kind["decode"]["top_own_time"]]
    assert functions and all(row["tottime_ms_per_step"] >= 0 for row in by_kind["decode"]["top_own_time"])
    assert by_kind["decode"]["median_ms"] > 0
