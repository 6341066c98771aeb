"""benchmarks/step_host.py (the host's work per step by kind, issue 22) runs end to end in --quick mode on the
CPU and charges each pass's steps to the kinds its scenario makes. Speed is never asserted."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S, load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_quick_run_charges_the_chunk_steps_and_the_decode_steps_to_their_kinds(tmp_path):
    out = tmp_path / "step_host.json"
    command = [sys.executable, str(BENCHMARKS / "step_host.py"), "--quick", "--device", "cpu", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    scenario = result["scenario"]
    assert scenario["batch"] == 4 and scenario["step_tokens"] == 32 and result["engine"]["max_num_batched_tokens"] == 32
    kinds = result["host_ms_by_kind"]
    # 2 prompts of 96 tokens, 28 a step beside 4 decodes: 7 chunk steps, then 6 decode calls of which the last
    # launches a step whose kind the pass never sees; two timed rounds of that. The CPU has no graphs: every
    # mixed step is eager.
    assert scenario["rounds"] == 2
    assert {kind: row["steps"] for kind, row in kinds.items()} == {"mixed, eager (> 0 tokens)": 14, "decode": 10}
    for row in kinds.values():
        assert 0 < row["median_ms"] and row["gc_ms_per_step"] >= 0
        assert any("step" in r["function"] for r in row["top_cumulative"])       # engine.step, under cProfile
        phases = row["phase_mean_ms"]
        # Every CPU step is an eager forward after a schedule; no graph is replayed or staged.
        assert phases["schedule"] > 0 and phases["build_inputs"] > 0 and phases["eager_forward"] > 0
        graphed = ("graph_replay", "stage_batch", "stage_mixed_extras", "stage_send")
        assert all(phases[name] == 0 for name in graphed)
        assert phases["other"] >= 0
    assert result["graphed_mixed_over_decode_median"] is None
    assert result["graphed_mixed_over_decode_median_by_round"] == [None, None]
    assert result["graphed_mixed_over_decode_phase_pass_mean"] is None


def test_after_idle_sleeps_before_the_call_and_passes_its_result_on(monkeypatch):
    step_host = load_benchmark("step_host.py", "step_host_idle")
    events = []
    monkeypatch.setattr(step_host.time, "sleep", lambda seconds: events.append(("sleep", seconds)))

    def call():
        events.append(("call",))
        return 7
    assert step_host.after_idle(20.0, call)() == 7
    assert events == [("sleep", 0.02), ("call",)]
    assert step_host.after_idle(0.0, call) is call                # no idle: the call itself, nothing wrapped


def test_idle_ms_reaches_the_scenario_and_a_negative_one_is_refused():
    step_host = load_benchmark("step_host.py", "step_host_idle_args")
    assert step_host.scenario_of(step_host.parse_args(["--quick", "--idle-ms", "5"])).idle_ms == 5
    assert step_host.scenario_of(step_host.parse_args(["--quick"])).idle_ms == 0
    with pytest.raises(SystemExit, match="--idle-ms >= 0"):
        step_host.scenario_of(step_host.parse_args(["--idle-ms", "-1"]))
