"""`slora serve --tensor-parallel-size 2` on the CPU: it serves the greedy tokens of one rank, and when a rank's
process is killed, even while idle, it says so on /health at once, refuses requests fast, and stops its other
rank."""
import os
import signal
import time
from pathlib import Path

import httpx
from conftest import BASE_MODEL, start_server, wait_until

from slora import LLM, SamplingParams

PROMPT = "Hello, how are you today?"


def rank_processes(parent: int) -> list[int]:
    """The children of `parent` that multiprocessing spawned (the tensor-parallel ranks)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            cmdline = (status.parent / "cmdline").read_bytes()
        except OSError:                   # a process that ended meanwhile
            continue
        if int(fields.get("PPid", "0")) == parent and b"spawn_main" in cmdline:
            pids.append(int(status.parent.name))
    return pids


def completion(url: str, **fields) -> httpx.Response:
    return httpx.post(f"{url}/v1/completions", timeout=60,
                      json={"model": BASE_MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0,
                            "return_token_ids": True, **fields})


def test_two_ranks_serve_and_a_killed_rank_stops_the_server_fast(tmp_path):
    expected = LLM(BASE_MODEL).generate(PROMPT, SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    server = start_server(tmp_path, "--tensor-parallel-size", "2")
    try:
        response = completion(server.url)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["token_ids"] == expected
        [rank] = rank_processes(server.process.pid)
        os.kill(rank, signal.SIGKILL)
        # Idle, the server finds out by itself (no request needs to fail first), then refuses at once.
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=10).status_code == 503, "/health to say 503",
                   timeout_s=20)
        began = time.monotonic()
        failed = completion(server.url, max_tokens=64)
        assert failed.status_code == 503 and time.monotonic() - began < 5, failed.text
        assert server.process.poll() is None                     # the server answers: it did not hang or die
        wait_until(lambda: not rank_processes(server.process.pid), "no rank left behind")
    finally:
        server.stop()
    assert "tensor-parallel rank 1 ended (exit code -9)" in server.log_path.read_text()
