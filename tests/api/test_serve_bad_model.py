"""A `--model` that cannot load ends `slora serve` as every other start error does: exit status 2 and one line on
stderr saying what is wrong, instead of a server that answers 503 forever. What can be seen in the folder is
refused before the port is bound; what only the load finds ends the server once the engine has failed."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import free_port
from safetensors.torch import save_file
from torch import zeros

START_ERROR_S = 15        # a start error is told at once: the imports, then the check
LOAD_ERROR_S = 300        # a load error comes after the server's start, on a loaded machine slowly
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TINY_CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 8, "num_attention_heads": 2,
               "intermediate_size": 8, "num_hidden_layers": 1, "vocab_size": 16}


def serve(model: str, cwd: Path, timeout_s: float) -> tuple[subprocess.CompletedProcess, float]:
    """`slora serve --model <model>` on a free loopback port, run until it exits; with the seconds it took."""
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "slora.cli", "serve", "--model", model, "--host", "127.0.0.1",
                             "--port", str(free_port()), "--adapter-store", str(cwd / "store")],
                            cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
    return result, time.monotonic() - start


def missing(tmp_path: Path) -> str:
    return str(tmp_path / "no-such-model")


def hub_id(tmp_path: Path) -> str:
    return HUB_ID          # relative to the working directory, tmp_path, where no such folder is


def empty_folder(tmp_path: Path) -> str:
    (tmp_path / "empty").mkdir()
    return str(tmp_path / "empty")


def adapter_folder(tmp_path: Path) -> str:
    folder = tmp_path / "my-adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8}))
    return str(folder)


@pytest.mark.parametrize("make_model, expected", [
    (missing, ["no such folder", "local model folder"]),
    (hub_id, ["no such folder", "does not download Hub ids", "no network", "local folder"]),
    (empty_folder, ["folder has no config.json"]),
    (adapter_folder, ["LoRA adapter folder", "adapter_config.json", "--lora-modules"]),
], ids=["missing-folder", "hub-id", "no-config-json", "adapter-folder"])
def test_a_model_that_cannot_load_ends_the_start_with_one_line(tmp_path, make_model, expected):
    model = make_model(tmp_path)
    result, seconds = serve(model, tmp_path, timeout_s=60)
    lines = result.stderr.splitlines()
    assert result.returncode == 2 and len(lines) == 1, result.stderr[-3000:]
    assert lines[0].startswith(f"slora: error: --model {model}: "), lines[0]
    assert all(part in lines[0] for part in expected), lines[0]
    assert seconds < START_ERROR_S, f"{seconds:.1f} s: {lines[0]}"


def test_a_missing_folder_is_not_called_a_hub_id(tmp_path):
    line = serve(missing(tmp_path), tmp_path, timeout_s=60)[0].stderr
    assert "Hub" not in line and "config.json" in line, line


def test_weights_that_do_not_load_stop_the_server_with_one_last_line(tmp_path):
    """config.json is good and the weights file is there, so only the load finds that the weights are not the
    model's: the server, up by then, stops instead of answering 503."""
    folder = tmp_path / "wrong-weights"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(TINY_CONFIG))
    save_file({"model.embed_tokens.weight": zeros(16, 8)}, str(folder / "model.safetensors"))
    result, _ = serve(str(folder), tmp_path, timeout_s=LOAD_ERROR_S)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2, result.stderr[-3000:]
    assert last.startswith("slora: error: the model could not be loaded: checkpoint is missing weights"), last
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
