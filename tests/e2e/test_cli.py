"""`slora generate` as a user runs it."""
import subprocess
import sys
from pathlib import Path

from benchmark_modules import SUBPROCESS_TIMEOUT_S

from slora import LLM, SamplingParams
from slora.models.builtin import TINY_MODEL


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "slora.cli", "generate", "--model", TINY_MODEL, *args],
                          capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)


def test_generate_with_a_demo_adapter_prints_the_offline_completion():
    result = run_cli("--adapter", "demo-r8-mlp", "--max-tokens", "6", "Hello there")
    assert result.returncode == 0, result.stderr
    expected = LLM(TINY_MODEL).generate(["Hello there"], SamplingParams(max_tokens=6, temperature=0),
                                        adapters=["demo-r8-mlp"])[0]
    assert f"'Hello there' -> {expected.text!r} [{expected.finish_reason}]" in result.stdout


def test_unknown_adapter_is_a_clear_error_not_a_traceback():
    result = run_cli("--adapter", "no-such-adapter", "Hi")
    assert result.returncode == 2
    assert "adapter 'no-such-adapter' does not exist" in result.stderr
    assert "Traceback" not in result.stderr


def test_generate_chat_sends_each_prompt_through_the_chat_template():
    result = run_cli("--chat", "--max-tokens", "5", "Hello there")
    assert result.returncode == 0, result.stderr
    llm, params = LLM(TINY_MODEL), SamplingParams(max_tokens=5, temperature=0)
    expected = llm.chat([{"role": "user", "content": "Hello there"}], params)[0]
    plain = llm.generate(["Hello there"], params)[0]
    assert f"'Hello there' -> {expected.text!r} [{expected.finish_reason}]" in result.stdout
    assert expected.prompt_token_ids != plain.prompt_token_ids


def test_slora_run_inside_the_checkout_leaves_transformers_its_own_kernels_package():
    """In the repository root the working directory is first on sys.path, where kernels/ (slora.kernels)
    would stand in for Hugging Face's `kernels`, which transformers' model code imports."""
    root = Path(__file__).resolve().parents[2]
    # `-c` puts the working directory on sys.path as "": each entry is compared as the folder it names.
    code = ("import sys; from pathlib import Path; import slora, transformers.modeling_utils; "
            "assert all(Path(entry or '.').resolve() != Path.cwd() for entry in sys.path), sys.path")
    result = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                            timeout=SUBPROCESS_TIMEOUT_S)
    assert result.returncode == 0, result.stderr
