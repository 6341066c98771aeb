"""The README's first command: `make serve`, then a chat request through the official openai client; and what
`make serve` installs into a clean clone's venv (the runtime only) next to `make test` and `make lint` (the
development tools too)."""
import os
import signal
import subprocess
from pathlib import Path

import openai
import pytest
from conftest import free_port, wait_healthy

REPO = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 900     # a first start converts the model; a loaded 2-core machine is slow at it
ENGLISH = {"the", "is", "of", "a", "capital", "france", "paris"}


@pytest.fixture
def make_serve(tmp_path):
    if not (REPO / ".venv" / ".installed").is_file():
        pytest.fail("make serve needs the checkout's .venv: run the tests with `make test`")
    port = free_port()
    log = open(tmp_path / "serve.log", "w")
    process = subprocess.Popen(["make", "serve", f"SERVE_ARGS=--port {port}"], cwd=REPO, stdout=log,
                               stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", process, tmp_path / "serve.log", STARTUP_TIMEOUT_S)
        yield f"http://127.0.0.1:{port}"
    finally:
        if process.poll() is None:                 # make may have exited already (a failed install)
            os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
        log.close()


def test_make_serve_answers_a_chat_in_english(make_serve):
    with openai.OpenAI(base_url=f"{make_serve}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(model=model, max_tokens=32, temperature=0, messages=[
            {"role": "user", "content": "What is the capital of France?"}]).choices[0].message.content
    words = set(reply.lower().replace(".", " ").split())
    assert model == "SmolLM2-135M-Instruct" and "Paris" in reply and len(words & ENGLISH) >= 3, reply


def planned_commands(target: str, venv: Path) -> list[str]:
    """The commands `make <target>` runs for a venv that does not exist yet, as in a clean clone (make -n). Under
    `make test` this make is a sub-make, which would print its directory: --no-print-directory keeps it out."""
    result = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={venv}"], cwd=REPO,
                            capture_output=True, text=True, timeout=60, check=True)
    return result.stdout.splitlines()


def test_make_serve_installs_the_runtime_and_no_development_tools(tmp_path):
    venv = tmp_path / "venv"
    commands = planned_commands("serve", venv)
    installs = [line for line in commands if " -m pip install " in line]
    assert any(line.endswith(" -e .") for line in installs), installs
    assert not any("[dev]" in line for line in commands), commands
    assert commands[-1].startswith(f"{venv}/bin/slora serve"), commands


@pytest.mark.parametrize("target", ["test", "lint"])
def test_make_test_and_lint_add_the_development_tools_to_the_runtime(tmp_path, target):
    commands = planned_commands(target, tmp_path / "venv")
    runtime = next(i for i, line in enumerate(commands) if line.endswith(" -e ."))
    dev = next(i for i, line in enumerate(commands) if line.endswith(" -e '.[dev,ray]'"))   # the tools and Ray
    assert runtime < dev, commands
