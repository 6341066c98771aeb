"""benchmarks/beam_search.py end to end: its quick mode (slora on the CPU) as a subprocess; its vLLM mode in this
process against a stand-in `vllm` module (the real one runs on the GPU machine only); --table over both as a
subprocess; the stand-in tokenizer the vLLM mode writes; and the vLLM mode's imports. Speed is never asserted."""
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
from benchmark_modules import BENCHMARKS, load_benchmark, project_modules_on_import, run_benchmark

SCRIPT = BENCHMARKS / "beam_search.py"
QUICK_POINTS = [(8, 2), (8, 4), (16, 2), (16, 4)]         # (prompt length, width), in the rows' order
QUICK_REQUESTS, QUICK_MAX_TOKENS = 2, 4


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_benchmark(SCRIPT, *args, cwd=cwd)


def check_rows(rows: list[dict[str, Any]]) -> None:
    """One row per (prompt length, width); beam tokens/s = requests * width * max_tokens / seconds."""
    assert [(row["prompt_len"], row["width"]) for row in rows] == QUICK_POINTS
    for row in rows:
        assert row["requests"] == QUICK_REQUESTS and row["max_tokens"] == QUICK_MAX_TOKENS
        assert row["seconds"] > 0 and row["req_s"] == pytest.approx(QUICK_REQUESTS / row["seconds"])
        assert row["beam_tok_s"] == pytest.approx(QUICK_REQUESTS * row["width"] * QUICK_MAX_TOKENS / row["seconds"])


@pytest.fixture(scope="module")
def slora_run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("beam-search")
    out = folder / "beam_search_slora.json"
    run_script("--quick", "--system", "slora", "--out", str(out), cwd=folder)
    return out


def test_quick_run(slora_run):
    run = json.loads(slora_run.read_text())
    assert run["benchmark"] == "beam_search" and run["system"] == "slora" and run["partial"] is False
    assert run["engine"]["max_beam_width"] == 4 and run["engine"]["device"] == "cpu"
    check_rows(run["rows"])
    for row in run["rows"]:
        assert row["preemptions"] == 0
        # Every beam of both requests ran at once, and they held pages, fewer than the pool has.
        assert row["peak_running"] == QUICK_REQUESTS * row["width"]
        assert 0 < row["peak_kv_pages"] < row["kv_pages_total"]


# ---- the vLLM mode, against a stand-in vllm ---------------------------------------------------------------------
@dataclass
class BeamSearchParams:
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False


class FakeLLM:
    """vLLM's LLM as the script uses it: a beam_search whose best beam holds the prompt and then max_tokens tokens
    (as vLLM's BeamSearchSequence.tokens does), taking 1 ms a beam token."""
    made: list["FakeLLM"] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        FakeLLM.made.append(self)

    def beam_search(self, prompts: list[dict], params: BeamSearchParams) -> list[Any]:
        assert all(list(prompt) == ["prompt_token_ids"] for prompt in prompts) and params.ignore_eos
        time.sleep(0.001 * params.beam_width * params.max_tokens)
        return [SimpleNamespace(sequences=[SimpleNamespace(tokens=[*prompt["prompt_token_ids"],
                                                                   *[7] * params.max_tokens])])
                for prompt in prompts]


def fake_vllm() -> tuple[ModuleType, ModuleType]:
    module, sampling = ModuleType("vllm"), ModuleType("vllm.sampling_params")
    module.LLM, module.__version__ = FakeLLM, "0.26.0-stand-in"
    sampling.BeamSearchParams = BeamSearchParams
    module.sampling_params = sampling
    return module, sampling


def test_vllm_mode_and_the_table_of_both_systems(slora_run, tmp_path, monkeypatch):
    beam_search = load_benchmark("beam_search.py", "beam_search_benchmark")
    module, sampling = fake_vllm()
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    model = tmp_path / "model"
    beam_search.write_model(model)
    vllm_run = tmp_path / "beam_search_vllm.json"
    FakeLLM.made.clear()
    args = beam_search.parse_args(["--system", "vllm", "--model-dir", str(model), "--prompt-lens", "8,16",
                                   "--widths", "2,4", "--requests", "2", "--max-tokens", "4", "--max-num-seqs", "16",
                                   "--max-model-len", "64", "--out", str(vllm_run)])
    beam_search.run(args, beam_search.plan_of(args))
    kwargs = FakeLLM.made[0].kwargs
    assert kwargs["load_format"] == "dummy" and kwargs["max_logprobs"] == 8 and kwargs["max_num_seqs"] == 16
    assert "skip_tokenizer_init" not in kwargs and kwargs["tokenizer"].endswith("tokenizer")
    run = json.loads(vllm_run.read_text())
    assert run["machine_kind"] == "h100" and run["partial"] is False
    check_rows(run["rows"])
    assert all(row["preemptions"] is None for row in run["rows"])

    out = tmp_path / "beam_search.json"
    done = run_script("--table", str(slora_run), str(vllm_run), "--out", str(out), cwd=tmp_path)
    assert "slora/vllm" in done.stdout and "vllm_req_s" in done.stdout
    assert out.with_suffix(".txt").is_file()
    table = json.loads(out.read_text())
    assert [(row["prompt_len"], row["width"]) for row in table["rows"]] == QUICK_POINTS
    assert set(table["versions"]) == {"slora", "vllm"}
    for row in table["rows"]:
        assert row["slora/vllm"] == pytest.approx(row["slora_req_s"] / row["vllm_req_s"])
        assert row["goal"] == "> 1" and row["met"] == (row["slora/vllm"] > 1)


def test_goals_by_width():
    beam_search = load_benchmark("beam_search.py", "beam_search_benchmark")
    run = {"rows": [{"prompt_len": 128, "width": width, "requests": 16, "req_s": 2.0 * width} for width in (4, 16)]}
    rows = beam_search.table_rows({"slora": run, "vllm": {"rows": [{**row, "req_s": 2.0 * 4} for row in run["rows"]]}})
    assert [(row["goal"], row["slora/vllm"], row["met"]) for row in rows] == [("> 1", 1.0, False), (">= 3", 4.0, True)]
    assert beam_search.table_rows({"slora": run})[0]["met"] is None         # no vLLM run: not judged


def test_runs_of_one_system_merge_by_point(tmp_path):
    """A plan run in parts: the table has every point either part measured, the later part's where both did."""
    beam_search = load_benchmark("beam_search.py", "beam_search_benchmark")
    first = {"benchmark": "beam_search", "system": "vllm", "version": "a",
             "rows": [{"prompt_len": 128, "width": w, "req_s": 1.0} for w in (4, 16)]}
    second = {**first, "version": "b", "rows": [{"prompt_len": 128, "width": w, "req_s": 2.0} for w in (16, 64)]}
    paths = []
    for name, run in (("first", first), ("second", second)):
        paths.append(tmp_path / f"{name}.json")
        paths[-1].write_text(json.dumps(run))
    merged = beam_search.load_runs(paths)["vllm"]
    assert merged["version"] == "b"
    assert [(row["width"], row["req_s"]) for row in merged["rows"]] == [(4, 1.0), (16, 2.0), (64, 2.0)]


def test_the_stand_in_tokenizer_loads(tmp_path):
    """vLLM's beam search reads eos_token_id and decodes the final beams: the stand-in must give both."""
    transformers = pytest.importorskip("transformers")
    beam_search = load_benchmark("beam_search.py", "beam_search_benchmark")
    raw = {"vocab_size": 300, "bos_token_id": 256, "eos_token_id": 257, "max_position_embeddings": 2048}
    folder = beam_search.write_tokenizer(tmp_path / "tokenizer", raw)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder))
    assert tokenizer.eos_token_id == 257 and len(tokenizer) == 300
    assert tokenizer.decode([5, 299]) == "t5 t299"


def test_the_vllm_mode_imports_neither_slora_nor_the_benchmarks_library():
    """Under vLLM's PYTHONPATH the script imports vLLM, torch and the standard library only (kv_cache too)."""
    assert project_modules_on_import("beam_search") == []
