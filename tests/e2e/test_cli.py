"""`slora generate` as a user runs it, and the commands' --help."""
import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from benchmark_modules import SUBPROCESS_TIMEOUT_S

from slora import LLM, SamplingParams
from slora.cli import main
from slora.config import CudaConfig
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


# ---- --help ------------------------------------------------------------------------------------------------------
def help_sections(command: str, capsys, monkeypatch) -> dict[str, dict[str, str]]:
    """`slora <command> --help` by section title ("options", "CUDA only"...): each option's first flag and its
    help text."""
    monkeypatch.setenv("COLUMNS", "200")         # argparse wraps at the terminal's width
    with pytest.raises(SystemExit):
        main([command, "--help"])
    sections: dict[str, dict[str, str]] = {}
    entries: dict[str, str] = {}
    flag = None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):       # a section's title
            entries, flag = sections.setdefault(line[:-1], {}), None
        elif line.startswith("  -"):                                       # an option: flags, then its help
            names, _, text = line.strip().partition("  ")
            flag = names.split()[0].rstrip(",")
            entries[flag] = text.strip()
        elif flag is not None and line.strip():                            # its help's next line
            entries[flag] = f"{entries[flag]} {line.strip()}".strip()
    return sections


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_help_says_that_each_no_flag_turns_its_feature_off(command, capsys, monkeypatch):
    sections = help_sections(command, capsys, monkeypatch)
    helps = {flag: text for entries in sections.values() for flag, text in entries.items()}
    negated = [flag for flag in helps if flag.startswith("--no-")]
    assert {"--no-enable-prefix-caching", "--no-async-scheduling", "--no-pdl"} <= set(negated), negated
    assert all(helps[flag].startswith("turn off ") for flag in negated), {flag: helps[flag] for flag in negated}
    assert helps["--no-enable-prefix-caching"].startswith("turn off prefix caching (on by default: share the KV")
    assert helps["--enforce-eager"].startswith("no CUDA graphs")     # a flag that turns a feature on says what


def test_serve_help_tells_host_and_port_and_their_defaults(capsys, monkeypatch):
    options = help_sections("serve", capsys, monkeypatch)["options"]
    assert options["--host"].startswith("address to listen on") and options["--host"].endswith("(default: 127.0.0.1)")
    assert options["--port"] == "port to listen on (default: 8000)"


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_cuda_only_options_have_a_group_of_their_own(command, capsys, monkeypatch):
    sections = help_sections(command, capsys, monkeypatch)
    cuda_fields = {f.name.replace("_", "-") for f in dataclasses.fields(CudaConfig)}
    assert {flag.removeprefix("--").removeprefix("no-") for flag in sections["CUDA only"]} == cuda_fields
    assert not any(flag.removeprefix("--").removeprefix("no-") in cuda_fields for flag in sections["options"])
    assert {"--model", "--device"} <= set(sections["options"])
