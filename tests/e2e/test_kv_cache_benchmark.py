"""benchmarks/kv_cache.py end to end: its quick mode (slora on the CPU) with a BF16-shaped and an FP8 cache as
subprocesses, then --table over both; its vLLM mode in this process against a stand-in `vllm` module (the real
one runs on the GPU machine only), tabled beside slora's; and the vLLM mode's imports. Speed is never asserted."""
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

SCRIPT = BENCHMARKS / "kv_cache.py"
QUICK_CONTEXTS = [64, 128]


def run_script(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_benchmark(SCRIPT, *args, cwd=cwd)


@pytest.fixture(scope="module")
def slora_runs(tmp_path_factory) -> dict[str, Path]:
    """The quick runs' JSONs by cache dtype."""
    folder = tmp_path_factory.mktemp("kv-cache")
    runs = {}
    for dtype in ("auto", "fp8"):
        runs[dtype] = folder / f"kv_cache_slora_{dtype}.json"
        run_script("--quick", "--system", "slora", "--kv-cache-dtype", dtype, "--out", str(runs[dtype]), cwd=folder)
    return runs


def test_quick_runs_and_their_table(slora_runs, tmp_path):
    out = tmp_path / "kv_cache.json"
    done = run_script("--table", str(slora_runs["auto"]), str(slora_runs["fp8"]), "--out", str(out), cwd=tmp_path)
    assert "decode_64" in done.stdout and "fp8/auto_128" in done.stdout
    assert out.with_suffix(".txt").read_text().count("slora") >= 2
    table = json.loads(out.read_text())
    rows = {row["cache"]: row for row in table["rows"]}
    assert set(rows) == {"float32", "float8_e4m3fn"}                # the CPU model's dtype, and FP8
    auto, fp8 = rows["float32"], rows["float8_e4m3fn"]
    assert fp8["capacity_tokens"] > auto["capacity_tokens"] > 0
    for context in QUICK_CONTEXTS:
        assert auto[f"decode_{context}"] > 0 and fp8[f"decode_{context}"] > 0
        assert fp8[f"T2_{context}"] > fp8[f"T1_{context}"] > 0
        assert fp8[f"fp8/auto_{context}"] > 0 and auto[f"fp8/auto_{context}"] is None
    for dtype, path in slora_runs.items():
        run = json.loads(path.read_text())
        assert run["partial"] is False and run["engine"]["enable_prefix_caching"] is False
        assert run["engine"]["kv_cache_dtype"] == dtype and run["engine"]["max_model_len"] == 128 + 4 + 1
        assert [row["context"] for row in run["rows"]] == QUICK_CONTEXTS
        for row in run["rows"]:
            assert row["gen_tok_s"] > 0 and row["peak_running"] == row["seqs_fit"] == 4 and row["preemptions"] == 0
            assert row["slora_steps"]["steps"]["decode"] > 0


# ---- the vLLM mode, against a stand-in vllm ---------------------------------------------------------------------
@dataclass
class SamplingParams:
    max_tokens: int
    temperature: float
    ignore_eos: bool
    detokenize: bool


class FakeLLM:
    """vLLM's LLM as the script uses it: a cache of 16 blocks (auto) or 32 (fp8) of 16 tokens, and a generate that
    takes 2 ms a generated token."""
    made: list["FakeLLM"] = []

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs
        blocks = 32 if kwargs["kv_cache_dtype"] == "fp8" else 16
        cache = SimpleNamespace(num_gpu_blocks=blocks, block_size=16)
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=cache))
        FakeLLM.made.append(self)

    def generate(self, prompts: list[dict], params: SamplingParams, use_tqdm: bool = True) -> list[Any]:
        assert use_tqdm is False and all(list(prompt) == ["prompt_token_ids"] for prompt in prompts)
        assert params.temperature == 0 and params.ignore_eos and not params.detokenize
        time.sleep(0.002 * params.max_tokens)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7] * params.max_tokens)]) for _ in prompts]


def fake_vllm() -> ModuleType:
    module = ModuleType("vllm")
    module.LLM, module.SamplingParams, module.__version__ = FakeLLM, SamplingParams, "0.26.0-stand-in"
    return module


def test_vllm_mode_and_the_table_of_both_systems(slora_runs, tmp_path, monkeypatch):
    kv_cache = load_benchmark("kv_cache.py", "kv_cache_benchmark")
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm())
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "NVIDIA H100 80GB HBM3")
    model = tmp_path / "model"
    kv_cache.write_model(model)
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == kv_cache.MODEL_POSITIONS
    FakeLLM.made.clear()
    runs = {}
    for dtype in ("auto", "fp8"):
        runs[dtype] = tmp_path / f"kv_cache_vllm_{dtype}.json"
        args = kv_cache.parse_args(["--system", "vllm", "--kv-cache-dtype", dtype, "--model-dir", str(model),
                                    "--contexts", "64,128", "--num-seqs", "4", "--decode-tokens", "4",
                                    "--out", str(runs[dtype])])
        kv_cache.run(args, kv_cache.plan_of(args))
    assert [llm.kwargs["kv_cache_dtype"] for llm in FakeLLM.made] == ["auto", "fp8"]
    kwargs = FakeLLM.made[0].kwargs
    assert kwargs["load_format"] == "dummy" and kwargs["enable_prefix_caching"] is False
    assert kwargs["max_model_len"] == 128 + 4 + 1 and kwargs["max_num_seqs"] == 4
    fp8 = json.loads(runs["fp8"].read_text())
    assert fp8["capacity_tokens"] == 32 * 16 and fp8["kv_bytes_per_token"] == 2 * 32 * 8 * 128
    assert fp8["hbm_bandwidth_bytes_per_s"] == 3.35e12
    for row in fp8["rows"]:
        assert row["seqs_fit"] == min(4, 512 // (row["context"] + 4)) and row["decode_tok_s"] > 0
        assert row["roofline_decode_tok_s"] > 0 and row["peak_running"] is None

    table = kv_cache.write_table([*slora_runs.values(), *runs.values()], tmp_path / "kv_cache.json")
    assert [(row["system"], row["cache"]) for row in table["rows"]] == [
        ("slora", "float32"), ("slora", "float8_e4m3fn"), ("vllm", "bfloat16"), ("vllm", "float8_e4m3fn")]
    slora_fp8 = table["rows"][1]
    assert all(slora_fp8[f"slora/vllm_{c}"] > 0 and slora_fp8[f"fp8/auto_{c}"] > 0 for c in QUICK_CONTEXTS)
    assert all(row[f"slora/vllm_{c}"] is None for row in table["rows"][2:] for c in QUICK_CONTEXTS)
    goals = {(goal["context"], goal["goal"]): goal for goal in table["goals"]}
    assert goals[128, "slora fp8/vllm fp8 > 1"]["value"] > 0
    assert goals[128, "vllm fp8/auto >= 1.6"]["met"] is not None          # vLLM's auto cache fits 1 of 4
    assert goals[64, "slora fp8/auto >= 1.6"]["met"] is None               # slora's fits all 4: not judged


def test_vllm_capacity_falls_back_to_none(caplog):
    kv_cache = load_benchmark("kv_cache.py", "kv_cache_benchmark")
    engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(
        num_gpu_blocks=None, block_size=16, kv_cache_size_tokens=4096)))
    assert kv_cache.vllm_capacity_tokens(SimpleNamespace(llm_engine=engine)) == 4096
    engine.vllm_config.cache_config = SimpleNamespace(num_gpu_blocks=None, block_size=16)
    assert kv_cache.vllm_capacity_tokens(SimpleNamespace(llm_engine=engine)) is None
    assert kv_cache.vllm_capacity_tokens(SimpleNamespace()) is None
    assert "capacity not recorded" in caplog.text


def test_the_vllm_mode_imports_neither_slora_nor_the_benchmarks_library():
    """Under vLLM's PYTHONPATH the script imports vLLM, torch and the standard library only."""
    assert project_modules_on_import("kv_cache") == []
