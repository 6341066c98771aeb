"""Online serving on S-LoRA's trace: the HTTP server driven in real time by streaming
clients at several request rates.

For each rate R: `workloads.slora_trace` (seed 42, Gamma arrivals with rate R and CV `--cv`, adapter
popularity `--alpha`), every request sent at its arrival time as a streaming `POST /v1/completions`
(random prompt token ids, `max_tokens` = its output length, greedy, `ignore_eos`, `return_token_ids` so
each streamed token is counted). Per request the client measures, from the moment it sends the request:
time to first token (TTFT), time per output token after the first (TPOT = (end - first token) /
(tokens - 1)) and end-to-end latency. Reported per rate: throughput (completed requests and output tokens
per second of the run, from the first send to the last completion), TTFT / TPOT / latency p50, p90, p99,
and SLO attainment: the share of all sent requests whose first token arrived within `--slo-ttft` (6 s).
A request that fails, or is still running at the hard time limit (then cancelled), counts as a miss.

The server is a subprocess on 127.0.0.1 (`python -m slora.cli serve --adapter-root DIR ...`; on CUDA the
Llama-3-8B-shaped dummy model is served through the same `slora.api.server.serve` by this script, since
the CLI has no `--load-format`), stopped with SIGTERM then killed, whatever happens; or `--url` of a
running loopback server. N adapters are written into the adapter root and loaded through
`POST /v1/adapters`.

CPU mode (default without CUDA): slora-tiny-llama, lengths scaled down to [8, 64], 100 adapters,
rates 2, 4, 8, 16, 24 req/s with 30 s of arrivals each (at most 480 requests), about 3 minutes (stated in
the JSON). The client shares the machine with the server. GPU mode: lengths [8, 512], 100 adapters.

`--engine-arg KEY=VALUE` (repeatable) sets an EngineConfig or CudaConfig field of the server started here:
`--engine-arg async_scheduling=false --engine-arg mixed_graph_tokens=0` serves with the synchronous engine
and eager mixed steps, for a before and after of those two on one machine.

    python benchmarks/serving.py [--quick] [--device cpu|cuda] [--rates 1,2,4] [--url URL]
                                 [--engine-arg KEY=VALUE ...] [--out FILE]
"""
import argparse
import asyncio
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import httpx
import numpy as np
from common import (
    ATTENTION,
    MLP,
    SLORA_LENGTHS,
    ModelSetup,
    adapter_name,
    add_engine_arg,
    bandwidth_columns,
    default_out,
    make_prompts,
    prepare_model,
    print_table,
    pyplot,
    save_figure,
    write_adapters,
    write_json,
)
from workloads import Request, adapter_ranks, slora_trace

from slora.models.builtin import TINY_MODEL

if TYPE_CHECKING:
    from slora.config import EngineConfig

logger = logging.getLogger("benchmarks.serving")
LOOPBACK = "127.0.0.1"
STARTUP_TIMEOUT_S = 300.0
PERCENTILES = (50, 90, 99)


@dataclass(frozen=True)
class Settings:
    device: str
    rates: tuple[float, ...]
    duration_s: float                 # seconds of arrivals per rate (requests = rate x duration, capped)
    max_requests: int
    time_limit_s: float               # hard limit per rate, from the first arrival
    num_adapters: int
    length_range: tuple[int, int]
    rank_mix: bool
    targets: tuple[str, ...]
    max_num_seqs: int
    slo_ttft_s: float
    quick: bool
    url: str | None
    cv: float = 1.0
    alpha: float = 1.0
    seed: int = 42
    engine_args: tuple[tuple[str, Any], ...] = ()     # (EngineConfig or CudaConfig field, value) for the server

    def num_requests(self, rate: float) -> int:
        return max(1, min(self.max_requests, round(rate * self.duration_s)))


def settings_from_args(args: argparse.Namespace) -> Settings:
    import torch
    if args.url and args.engine_arg:
        raise ValueError("--engine-arg configures the server this script starts; a --url server has its own")
    check_engine_args(args.engine_arg)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device != "cpu"
    if args.quick:
        rates, duration, cap, limit, adapters, lengths = (2.0, 8.0), 3.0, 24, 30.0, 5, (8, 16)
    elif gpu:
        rates, duration, cap, limit, adapters, lengths = (2.0, 4.0, 8.0, 16.0), 30.0, 600, 120.0, 100, SLORA_LENGTHS
    else:
        rates, duration, cap, limit, adapters, lengths = (2.0, 4.0, 8.0, 16.0, 24.0), 30.0, 480, 120.0, 100, (8, 64)
    if args.rates:
        rates = tuple(float(r) for r in args.rates.split(","))
    if args.lengths:
        low, high = (int(x) for x in args.lengths.split(","))
        lengths = (low, high)
    targets = ATTENTION + MLP if args.targets == "all" else tuple(args.targets.split(","))
    return Settings(device, rates, args.duration or duration, args.max_requests or cap, args.time_limit or limit,
                    args.num_adapters or adapters, lengths, args.rank_mix, targets,
                    args.max_num_seqs or (16 if args.quick else 64), args.slo_ttft, args.quick, args.url,
                    engine_args=tuple(args.engine_arg))


# ---- the server ---------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((LOOPBACK, 0))
        return sock.getsockname()[1]


def check_loopback(url: str) -> str:
    host = urlparse(url).hostname
    if host not in (LOOPBACK, "localhost", "::1"):
        raise ValueError(f"--url must be a loopback address (127.0.0.1), got {url}")
    return url.rstrip("/")


def server_command(setup: ModelSetup, settings: Settings, port: int, adapter_root: Path) -> list[str]:
    from slora.cli import engine_flags
    common = ["--host", LOOPBACK, "--port", str(port), "--adapter-root", str(adapter_root), "--device",
              setup.device, "--max-num-seqs", str(settings.max_num_seqs), "--max-lora-rank",
              str(max(64 if settings.rank_mix else 8, 8 if setup.dummy else 16)),
              "--max-model-len", str(2 * settings.length_range[1] + 16), "--shutdown-timeout", "5"]
    if not setup.dummy:
        return [sys.executable, "-m", "slora.cli", "serve", "--model", TINY_MODEL, *common,
                *engine_flags(dict(settings.engine_args))]
    # The CLI cannot serve random weights (no --load-format): this script's child mode does.
    return [sys.executable, str(Path(__file__).resolve()), "--serve-child", "--model", str(setup.folder), *common,
            *(f"--engine-arg={key}={json.dumps(value)}" for key, value in settings.engine_args)]


# EngineConfig fields the script sets from its own options (or for the model it serves).
SCRIPT_ENGINE_FIELDS = ("model", "device", "load_format", "max_num_seqs", "max_lora_rank", "max_model_len")


def check_engine_args(engine_args: list[tuple[str, Any]]) -> None:
    """Refuse, before any server starts, an --engine-arg that this script sets itself, that is no engine
    option, or that has no value (slora.cli.engine_flags)."""
    from slora.cli import engine_flags
    for key, _ in engine_args:
        if key in SCRIPT_ENGINE_FIELDS:
            raise ValueError(f"--engine-arg {key}: set by this script (its own options, or the model it serves)")
    try:
        engine_flags(dict(engine_args))
    except ValueError as error:
        raise ValueError(f"--engine-arg {error}") from None


def wait_healthy(url: str, process: subprocess.Popen, log_path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(trust_env=False, timeout=5) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}:\n{tail(log_path)}")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
    raise RuntimeError(f"the server did not become healthy in {timeout_s:.0f} s:\n{tail(log_path)}")


def tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no server log)"


def stop_server(process: subprocess.Popen, timeout_s: float = 30.0) -> int | None:
    """SIGTERM, then kill if it does not exit in time."""
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("the server did not stop within %.0f s of SIGTERM: killing it", timeout_s)
            process.kill()
            return process.wait()
    return process.returncode


@contextmanager
def running_server(setup: ModelSetup, settings: Settings, adapter_root: Path, log_path: Path) -> Iterator[str]:
    """A server subprocess on a free loopback port for the duration of the block; always stopped."""
    port = free_port()
    command = server_command(setup, settings, port, adapter_root)
    logger.info("starting the server: %s", " ".join(command))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    previous = signal.signal(signal.SIGTERM, _interrupt)       # a SIGTERM to this script still stops the server
    try:
        url = f"http://{LOOPBACK}:{port}"
        wait_healthy(url, process, log_path, STARTUP_TIMEOUT_S)
        yield url
    finally:
        code = stop_server(process)
        signal.signal(signal.SIGTERM, previous)
        logger.info("server stopped (exit status %s)", code)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def load_adapters(url: str, count: int) -> float:
    """POST /v1/adapters for a0..a{count-1} (folders of the same names in the adapter root); seconds taken."""
    start = time.perf_counter()
    with httpx.Client(base_url=url, trust_env=False, timeout=300) as client:
        for index in range(count):
            name = adapter_name(index)
            response = client.post("/v1/adapters", json={"name": name, "path": name})
            if response.status_code != 200:
                raise RuntimeError(f"loading adapter {name} failed: {response.status_code} {response.text[:500]}")
    return time.perf_counter() - start


# ---- one request ------------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    index: int
    expected_tokens: int
    scheduled: float                  # arrival, seconds after the start of the run
    sent: float | None = None         # seconds after the start of the run
    first_token: float | None = None
    end: float | None = None
    tokens: int = 0
    status: str = "pending"           # ok | http error | stream error | timeout

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None or self.sent is None else self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2:
            return None
        return (self.end - self.first_token) / (self.tokens - 1)

    @property
    def latency(self) -> float | None:
        return self.end - self.sent if self.ok else None


def completion_body(request: Request, prompt: list[int]) -> dict[str, Any]:
    return {"model": adapter_name(request.adapter), "prompt": prompt, "max_tokens": request.output_len,
            "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True}


async def stream_one(client: httpx.AsyncClient, body: dict[str, Any], result: RequestResult, t0: float) -> None:
    """Send one streaming completion at its arrival time and record when its tokens come."""
    await asyncio.sleep(max(0.0, t0 + result.scheduled - time.perf_counter()))
    result.sent = time.perf_counter() - t0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            result.status = f"http {response.status_code}"
            await response.aread()
            return
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                result.status = f"stream error: {event['error'].get('message', '')[:200]}"
                return
            count = sum(len(c.get("token_ids") or []) for c in event.get("choices", []))
            if count and result.first_token is None:
                result.first_token = time.perf_counter() - t0
            result.tokens += count
    result.end = time.perf_counter() - t0
    result.status = "ok" if result.tokens == result.expected_tokens else \
        f"short: {result.tokens} of {result.expected_tokens} tokens"


async def replay(url: str, trace: list[Request], prompts: list[list[int]], time_limit_s: float) -> list[RequestResult]:
    """Every request at its arrival time; what still runs at the time limit is cancelled (a miss)."""
    results = [RequestResult(i, r.output_len, r.arrival - trace[0].arrival) for i, r in enumerate(trace)]
    limits = httpx.Limits(max_connections=len(trace) + 8, max_keepalive_connections=len(trace) + 8)
    timeout = httpx.Timeout(time_limit_s + 30, connect=30)
    async with httpx.AsyncClient(base_url=url, trust_env=False, limits=limits, timeout=timeout) as client:
        t0 = time.perf_counter()
        tasks = [asyncio.create_task(stream_one(client, completion_body(r, p), res, t0))
                 for r, p, res in zip(trace, prompts, results)]
        _, pending = await asyncio.wait(tasks, timeout=time_limit_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for task, result in zip(tasks, results):
        if task in pending:
            result.status = "timeout"
        elif task.exception() is not None:
            result.status = f"client error: {type(task.exception()).__name__}: {task.exception()}"[:300]
    return results


# ---- summary ------------------------------------------------------------------------------------------------
def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {f"p{q}": None for q in PERCENTILES}
    points = np.percentile(np.asarray(values), PERCENTILES)
    return {f"p{q}": float(v) for q, v in zip(PERCENTILES, points)}


def summarize(rate: float, trace: list[Request], results: list[RequestResult], slo_ttft_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    sent = [r.sent for r in results if r.sent is not None]
    span = max((r.end for r in done), default=0.0) - min(sent, default=0.0)
    tokens = sum(r.tokens for r in done)
    within = sum(1 for r in done if r.ttft is not None and r.ttft <= slo_ttft_s)
    failures = sorted({r.status for r in results if not r.ok})
    return {
        "rate": rate, "requests": len(results), "completed": len(done),
        "expected_output_tokens": sum(r.output_len for r in trace), "output_tokens": tokens,
        "distinct_adapters": len({r.adapter for r in trace}),
        "arrival_span_s": trace[-1].arrival - trace[0].arrival, "duration_s": span,
        "req_s": len(done) / span if span > 0 else 0.0, "tok_s": tokens / span if span > 0 else 0.0,
        "ttft_s": percentiles([r.ttft for r in done]),
        "tpot_s": percentiles([r.tpot for r in done if r.tpot is not None]),
        "latency_s": percentiles([r.latency for r in done]),
        "slo_attainment": within / len(results),
        "max_send_lag_s": max((r.sent - r.scheduled for r in results if r.sent is not None), default=0.0),
        "failures": failures,
    }


def run_rate(url: str, settings: Settings, rate: float, vocab_size: int) -> dict[str, Any]:
    trace = slora_trace(settings.num_requests(rate), settings.num_adapters, rate, cv=settings.cv,
                        alpha=settings.alpha, rank_mix=settings.rank_mix, length_range=settings.length_range,
                        seed=settings.seed)
    prompts = make_prompts(trace, vocab_size, seed=settings.seed * 1000 + int(rate * 1000))
    logger.info("rate %.2f req/s: %d requests over %.1f s", rate, len(trace), trace[-1].arrival - trace[0].arrival)
    before = decode_counters(url)
    results = asyncio.run(replay(url, trace, prompts, settings.time_limit_s))
    row = summarize(rate, trace, results, settings.slo_ttft_s)
    row.update(decode_roofline(before, decode_counters(url)))
    logger.info("rate %.2f: %d/%d completed, TTFT p50 %s s", rate, row["completed"], row["requests"],
                row["ttft_s"]["p50"])
    return row


def decode_counters(url: str) -> dict[str, float]:
    """The server's decode-step counters from /metrics: seconds and bytes to read."""
    wanted = {'slora_engine_step_seconds_total{kind="decode"}': "seconds", "slora_engine_decode_bytes_total": "bytes"}
    with httpx.Client(base_url=url, trust_env=False, timeout=30) as client:
        text = client.get("/metrics").text
    values = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name in wanted:
            values[wanted[name]] = float(value)
    return values


def decode_roofline(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """Achieved bandwidth of the decode steps during one rate (bytes they had to read / their time), and its
    percentage of the H200's 4.24 TB/s copy bandwidth."""
    seconds = after.get("seconds", 0.0) - before.get("seconds", 0.0)
    return bandwidth_columns(after.get("bytes", 0.0) - before.get("bytes", 0.0), seconds, "decode")


def warm_up(url: str, vocab_size: int) -> None:
    """One short request on the base model and one on an adapter, not measured."""
    with httpx.Client(base_url=url, trust_env=False, timeout=120) as client:
        models = client.get("/v1/models").json()["data"]
        base = models[0]["id"]
        for model in (base, adapter_name(0)):
            body = {"model": model, "prompt": [3, 4, 5, 6], "max_tokens": 2, "temperature": 0, "ignore_eos": True}
            response = client.post("/v1/completions", json=body)
            if response.status_code != 200:
                raise RuntimeError(f"warm-up on {model} failed: {response.status_code} {response.text[:300]}")


def benchmark(url: str, settings: Settings, vocab_size: int, adapters_loaded_s: float) -> list[dict[str, Any]]:
    warm_up(url, vocab_size)
    rows = []
    for rate in settings.rates:
        rows.append(run_rate(url, settings, rate, vocab_size))
        time.sleep(1.0)        # let cancelled requests (if any) be aborted before the next rate
    for row in rows:
        row["adapter_load_s"] = adapters_loaded_s
    return rows


def run(settings: Settings, workdir: Path, log_path: Path) -> tuple[ModelSetup, list[dict[str, Any]]]:
    setup = prepare_model(settings.device, workdir)
    if settings.url:
        url = check_loopback(settings.url)
        logger.info("using the server at %s (its adapter root must hold a0..a%d)", url, settings.num_adapters - 1)
        return setup, benchmark(url, settings, setup.vocab_size, load_adapters(url, settings.num_adapters))
    root = workdir / "adapter-root"
    write_adapters(root, setup, adapter_ranks(settings.num_adapters, settings.rank_mix), settings.targets)
    with running_server(setup, settings, root, log_path) as url:
        loaded_s = load_adapters(url, settings.num_adapters)
        logger.info("loaded %d adapters through the API in %.1f s", settings.num_adapters, loaded_s)
        return setup, benchmark(url, settings, setup.vocab_size, loaded_s)


# ---- output -------------------------------------------------------------------------------------------------
def table_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    def ms(value: float | None) -> Any:
        return "-" if value is None else 1000 * value
    return [{"rate": r["rate"], "requests": r["requests"], "completed": r["completed"], "req_s": r["req_s"],
             "tok_s": r["tok_s"], "ttft_p50_ms": ms(r["ttft_s"]["p50"]), "ttft_p90_ms": ms(r["ttft_s"]["p90"]),
             "ttft_p99_ms": ms(r["ttft_s"]["p99"]), "tpot_p50_ms": ms(r["tpot_s"]["p50"]),
             "tpot_p90_ms": ms(r["tpot_s"]["p90"]), "tpot_p99_ms": ms(r["tpot_s"]["p99"]),
             "lat_p50_s": r["latency_s"]["p50"] if r["latency_s"]["p50"] is not None else "-",
             "slo_6s": r["slo_attainment"],
             "decode_TB_s": r["decode_tb_s"] if r.get("decode_tb_s") is not None else "-"} for r in rows]


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    if plt is None:
        return
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = ((axes[0], "ttft_s", "time to first token (s)"), (axes[1], "tpot_s", "time per output token (ms)"))
    for ax, key, label in panels:
        scale = 1000 if key == "tpot_s" else 1
        for q, style in zip(PERCENTILES, ("o-", "s--", "^:")):
            points = [(x, r[key][f"p{q}"] * scale) for x, r in zip(rates, rows) if r[key][f"p{q}"] is not None]
            if points:
                ax.plot(*zip(*points), style, label=f"p{q}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend()
    axes[2].plot(rates, [r["req_s"] for r in rows], "s--", label="throughput (req/s)")
    axes[2].plot(rates, rates, ":", color="gray", label="offered rate")
    axes[2].set_xlabel("request rate (req/s)")
    axes[2].set_ylabel("completed requests/s")
    axes[2].set_ylim(bottom=0)
    axes[2].grid(True, alpha=0.3)
    slo = axes[2].twinx()
    slo.plot(rates, [r["slo_attainment"] for r in rows], "o-", color="tab:red", label="SLO attainment (TTFT <= 6 s)")
    slo.set_ylim(0, 1.05)
    slo.set_ylabel("SLO attainment")
    lines = axes[2].get_lines() + slo.get_lines()
    axes[2].legend(lines, [line.get_label() for line in lines], fontsize=8, loc="lower right")
    fig.suptitle(title, fontsize=9)
    save_figure(fig, path, dpi=120)


def payload(settings: Settings, setup: ModelSetup, rows: list[dict[str, Any]], seconds: float) -> dict[str, Any]:
    scaled = settings.length_range != SLORA_LENGTHS
    return {
        "benchmark": "serving", "device": settings.device, "quick": settings.quick, "model": setup.description,
        "server": settings.url or "subprocess on 127.0.0.1 (slora serve)",
        "trace": {"generator": "workloads.slora_trace", "rates": list(settings.rates),
                  "arrivals_per_rate_s": settings.duration_s, "max_requests_per_rate": settings.max_requests,
                  "length_range": list(settings.length_range), "lengths_scaled_down": scaled,
                  "note": ("input and output lengths scaled down from S-LoRA's [8, 512] for the CPU" if scaled
                           else "S-LoRA's lengths"),
                  "cv": settings.cv, "alpha": settings.alpha, "rank_mix": settings.rank_mix, "seed": settings.seed},
        "adapters": {"count": settings.num_adapters, "targets": list(settings.targets),
                     "ranks": "mixed {8,16,32,64}" if settings.rank_mix else 8,
                     "loaded_through": "POST /v1/adapters"},
        "max_num_seqs": settings.max_num_seqs, "engine_args": dict(settings.engine_args),
        "time_limit_per_rate_s": settings.time_limit_s,
        "slo_ttft_s": settings.slo_ttft_s,
        "method": {
            "client": "asyncio + httpx, one streaming POST /v1/completions per request sent at its arrival time "
                      "(random prompt token ids, max_tokens = output length, greedy, ignore_eos, return_token_ids)",
            "ttft": "first streamed token - send time", "tpot": "(last token - first token) / (tokens - 1)",
            "latency": "last token - send time",
            "throughput": "completed requests (output tokens) / (last completion - first send)",
            "slo_attainment": "requests whose first token came within slo_ttft_s / all requests sent "
                              "(failures and requests cancelled at the time limit count as misses)",
            "percentiles": "numpy.percentile (linear) over completed requests",
        },
        "wall_seconds": seconds,
        "rows": rows,
    }


# ---- the server child (CUDA, random weights) ----------------------------------------------------------------
def serve_child(args: argparse.Namespace) -> int:
    """Serve a config-only model with random weights (load_format="dummy") through slora.api.server.serve."""
    from slora.api.server import serve
    from slora.api.settings import ServerSettings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = ServerSettings(host=args.host, port=args.port, adapter_root=args.adapter_root,
                              shutdown_timeout_s=args.shutdown_timeout)
    return serve(settings, child_engine_config(args))


def child_engine_config(args: argparse.Namespace) -> "EngineConfig":
    """The CUDA child's engine: the model's config with random weights, its --engine-arg fields on top."""
    from slora.config import engine_config

    return engine_config(model=args.model, device=args.device, load_format="dummy", max_num_seqs=args.max_num_seqs,
                         max_lora_rank=args.max_lora_rank, max_model_len=args.max_model_len, **dict(args.engine_arg))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="CI sizes: 5 adapters, 2 rates, under a minute")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--url", default=None, help="a running loopback server instead of a subprocess")
    parser.add_argument("--rates", default=None, help="comma-separated request rates (req/s)")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate")
    parser.add_argument("--max-requests", type=int, default=None, help="cap on requests per rate")
    parser.add_argument("--time-limit", type=float, default=None, help="hard limit per rate (s)")
    parser.add_argument("--num-adapters", type=int, default=None)
    parser.add_argument("--lengths", default=None, help="LOW,HIGH input and output lengths")
    parser.add_argument("--rank-mix", action="store_true")
    parser.add_argument("--targets", default=",".join(ATTENTION), help="comma-separated modules, or 'all'")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--slo-ttft", type=float, default=6.0)
    add_engine_arg(parser, "async_scheduling=false")
    parser.add_argument("--out", default=None)
    child = parser.add_argument_group("internal: the CUDA server child")
    child.add_argument("--serve-child", action="store_true", help=argparse.SUPPRESS)
    for flag in ("--model", "--host", "--adapter-root"):
        child.add_argument(flag, default=None, help=argparse.SUPPRESS)
    for flag in ("--port", "--max-lora-rank", "--max-model-len"):
        child.add_argument(flag, type=int, default=None, help=argparse.SUPPRESS)
    child.add_argument("--shutdown-timeout", type=float, default=5.0, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_child:
        return serve_child(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    settings = settings_from_args(args)
    out = Path(args.out) if args.out else default_out("serving", settings.device)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="slora-serving-") as tmp:
        setup, rows = run(settings, Path(tmp), Path(tmp) / "server.log")
    print_table(table_rows(rows))
    write_json(out, payload(settings, setup, rows, time.perf_counter() - start))
    plot(rows, out.with_suffix(".png"), f"{setup.description}; {settings.num_adapters} adapters, lengths "
         f"{list(settings.length_range)}, {settings.device}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
