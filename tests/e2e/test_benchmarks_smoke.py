"""Every benchmark script runs end to end in its quick mode, as a subprocess, and writes what the README says it
writes: its table on stdout and its JSON with the documented keys and positive figures. Speed is never asserted.
The CUDA cases are marked gpu (skipped on a CPU-only machine)."""
import json
import os
import subprocess
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import pytest
import torch
from benchmark_modules import BENCHMARKS, SUBPROCESS_TIMEOUT_S

VLLM_WORKLOADS = ["decode_base", "decode_32_adapters", "prefill", "mixed_base", "mixed_32_adapters", "slora_trace"]
SIMULATE_KEYS = {"policy", "page_size", "watermark", "budget_gb", "mean_batch", "utilisation", "tokens_per_s",
                 "preemptions", "recomputed_tokens", "mean_end_waste"}
ABLATION_KEYS = {"variant", "adapter_fraction", "num_adapters", "mean_batch", "tokens_per_s", "adapter_loads",
                 "adapter_evictions", "preemptions", "load_s"}
LIGHT_TENANTS = ["light-1", "light-2", "light-3"]
HOST_UNITS = {"python_dict_1000", "python_list_comp_64", "numpy_array_from_list_64", "numpy_slots_512",
              "torch_cpu_add_512"}


def check_simulate(stdout: str, rows: Any) -> None:
    assert "mean_batch" in stdout
    assert rows and all(set(row) == SIMULATE_KEYS for row in rows)
    assert {row["policy"] for row in rows} == {"reserve", "oracle", "paged"}
    for row in rows:
        assert row["mean_batch"] > 0 and row["tokens_per_s"] > 0 and 0 < row["utilisation"] <= 1
    for budget in {row["budget_gb"] for row in rows}:         # paging holds more than reservation
        reserve = next(r for r in rows if r["budget_gb"] == budget and r["policy"] == "reserve")
        assert all(r["mean_batch"] > reserve["mean_batch"] for r in rows
                   if r["budget_gb"] == budget and r["policy"] == "paged" and r["page_size"] == 16)


def check_ablation(stdout: str, rows: Any) -> None:
    assert "mean_batch" in stdout
    assert rows and all(set(row) == ABLATION_KEYS for row in rows)
    assert {row["variant"] for row in rows} == {"unified", "partitioned"}
    for count in {row["num_adapters"] for row in rows}:
        at_count = [r for r in rows if r["num_adapters"] == count]
        unified = next(r for r in at_count if r["variant"] == "unified")
        assert unified["tokens_per_s"] > 0 and all(unified["mean_batch"] >= r["mean_batch"] for r in at_count)


def check_kernel_bench(stdout: str, data: Any) -> None:
    assert "speedup" in stdout and data["rows"]
    assert all(row["name"] and row["time_us"] > 0 for row in data["rows"])


def check_sharing(stdout: str, data: Any) -> None:
    assert "peak_kv_pages" in stdout
    rows = {(row["workload"], row["mode"]): row for row in data["rows"]}
    cached, plain = rows["system prompt", "prefix cache"], rows["system prompt", "no sharing"]
    assert cached["prompt_tokens_computed"] < plain["prompt_tokens_computed"]
    assert cached["peak_kv_pages"] < plain["peak_kv_pages"]
    for n in (4, 8):
        fork, separate = rows[f"n={n}", "copy-on-write fork"], rows[f"n={n}", "separate requests"]
        assert fork["peak_kv_pages"] < separate["peak_kv_pages"]
        assert fork["output_tokens"] == separate["output_tokens"] == 16 * n
    assert all(row["tokens_per_s"] > 0 for row in rows.values())


def check_vllm_workloads(stdout: str, data: Any) -> None:
    assert "gen_tok_s" in stdout and "slora_trace" in stdout
    assert data["benchmark"] == "engine_throughput" and data["partial"] is False
    assert data["engine"]["max_num_seqs"] == 256 and data["engine"]["max_loras"] == 32
    rows = data["rows"]
    assert [row["workload"] for row in rows] == VLLM_WORKLOADS
    for row in rows:
        assert row["gen_tokens"] > 0 and row["wall_s"] > 0 and row["gen_tok_s"] > 0 and row["req_s"] > 0
        assert row["vllm_gen_tok_s"] > 0
        assert sum(row["steps"]["tokens"].values()) >= row["gen_tokens"]     # every token came from a step
        if row["workload"] != "slora_trace":
            assert row["gen_tokens"] == row["requests"] * row["output_len"]
    if data["device"] == "cpu":
        assert all(row["vs_vllm"] is None for row in rows)                  # a ratio only off full-size CUDA runs


def check_adapter_sweep(stdout: str, data: Any) -> None:
    assert "slora_req_s" in stdout and data["rows"] == []
    sweep = data["adapter_sweep"]
    assert [row["num_adapters"] for row in sweep["rows"]] == sweep["counts"] == [1, 5, 20]
    for row in sweep["rows"]:
        assert row["slora_req_s"] > 0 and row["slora_output_tokens"] == row["expected_output_tokens"]
        assert row["slora_decode_tb_s"] > 0 and 0 < row["slora_decode_time_share"] <= 1
        if row["peft_req_s"] is not None:
            assert row["peft_status"] == "measured" and row["speedup_req_s"] > 0
    assert 1 in sweep["peft_measured_at"] and sweep["slora_kept"]["ratio"] > 0


def check_smollm2_peft(stdout: str, data: Any) -> None:
    assert "peft_tok_s" in stdout
    section = data["smollm2_peft"]
    assert len(section["adapters"]) == 3 and [row["batch"] for row in section["rows"]] == [1, 4]
    for row in section["rows"]:
        assert row["slora_tok_s"] > 0 and row["peft_tok_s"] > 0 and row["ratio"] > 0


def check_serving(stdout: str, data: Any) -> None:
    assert "ttft_p50_ms" in stdout
    rows = data["rows"]
    assert [row["rate"] for row in rows] == data["trace"]["rates"] and len(rows) >= 2
    for row in rows:
        assert row["completed"] == row["requests"] > 0 and row["failures"] == []
        assert row["output_tokens"] == row["expected_output_tokens"] and row["req_s"] > 0
        for metric in ("ttft_s", "tpot_s", "latency_s"):
            assert 0 <= row[metric]["p50"] <= row[metric]["p90"] <= row[metric]["p99"], metric
        assert 0 <= row["slo_attainment"] <= 1 and row["decode_tb_s"] > 0     # the last from /metrics


def check_step_host(stdout: str, data: Any) -> None:
    assert "median_ms" in stdout
    kinds = data["host_ms_by_kind"]
    chunk = [kind for kind in kinds if kind.startswith("mixed")]
    assert "decode" in kinds and len(chunk) == 1, sorted(kinds)
    for row in kinds.values():
        assert row["steps"] > 0 and row["median_ms"] > 0 and row["phase_mean_ms"]["schedule"] > 0
    assert data["chunk_over_decode_median"] > 0 and data["chunk_over_decode_block_median"] > 0


def check_step_host_speed(stdout: str, data: Any) -> None:
    check_step_host(stdout, data)
    speed = data["host_speed"]
    assert set(speed["units_us"]) == HOST_UNITS and all(us > 0 for us in speed["units_us"].values())
    assert speed["host"]["usable_cores"] >= 1 and (speed["iterations"], speed["repeats"]) == (20, 1)


def check_tensor_parallel(stdout: str, data: Any) -> None:
    assert "lora_comm_pct" in stdout
    rows = data["rows"]
    assert {(row["tp"], row["scheme"]) for row in rows} == {(1, "-"), (2, "replicated A"), (2, "fully sharded")}
    for row in rows:
        assert row["gen_tok_s"] > 0 and row["tok_s"] > row["gen_tok_s"]
        assert (row["comm_pct"] > 0) == (row["tp"] == 2)                        # the base all-reduces, profiled
        assert (row["lora_comm_pct"] > 0) == (row["scheme"] == "fully sharded")  # only that scheme sends LoRA


def check_soak(stdout: str, data: Any) -> None:
    assert json.loads(stdout) == data                        # the report, on stdout too
    assert data["requests"] == 60 and data["server_errors"] == [] and data["hangs"] == []
    assert data["idle_pool"], "the pool did not return to its idle counts"
    statuses = data["statuses"]
    assert statuses.get("completion:200", 0) + statuses.get("chat:200", 0) > 0
    assert all(400 <= int(key.split(":")[1]) < 500 for key in statuses if key.startswith("hostile:"))


def check_ptx_loads(stdout: str, data: Any) -> None:
    assert "registers" in stdout
    assert {row["kernel"] for row in data["rows"]} == {"shrink", "expand"}
    assert all(row["registers"] > 0 and row["programs_per_sm"] > 0 for row in data["rows"])


def check_decode(stdout: str, data: Any) -> None:
    assert "pct_roofline" in stdout and data["rows"]
    assert all(row["step_ms"] > 0 and row["pct_roofline"] > 0 for row in data["rows"])


def check_prefill(stdout: str, data: Any) -> None:
    assert data["rows"] and all(row["us"] > 0 for row in data["rows"])
    assert data["summary"]["step_ms"] > 0


def check_fairness_run(stdout: str, data: Any) -> None:
    """Both policies served every request of one trace, and vtc kept two backlogged tenants within VTC's bound."""
    assert "light_ttft_p99_s" in stdout and "vtc:heavy" in stdout
    assert set(data["policies"]) == {"fcfs", "vtc"} and data["trace"]["tenants"] == ["heavy", *LIGHT_TENANTS]
    requests = data["trace"]["requests"]
    assert requests["heavy"] > max(requests[t] for t in LIGHT_TENANTS) > 0
    for row in data["policies"].values():
        assert row["gen_tok_s"] > 0 and row["total_tok_s"] > row["gen_tok_s"]
        assert sum(row["served_tokens"][-1]) == row["prompt_tokens"] + row["generated_tokens"]   # all served
        assert 0 <= row["light_ttft_s"]["p50"] <= row["light_ttft_s"]["p99"]
    assert data["policies"]["vtc"]["max_gap"]["value"] <= data["bound"]["value"]
    assert data["summary"]["vtc_gap_within_bound"] is True


def check_fairness_sim(stdout: str, data: Any) -> None:
    """The simulation is deterministic: under vtc the light tenants wait far less, the heavy one more, the gap
    of first come first served passes the bound, and throughput stays."""
    check_fairness_run(stdout, data)
    fcfs, vtc = data["policies"]["fcfs"], data["policies"]["vtc"]
    assert data["summary"]["light_p99_fcfs_over_vtc"] >= 5
    assert vtc["heavy_ttft_s"]["p50"] > fcfs["heavy_ttft_s"]["p50"]
    assert fcfs["max_gap"]["value"] > data["bound"]["value"]
    assert data["summary"]["gen_tok_s_vtc_over_fcfs"] >= 0.97


def check_kv_quality(stdout: str, data: Any) -> None:
    assert "ppl_delta_pct" in stdout
    rows = {row["config"]: row for row in data["rows"]}
    assert set(rows) == {"auto", "fp8"} and rows["auto"]["token_match"] == 1.0
    for row in rows.values():
        assert row["ppl"] > 1 and 0 <= row["token_match"] <= 1 and 0 <= row["forced_top1"] <= 1
    assert rows["fp8"]["kv_token_capacity"] > rows["auto"]["kv_token_capacity"] > 0


def check_beam_memory(stdout: str, data: Any) -> None:
    assert "saving_pct" in stdout
    rows = {row["width"]: row for row in data["rows"]}
    assert set(rows) == {2, 4, 6}
    # Shared pages never exceed full copies, and wider searches share more of their history.
    assert all(0 < r["shared_page_steps"] < r["unshared_page_steps"] for r in rows.values())
    assert rows[2]["saving_pct"] < rows[4]["saving_pct"] < rows[6]["saving_pct"]


def check_beam_memory_model(stdout: str, data: Any) -> None:
    """The default model's beams on the engine: the saving is measured from its pages, not drawn."""
    assert data["model"] and data["device"] == "cpu"
    [row] = data["rows"]
    assert row["width"] == 4 and row["requests"] == 3 and row["mean_output"] > 0
    assert 0 < row["shared_page_steps"] < row["unshared_page_steps"]
    assert row["saving_pct"] > 0


class Case(NamedTuple):
    script: str
    args: tuple[str, ...]
    check: Callable[[str, Any], None]
    gpu: bool = False


CASES = {
    "simulate": Case("simulate.py", ("--quick",), check_simulate),
    "ablation": Case("ablation.py", ("--quick",), check_ablation),
    "kernel_bench": Case("kernel_bench.py", ("--quick",), check_kernel_bench),
    "sharing": Case("sharing.py", ("--quick",), check_sharing),
    "engine_throughput": Case("engine_throughput.py", ("--quick", "--device", "cpu"), check_vllm_workloads),
    "engine_throughput-adapter_sweep": Case("engine_throughput.py", ("--quick", "--device", "cpu", "--workloads",
                                                                     "adapter_sweep"), check_adapter_sweep),
    "engine_throughput-smollm2_peft": Case("engine_throughput.py", ("--quick", "--device", "cpu", "--workloads",
                                                                    "smollm2_peft"), check_smollm2_peft),
    "serving": Case("serving.py", ("--quick", "--device", "cpu"), check_serving),
    "step_host": Case("step_host.py", ("--quick", "--device", "cpu", "--host-speed"), check_step_host_speed),
    "soak": Case("soak.py", ("--quick",), check_soak),
    "ptx_loads": Case("ptx_loads.py", ("--quick",), check_ptx_loads),
    "fairness": Case("fairness.py", ("--quick",), check_fairness_sim),
    "fairness-engine": Case("fairness.py", ("--quick", "--engine", "gpu", "--device", "cpu"), check_fairness_run),
    "kv_quality": Case("kv_quality.py", ("--quick",), check_kv_quality),
    "beam_memory": Case("beam_memory.py", ("--quick",), check_beam_memory),
    "beam_memory-model": Case("beam_memory.py", ("--model", "--quick", "--widths", "4"), check_beam_memory_model),
    "tensor_parallel": Case("tensor_parallel.py", ("--quick",), check_tensor_parallel),
    "decode-cuda": Case("decode.py", ("--quick",), check_decode, gpu=True),
    "prefill-cuda": Case("prefill.py", ("--quick",), check_prefill, gpu=True),
    "engine_throughput-cuda": Case("engine_throughput.py", ("--quick", "--device", "cuda"), check_vllm_workloads,
                                   gpu=True),
    "step_host-cuda": Case("step_host.py", ("--quick", "--device", "cuda"), check_step_host, gpu=True),
}


def env() -> dict[str, str]:
    """torch on one thread in each script: on a loaded 2-core machine two processes' thread pools, spinning
    against each other, make a quick run 10-20 times slower; the servers they start inherit it."""
    environ = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    return {"OMP_NUM_THREADS": "1", **environ}


GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", [pytest.param(name, marks=GPU if case.gpu else []) for name, case in CASES.items()])
def test_quick_run_prints_its_table_and_writes_its_json(name, tmp_path):
    case = CASES[name]
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / case.script), *case.args, "--out", str(out)],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, env=env(), cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-4000:]
    case.check(done.stdout, json.loads(out.read_text()))


# Scripts whose quick run is elsewhere: replicas.py joins the Ray cluster of tests/cluster.
SMOKED_ELSEWHERE = {"replicas.py": "tests/cluster/test_replicas_benchmark.py",
                    "kv_cache.py": "tests/e2e/test_kv_cache_benchmark.py",
                    "beam_search.py": "tests/e2e/test_beam_search_benchmark.py"}


def test_every_script_has_a_case():
    """A new script under benchmarks/ gets a quick run here (or where SMOKED_ELSEWHERE says); the libraries
    (common, memsim, workloads) have none."""
    scripts = {str(path.relative_to(BENCHMARKS)) for path in BENCHMARKS.rglob("*.py")}
    assert scripts - {case.script for case in CASES.values()} - set(SMOKED_ELSEWHERE) == \
        {"common.py", "memsim.py", "workloads.py"}
    assert all((BENCHMARKS.parent / test).is_file() for test in SMOKED_ELSEWHERE.values())
