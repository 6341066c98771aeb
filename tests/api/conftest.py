"""A real `slora serve` process on 127.0.0.1 per test module, driven by the official openai client.

Servers run the tiny model (`--model slora-tiny-llama`). Adapters for the tests are made from it, into an adapter root
shared by the session; the offline `LLM` with the same adapters is the reference for token equality.
"""
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
from benchmark_modules import load_benchmark
from servers import STARTUP_TIMEOUT_S, free_port, wait_healthy, write_tenants  # noqa: F401 - the tests' names
from starlette.testclient import TestClient

from slora import LLM, SamplingParams
from slora.api.app import create_app
from slora.api.settings import ServerSettings
from slora.engine import Engine

BASE_MODEL = "slora-tiny-llama"
TEST_ADAPTERS = ["attn-r4", "mlp-r8", "all-r16"]
SOAK = load_benchmark("soak.py", "bench_soak")     # the chaos soak; its /metrics parser serves every test


@dataclass
class Server:
    url: str
    process: subprocess.Popen
    log_path: Path

    def client(self, key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120, **kwargs)

    def http(self, key: str | None = None, timeout: float = 120) -> httpx.Client:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics as {'name{label="v"}': value}, parsed by prometheus_client."""
        return SOAK.metric_samples(self.url, None)

    def wait_for(self, condition, timeout_s: float = 30.0, what: str = "condition") -> dict[str, float]:
        """Poll /metrics until `condition(samples)` holds."""
        deadline = time.monotonic() + timeout_s
        while True:
            samples = self.metrics()
            if condition(samples):
                return samples
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; metrics: "
                                     f"{ {k: v for k, v in samples.items() if k.startswith('slora_pool')} }")
            time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 60) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def adapter_files(adapter_root: Path, source: str) -> dict:
    """The two PEFT files of a test adapter, as the `files` of an upload."""
    folder = adapter_root / source
    return {"adapter_config": ("adapter_config.json", (folder / "adapter_config.json").read_bytes()),
            "adapter_model": ("adapter_model.safetensors", (folder / "adapter_model.safetensors").read_bytes())}


def wait_until(condition, what: str, timeout_s: float = 60.0) -> None:
    """Poll `condition()` until it holds; AssertionError naming `what` once `timeout_s` has passed."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def record_requests(engine: Engine) -> list:
    """A list that gets (prompt ids, SamplingParams) of every request the engine is given from now on."""
    records: list = []
    real_add = engine.add_request

    def add_request(request_id, prompt, params, *args, **kwargs):
        records.append((list(prompt), params))
        return real_add(request_id, prompt, params, *args, **kwargs)
    engine.add_request = add_request
    return records


@contextmanager
def in_process_client(engine: Engine, settings: ServerSettings) -> Iterator[TestClient]:
    """A TestClient over the app of `engine`, once its /health answers 200: the app loads its adapters after it
    starts, and a request sent before then is a 503."""
    with TestClient(create_app(engine, settings), raise_server_exceptions=False) as client:
        wait_until(lambda: client.get("/health").status_code == 200, "the app to serve")
        yield client


def start_server(log_dir: Path, *args: str, model: str | None = BASE_MODEL) -> Server:
    """`slora serve` of `model` (None: the default model) with `args`, once it answers /health. Unless `args`
    name one, the server has an adapter store of its own in `log_dir`, never the user's cache: no test
    shares adapters with another, or with a server of the user's."""
    port = free_port()
    model_args = [] if model is None else ["--model", model]
    if "--adapter-store" not in args:
        args = (*args, "--adapter-store", str(log_dir / f"adapter-store-{port}"))
    log_path = log_dir / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "slora.cli", "serve", "--host", "127.0.0.1",
                                    "--port", str(port), *model_args, *args], stdout=log,
                                   stderr=subprocess.STDOUT, env=env)
    server = Server(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(server.url, process, log_path)
    except RuntimeError:
        server.stop()
        raise
    return server


@pytest.fixture(scope="session")
def tiny_model():
    from slora.models.tiny import ensure_tiny_model
    return ensure_tiny_model()


@pytest.fixture(scope="session")
def adapter_root(tmp_path_factory, tiny_model) -> Path:
    """A folder with the test adapters, built for the tiny model."""
    from tiny import make_adapters
    root = tmp_path_factory.mktemp("adapter-root")
    make_adapters(tiny_model.model_dir, root, TEST_ADAPTERS)
    return root


@pytest.fixture(scope="session")
def offline(adapter_root) -> LLM:
    """The offline reference: the same engine settings as the servers, the same adapters by name."""
    llm = LLM(BASE_MODEL)
    for name in TEST_ADAPTERS:
        llm.load_adapter(name, str(adapter_root / name))
    return llm


@pytest.fixture(scope="module")
def client(server):
    """An OpenAI client of the test module's `server` fixture."""
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server):
    """An httpx client of the test module's `server` fixture."""
    with server.http() as h:
        yield h


def greedy(llm: LLM, prompts: list, adapter: str | None, max_tokens: int, **kwargs) -> list:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, **kwargs)
    return llm.generate(prompts, params, adapters=[adapter] * len(prompts))


def chat_ids(llm: LLM, messages: list[dict]) -> list[int]:
    """Chat prompt ids as the server builds them: the tokenizer's template, then encode without specials."""
    text = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def stream_completion(client: openai.OpenAI, extra_body: dict | None = None,
                      **kwargs) -> tuple[str, list[int], str | None]:
    """(text, token ids, finish reason) of a streamed completion with one choice."""
    text, tokens, reason = "", [], None
    extra_body = {"return_token_ids": True, **(extra_body or {})}
    for chunk in client.completions.create(stream=True, extra_body=extra_body, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.token_ids or []
            reason = choice.finish_reason or reason
    return text, tokens, reason


def assert_error_shape(body: dict, status: int) -> None:
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"}, body
    message = body["error"]["message"]
    assert "Traceback" not in message and "/work/" not in message and "/tmp/" not in message, message
    assert status != 500, body


def copy_adapter(adapter_root: Path, source: str, name: str) -> Path:
    target = adapter_root / name
    if not target.exists():
        shutil.copytree(adapter_root / source, target)
    return target
