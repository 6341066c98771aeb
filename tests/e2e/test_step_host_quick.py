"""benchmarks/step_host.py (the host's work per step by kind, issue 22) runs end to end in --quick mode on the
CPU and charges each pass's steps to the kinds its scenario makes. Speed is never asserted."""
import json
import logging
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S, load_benchmark

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def quick_run(tmp_path: Path, *flags: str) -> dict:
    """step_host.py --quick on the CPU with `flags`, in a process of its own; its JSON."""
    out = tmp_path / "step_host.json"
    command = [sys.executable, str(BENCHMARKS / "step_host.py"), "--quick", "--device", "cpu", *flags,
               "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S, check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(out.read_text())


def test_quick_run_charges_the_chunk_steps_and_the_decode_steps_to_their_kinds(tmp_path):
    result = quick_run(tmp_path)
    scenario = result["scenario"]
    assert scenario["batch"] == 4 and scenario["step_tokens"] == 32 and result["engine"]["max_num_batched_tokens"] == 32
    kinds = result["host_ms_by_kind"]
    # 2 blocks of a 96-token prompt, 28 tokens a step beside 4 decodes: 4 chunk steps, then 3 decode steps, of
    # which the pass's last launches a step whose kind the pass never sees; two timed rounds of that. The CPU
    # has no graphs: every mixed step is eager.
    assert scenario["rounds"] == 2 and scenario["prompts"] == 2 and scenario["decode_steps"] == 3
    assert {kind: row["steps"] for kind, row in kinds.items()} == {"mixed, eager (> 0 tokens)": 16, "decode": 10}
    for row in kinds.values():
        assert 0 < row["median_ms"] and row["gc_ms_per_step"] >= 0
        assert row["gpu_paced_share"] is None                       # an idle GPU paces nothing: not overlapped
        assert any("step" in r["function"] for r in row["top_cumulative"])       # engine.step, under cProfile
        phases = row["phase_mean_ms"]
        # Every CPU step is an eager forward after a schedule; no graph is replayed or staged.
        assert phases["schedule"] > 0 and phases["build_inputs"] > 0 and phases["eager_forward"] > 0
        graphed = ("graph_replay", "stage_batch", "stage_mixed_extras", "stage_send")
        assert all(phases[name] == 0 for name in graphed)
        assert phases["other"] >= 0
    medians = {kind: row["median_ms"] for kind, row in kinds.items()}
    assert result["chunk_over_decode_median"] == pytest.approx(medians["mixed, eager (> 0 tokens)"] / medians["decode"])
    assert len(result["chunk_over_decode_median_by_round"]) == 2
    # Each round's two blocks both hold chunk steps and decode steps: four block ratios.
    blocks = result["chunk_over_decode_by_block"]
    assert len(blocks) == 4 and all(ratio > 0 for ratio in blocks)
    # The median of the block ratios themselves (not of the rounds' or the pooled figures).
    assert result["chunk_over_decode_block_median"] == pytest.approx(statistics.median(blocks))
    assert min(blocks) <= result["chunk_over_decode_block_median"] <= max(blocks)
    assert result["host_only"] is False
    assert "allocate_kv_pages" not in result["phases_timed"]                   # --fine-phases only


def test_fine_phases_time_the_chunks_pages_and_hashes_apart(tmp_path):
    """--fine-phases adds the scheduler's and the allocator's parts as phases, and the sampled ids' ways: a
    chunk step takes pages and registers their hashes (28-token chunks fill pages of 16), feeds the ids the
    step before sampled and samples its own; its phases still add up to the step's."""
    result = quick_run(tmp_path, "--fine-phases")
    fine = ["admit", "allocate_kv_pages", "release_kv_pages", "on_computed", "register_hashes", "feed_tokens",
            "sample_on_device", "copy_sampled"]
    assert result["phases_timed"][-len(fine):] == fine and "schedule" in result["phases_timed"]
    chunk = result["host_ms_by_kind"]["mixed, eager (> 0 tokens)"]["phase_mean_ms"]
    assert list(chunk) == [*result["phases_timed"], "other"]
    assert chunk["allocate_kv_pages"] > 0 and chunk["register_hashes"] > 0 and chunk["on_computed"] > 0
    assert chunk["schedule"] > 0 and chunk["other"] >= 0
    assert chunk["feed_tokens"] > 0 and chunk["sample_on_device"] > 0 and chunk["copy_sampled"] > 0


def test_phase_timers_wrap_a_modules_function_and_put_it_back():
    """A phase may be a module's function (owner None), which its callers reach through the module."""
    step_host = load_benchmark("step_host.py", "step_host_module_phase")
    from slora.execution import step_batch

    original = step_batch.feed_tokens
    clock = step_host.PhaseClock({"feed_tokens": ("slora.execution.step_batch", None, "feed_tokens")})
    with step_host.phase_timers(clock):
        assert step_batch.feed_tokens is not original
        step_batch.feed_tokens(None, None)                 # no feed: nothing written
    assert step_batch.feed_tokens is original
    assert set(clock.take()) == {"feed_tokens"}


def test_block_ratios_divide_each_blocks_chunk_median_by_its_decode_median():
    step_host = load_benchmark("step_host.py", "step_host_blocks")
    chunk, decode = "mixed, graphed (<= 512 tokens)", "decode"

    def times(*blocks_and_seconds: tuple[int, float]) -> list:
        # The waits are not host work: a large one must not move a ratio.
        return [(block, step_host.StepTime(seconds, 0.0, 50.0)) for block, seconds in blocks_and_seconds]
    results = {chunk: times((0, 3.0), (0, 5.0), (1, 2.0), (2, 9.0)),
               decode: times((0, 2.0), (1, 4.0), (1, 1.0), (1, 3.0))}
    # Block 2 has no decode step: no ratio. Block 0: median 4 over 2; block 1: 2 over median 3.
    assert step_host.block_ratios(results) == pytest.approx([2.0, 2 / 3])
    assert [t.seconds for t in step_host.pooled([results, results])[decode]] == [2.0, 4.0, 1.0, 3.0] * 2
    with pytest.raises(AssertionError, match="chunk steps of several kinds"):
        step_host.block_ratios({**results, "mixed, eager (> 512 tokens)": times((0, 1.0))})


class Waiter:
    def __init__(self, events: list[float]) -> None:
        self.events = events

    def wait(self, seconds: float) -> str:
        self.events.append(seconds)
        time.sleep(seconds)
        return "done"


def test_a_steps_time_leaves_out_its_wait_for_the_gpu(monkeypatch):
    """timed_step charges the call its own work only: the seconds it spent in the clock's wait are apart, and
    a wait before the call is not charged to it."""
    step_host = load_benchmark("step_host.py", "step_host_wait_clock")
    device = types.ModuleType("fake_device")
    device.Waiter = Waiter
    monkeypatch.setitem(sys.modules, "fake_device", device)
    events, original = [], Waiter.wait
    waiter = Waiter(events)
    waits = step_host.PhaseClock({step_host.WAIT_PHASE: ("fake_device", "Waiter", "wait")})
    with step_host.phase_timers(waits):
        assert Waiter.wait is not original
        waiter.wait(0.2)                                     # before the step: not its wait

        def call():
            busy_until = time.perf_counter() + 0.01
            while time.perf_counter() < busy_until:         # 10 ms of the host's own work
                pass
            assert waiter.wait(0.05) == "done"               # the wrapped wait passes its result on
        step_time = step_host.timed_step(waits, call)
    assert Waiter.wait is original                                   # put back
    assert events == [0.2, 0.05]
    assert 0.05 <= step_time.wait_seconds < 0.2
    # Its own work: the 10 ms busy loop, not the 50 ms wait.
    assert 0.01 <= step_time.seconds < step_time.wait_seconds
    assert waits.take() == {}                                # the clock's wait all went to the step


def test_overlapped_runs_steps_back_to_back_and_reports_their_waits(tmp_path):
    """--overlapped: no synchronize and no idle before a step. On the CPU nothing runs apart from the host, so
    no step waits for a device and none is paced by one; the host's time is still charged by kind."""
    result = quick_run(tmp_path, "--overlapped")
    assert result["scenario"]["overlapped"] is True and "right after the one before" in result["method"]
    kinds = result["host_ms_by_kind"]
    assert {kind: row["steps"] for kind, row in kinds.items()} == {"mixed, eager (> 0 tokens)": 16, "decode": 10}
    for row in kinds.values():
        assert row["median_ms"] > 0 and row["wait_ms_median"] == 0 and row["gpu_paced_share"] == 0
        assert row["phase_mean_ms"]["wait_for_tokens"] == 0
    step_host = load_benchmark("step_host.py", "step_host_overlapped_args")
    assert step_host.scenario_of(step_host.parse_args(["--quick"]), "cpu").overlapped is False


def test_overlapped_refuses_an_idle(capsys):
    step_host = load_benchmark("step_host.py", "step_host_overlapped_idle")
    with pytest.raises(SystemExit):
        step_host.parse_args(["--quick", "--overlapped", "--idle-ms", "5"])
    assert "not allowed with argument --overlapped" in capsys.readouterr().err


class CountingEngine:
    """What calls_by_kind reads of an engine: each step records one decode step."""

    def __init__(self) -> None:
        self.config = SimpleNamespace(cuda=SimpleNamespace(enforce_eager=False, mixed_graph_tokens=512))
        self.step_stats = SimpleNamespace(steps={"decode": 0}, tokens={"decode": 0})

    def step(self) -> float:
        self.step_stats.steps["decode"] += 1
        self.step_stats.tokens["decode"] += 4
        return time.perf_counter()


@pytest.mark.parametrize("idle_gpu", [True, False])
def test_calls_by_kind_synchronizes_before_each_step_unless_overlapped(monkeypatch, idle_gpu):
    engine_throughput = load_benchmark("engine_throughput.py", f"engine_throughput_idle_{idle_gpu}")
    synchronized = []
    monkeypatch.setattr(engine_throughput, "synchronize", synchronized.append)
    engine = CountingEngine()
    results = engine_throughput.calls_by_kind(engine, 3, "cuda", engine.step, idle_gpu=idle_gpu)
    # Each call's result goes to the kind its step launched, recorded when the next call takes its tokens.
    assert len(results["decode"]) == 2
    assert synchronized == (["cuda"] * 3 if idle_gpu else [])


def test_host_phase_sum_leaves_the_wait_for_the_gpu_out():
    step_host = load_benchmark("step_host.py", "step_host_phase_sum")
    assert step_host.host_phase_sum({"wait_for_tokens": 5.0, "schedule": 1.0, "other": 0.5}) == 1.5


def test_host_only_forward_returns_zero_logits_without_the_model_and_is_undone():
    import torch

    from slora.execution.model_runner import ModelRunner

    step_host = load_benchmark("step_host.py", "step_host_zero_logits")
    original = ModelRunner.forward
    host = SimpleNamespace(sample_indices=torch.tensor([3, 9, 11]))
    runner = SimpleNamespace(model=None)                  # a model called would raise: None is not callable
    with step_host.zero_logits_forward(vocab=7, max_rows=4):
        logits = ModelRunner.forward(runner, host)
        one_row = ModelRunner.forward(runner, SimpleNamespace(sample_indices=torch.tensor([5])))
        with pytest.raises(AssertionError, match="5 sampled rows, the zero logits hold 4"):
            ModelRunner.forward(runner, SimpleNamespace(sample_indices=torch.arange(5)))
    assert torch.equal(logits, torch.zeros(3, 7)) and ModelRunner.forward is original
    assert torch.equal(one_row, torch.zeros(1, 7)) and one_row.data_ptr() == logits.data_ptr()   # one buffer
    # Refused before main configures logging: this process's loggers stay as the other tests left them.
    slora_level = logging.getLogger("slora").level
    with pytest.raises(SystemExit, match="--host-only runs on the CPU"):
        step_host.main(["--quick", "--device", "cuda", "--host-only"])
    assert logging.getLogger("slora").level == slora_level


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
    assert step_host.scenario_of(step_host.parse_args(["--quick", "--idle-ms", "5"]), "cpu").idle_ms == 5
    assert step_host.scenario_of(step_host.parse_args(["--quick"]), "cpu").idle_ms == 0
    with pytest.raises(SystemExit, match="--idle-ms >= 0"):
        step_host.scenario_of(step_host.parse_args(["--idle-ms", "-1"]), "cpu")


def test_the_full_prompt_fits_the_cpu_models_context():
    """slora-tiny-llama's context is 2,048 tokens: the full scenario's prompt and its output token must fit it
    on the CPU, and the GPU's 8B shape keeps the 2,048-token prompt of earlier sessions."""
    step_host = load_benchmark("step_host.py", "step_host_full_prompt")
    assert step_host.scenario_of(step_host.parse_args([]), "cpu").prompt_len + 1 <= 2048
    assert step_host.scenario_of(step_host.parse_args([]), "cuda").prompt_len == 2048
    assert step_host.scenario_of(step_host.parse_args(["--prompt-len", "1000"]), "cpu").prompt_len == 1000


def test_a_prompt_past_the_models_context_is_refused_before_the_engine_is_built(tmp_path):
    """Checked against slora-tiny-llama's own config: the CPU's default fits, one token more than the context
    holds is refused with the lengths named (before, the request check raised deep inside the first pass)."""
    step_host = load_benchmark("step_host.py", "step_host_check_fits")
    setup = step_host.prepare_model("cpu", tmp_path)
    step_host.check_fits(step_host.scenario_of(step_host.parse_args([]), "cpu"), setup)
    too_long = step_host.scenario_of(step_host.parse_args(["--prompt-len", str(setup.context)]), "cpu")
    with pytest.raises(SystemExit, match=f"sequences of {setup.context + 1} tokens .*context is {setup.context}"):
        step_host.check_fits(too_long, setup)


def test_host_work_only_runs_torch_on_one_thread_and_restores_it():
    import torch

    from slora.execution.model_runner import ModelRunner

    step_host = load_benchmark("step_host.py", "step_host_one_thread")
    threads, original = torch.get_num_threads(), ModelRunner.forward
    torch.set_num_threads(2)
    try:
        with step_host.host_work_only(vocab=7, max_rows=4):
            assert torch.get_num_threads() == 1 and ModelRunner.forward is not original
        assert torch.get_num_threads() == 2 and ModelRunner.forward is original
    finally:
        torch.set_num_threads(threads)


def test_phase_timers_put_back_what_they_wrapped_when_a_phase_is_missing():
    step_host = load_benchmark("step_host.py", "step_host_missing_phase")
    from slora.execution import step_batch

    original = step_batch.feed_tokens
    clock = step_host.PhaseClock({"feed_tokens": ("slora.execution.step_batch", None, "feed_tokens"),
                                  "missing": ("slora.execution.step_batch", None, "no_such_function")})
    with pytest.raises(AttributeError), step_host.phase_timers(clock):
        pass
    assert step_batch.feed_tokens is original


def test_gpu_paced_share_counts_the_steps_that_waited_for_the_gpu():
    step_host = load_benchmark("step_host.py", "step_host_paced")
    times = [step_host.StepTime(0.002, 0.0, wait) for wait in (0.0, 5e-6, 0.007, 0.015)]
    assert step_host.gpu_paced_share(times) == 0.5                 # the two waits of milliseconds
