"""Chaos soak of a running `slora serve`: many concurrent requests of every kind, hostile ones among them.

The mix: completions and chats on the base model and on adapters (streamed or not, n > 1, stop strings,
seeds), clients that leave in the middle of a stream or before the answer, adapters loaded and unloaded while
requests use them, and hostile requests (out-of-range numbers, huge lists, broken JSON, lone surrogates, other
tenants' adapters, bad keys, path traversal, structured-output compile bombs, choice bombs and ambiguous
grammars), and beside it a flood of connections that send nothing from 127.0.0.2 (IdleFlood). It counts
answers by status and asserts nothing itself; the test (tests/api/test_chaos.py) and the command line report
read the result:

    python benchmarks/soak.py --url http://127.0.0.1:8000 --requests 2000 --adapters attn-r4,mlp-r8 \
        --adapter-path attn-r4 --key KEY --admin-key ADMIN_KEY
    python benchmarks/soak.py --quick [--out FILE]   # its own single-user server of slora-tiny-llama, 60 requests

A server error (5xx), a request unanswered after --request-timeout (a hang) or a pool that does not return to
its idle counts afterwards is a failure; the exit status says whether there was one.
"""
import argparse
import asyncio
import contextlib
import errno
import json
import logging
import random
import selectors
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

logger = logging.getLogger("soak")
BASE_PROMPTS = ["The quick brown fox", "Once upon a time", "Hello, how are you?", "1, 2, 3,", "Paris is"]
# Statuses a hostile request may get: refused (4xx), never a server error.
HOSTILE_BODIES: list[tuple[str, str]] = [
    ("seed-too-big", '{"model": "%(model)s", "prompt": "hi", "max_tokens": 2, "seed": 9223372036854775808}'),
    ("seed-too-small", '{"model": "%(model)s", "prompt": "hi", "max_tokens": 2, "seed": -9223372036854775809}'),
    ("seed-plus-n", '{"model": "%(model)s", "prompt": "hi", "max_tokens": 2, "n": 2, "temperature": 1,'
                    ' "seed": 9223372036854775807}'),
    ("top-k-huge", '{"model": "%(model)s", "prompt": "hi", "max_tokens": 2, "temperature": 1,'
                   ' "top_k": 9223372036854775808}'),
    ("temperature-inf", '{"model": "%(model)s", "prompt": "hi", "max_tokens": 2, "temperature": 1e999}'),
    ("lone-surrogate", '{"model": "%(model)s", "prompt": "a\\ud800b", "max_tokens": 2}'),
    ("broken-json", '{"model": "%(model)s", "prompt": '),
    ("wrong-type", '{"model": "%(model)s", "prompt": {"a": 1}, "max_tokens": 2}'),
    ("unknown-model", '{"model": "no-such-adapter", "prompt": "hi", "max_tokens": 2}'),
    ("negative-max-tokens", '{"model": "%(model)s", "prompt": "hi", "max_tokens": -1}'),
    ("token-out-of-vocab", '{"model": "%(model)s", "prompt": [1, 2, 2147483647], "max_tokens": 2}'),
]


def _many(kind: str, count: int) -> str:
    """A body with `count` items of a list that the server must refuse by size before any work."""
    if kind == "prompts":
        return json.dumps({"model": "%(model)s", "prompt": ["a"] * count, "max_tokens": 1})
    if kind == "stop_token_ids":
        return json.dumps({"model": "%(model)s", "prompt": "hi", "max_tokens": 1, "stop_token_ids": [1] * count})
    if kind == "nested":
        return '{"model": "%(model)s", "prompt": "hi", "user": ' + "[" * count + "]" * count + "}"
    return json.dumps({"model": "%(model)s", "max_tokens": 1,
                       "messages": [{"role": "user", "content": "a"}] * count})


def _structured(kind: str) -> str:
    """A structured-output attack: a regex that compiles for minutes (cut off by the compile timeout), a choice
    list over the byte bound, and a grammar whose per-token work grows as the cube of the output (ended by the
    per-token budget once min_tokens makes it grow)."""
    body: dict = {"model": "%(model)s", "prompt": "hi", "max_tokens": 2}
    if kind == "compile-bomb":
        body["structured_outputs"] = {"regex": "(a*)" * 1000}
    elif kind == "choice-bomb":
        body["structured_outputs"] = {"choice": [f"{i:04d}" + "x" * 1020 for i in range(80)]}
    else:
        body.update(max_tokens=300, min_tokens=300,
                    structured_outputs={"grammar": 'root ::= s\ns ::= s s s | s s | "a" | "aa" | ""'})
    return json.dumps(body)


HOSTILE_BODIES += [(kind, _structured(kind)) for kind in ("compile-bomb", "choice-bomb", "ambiguous-grammar")]
HOSTILE_BODIES += [("many-prompts", _many("prompts", 50_000)), ("many-stop-ids", _many("stop_token_ids", 100_000)),
                   ("nested-json", _many("nested", 50_000)), ("many-messages", _many("messages", 50_000))]


@dataclass(frozen=True)
class SoakConfig:
    url: str
    keys: list[str | None]                 # ordinary tenants' keys (None: single-user mode)
    admin_key: str | None
    base_model: str
    adapters: list[str]                    # adapter names every tenant may use
    adapter_paths: list[str]               # folders in the adapter root that tenants may load by path
    requests: int = 500
    concurrency: int = 12
    request_timeout_s: float = 300.0       # an answer later than this counts as a hang
    seed: int = 0
    idle_flood: int = 96                   # connections from 127.0.0.2 that send nothing, during the soak (IdleFlood)

    def __post_init__(self) -> None:
        if self.requests < 1 or self.concurrency < 1:
            raise ValueError("requests and concurrency must be >= 1")
        if not self.keys:
            raise ValueError("give at least one tenant key (None for single-user mode)")


@dataclass
class SoakResult:
    statuses: Counter = field(default_factory=Counter)     # "kind:status" (or client-left, dropped) -> count
    hostile_cases: Counter = field(default_factory=Counter)  # "case:status" of the hostile requests
    server_errors: list[str] = field(default_factory=list)
    hangs: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    idle_pool: dict[str, float] = field(default_factory=dict)
    idle_flood: dict[str, int] = field(default_factory=dict)   # IdleFlood.stats() of the flood beside the soak

    @property
    def requests(self) -> int:
        return sum(self.statuses.values()) + len(self.hangs)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "wall_s": round(self.wall_s, 2), "server_errors": self.server_errors,
                "hangs": self.hangs, "statuses": dict(sorted(self.statuses.items())),
                "hostile_cases": dict(sorted(self.hostile_cases.items())),
                "idle_pool": self.idle_pool, "idle_flood": self.idle_flood}


def _headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


class Soak:
    def __init__(self, config: SoakConfig) -> None:
        self.config = config
        self.rng = random.Random(config.seed)
        self.result = SoakResult()
        self.kinds: list[tuple[str, Callable[[httpx.AsyncClient, str | None], Awaitable[int | None]], int]] = [
            ("completion", self.completion, 30), ("chat", self.chat, 20), ("stream-abort", self.stream_abort, 10),
            ("wait-abort", self.wait_abort, 5), ("adapter-cycle", self.adapter_cycle, 5),
            ("hostile", self.hostile, 30)]

    def model(self) -> str:
        return self.rng.choice([self.config.base_model] + self.config.adapters)

    def sampling(self) -> dict:
        body: dict = {"max_tokens": self.rng.randint(1, 8), "n": self.rng.choice([1, 1, 2, 3])}
        if self.rng.random() < 0.5:
            body.update(temperature=0.8, seed=self.rng.randrange(2 ** 32))
        else:
            body["temperature"] = 0.0
        if self.rng.random() < 0.3:
            body["stop"] = [self.rng.choice(["a", "e", " ", "the"])]
        return body

    async def post(self, client: httpx.AsyncClient, key: str | None, path: str, body: dict,
                   stream: bool) -> int:
        if not stream:
            return (await client.post(path, json=body, headers=_headers(key))).status_code
        async with client.stream("POST", path, json=body, headers=_headers(key)) as response:
            async for _ in response.aiter_lines():
                pass
            return response.status_code

    async def completion(self, client: httpx.AsyncClient, key: str | None) -> int:
        stream = self.rng.random() < 0.5
        body = {"model": self.model(), "prompt": self.rng.choice(BASE_PROMPTS), "stream": stream, **self.sampling()}
        return await self.post(client, key, "/v1/completions", body, stream)

    async def chat(self, client: httpx.AsyncClient, key: str | None) -> int:
        stream = self.rng.random() < 0.5
        messages = [{"role": "user", "content": self.rng.choice(BASE_PROMPTS)}]
        body = {"model": self.model(), "messages": messages, "stream": stream, **self.sampling()}
        return await self.post(client, key, "/v1/chat/completions", body, stream)

    async def stream_abort(self, client: httpx.AsyncClient, key: str | None) -> int:
        """A streaming client that leaves after its first event or two."""
        body = {"model": self.model(), "prompt": self.rng.choice(BASE_PROMPTS), "max_tokens": 64, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body, headers=_headers(key)) as response:
            async for _ in response.aiter_lines():
                if self.rng.random() < 0.5:
                    break
            return response.status_code

    async def wait_abort(self, client: httpx.AsyncClient, key: str | None) -> int | None:
        """A client that gives up before the answer (None: it left, as intended)."""
        body = {"model": self.model(), "prompt": self.rng.choice(BASE_PROMPTS), "max_tokens": 64}
        try:
            response = await client.post("/v1/completions", json=body, headers=_headers(key),
                                         timeout=self.rng.uniform(0.01, 0.2))
        except httpx.TimeoutException:
            return None
        return response.status_code

    async def adapter_cycle(self, client: httpx.AsyncClient, key: str | None) -> int:
        """Load an adapter under a fresh name, use it once, unload it (the use may race the unload)."""
        if not self.config.adapter_paths:
            return await self.completion(client, key)
        name = f"soak-{self.rng.randrange(10 ** 9)}"
        load = {"name": name, "path": self.rng.choice(self.config.adapter_paths)}
        status = (await client.post("/v1/adapters", json=load, headers=_headers(key))).status_code
        if status != 200:
            return status
        use = client.post("/v1/completions", json={"model": name, "prompt": "hi", "max_tokens": 4},
                          headers=_headers(key))
        unload = client.delete(f"/v1/adapters/{name}", headers=_headers(key))
        used, unloaded = await asyncio.gather(use, unload)
        # The request either ran before the unload or found no such model.
        return used.status_code if used.status_code >= 500 else unloaded.status_code

    async def hostile(self, client: httpx.AsyncClient, key: str | None) -> int:
        name, template = self.rng.choice(HOSTILE_BODIES)
        content = template.replace("%(model)s", self.model())
        path = "/v1/chat/completions" if name == "many-messages" else "/v1/completions"
        headers = {**_headers(key), "Content-Type": "application/json"}
        if self.rng.random() < 0.1:
            headers["Authorization"] = "Bearer not-a-key"
        try:
            response = await client.post(path, content=content.encode(), headers=headers)
        except httpx.TransportError:
            self.result.hostile_cases[f"{name}:dropped"] += 1
            raise
        self.result.hostile_cases[f"{name}:{response.status_code}"] += 1
        return response.status_code

    async def one(self, client: httpx.AsyncClient, index: int) -> None:
        kind, run, _ = self.rng.choices(self.kinds, weights=[w for *_, w in self.kinds])[0]
        key = self.config.keys[index % len(self.config.keys)]
        try:
            status = await asyncio.wait_for(run(client, key), self.config.request_timeout_s)
        except asyncio.TimeoutError:
            self.result.hangs.append(f"{index}:{kind}")
            return
        except httpx.TransportError as exc:       # a connection the server dropped is a failure too
            self.result.statuses[f"{kind}:dropped"] += 1
            self.result.server_errors.append(f"{index}:{kind}: {type(exc).__name__}: {exc}")
            return
        if status is None:
            self.result.statuses[f"{kind}:client-left"] += 1
            return
        self.result.statuses[f"{kind}:{status}"] += 1
        if status >= 500:
            self.result.server_errors.append(f"{index}:{kind}: HTTP {status}")

    async def run(self) -> SoakResult:
        started = time.perf_counter()
        limits = httpx.Limits(max_connections=self.config.concurrency * 2)
        async with httpx.AsyncClient(base_url=self.config.url, timeout=self.config.request_timeout_s,
                                     limits=limits, trust_env=False) as client:
            queue = iter(range(self.config.requests))

            async def worker() -> None:
                for index in queue:
                    await self.one(client, index)
            await asyncio.gather(*(worker() for _ in range(self.config.concurrency)))
            self.result.wall_s = time.perf_counter() - started
        return self.result


def pool_is_idle(samples: dict[str, float]) -> bool:
    """No live request, no KV page, and every page accounted for by its owner."""
    owners = sum(samples[f'slora_pool_pages{{owner="{o}"}}'] for o in ("free", "cached", "adapter"))
    return (samples['slora_pool_pages{owner="kv"}'] == 0 and samples["slora_requests_inflight"] == 0
            and samples["slora_engine_requests"] == 0 and owners == samples["slora_pool_capacity_pages"])


def metric_samples(url: str, key: str | None) -> dict[str, float]:
    """Every unlabelled or labelled sample of /metrics as {'name{label="v"}': value}."""
    from prometheus_client.parser import text_string_to_metric_families
    text = httpx.get(f"{url}/metrics", headers=_headers(key), timeout=30, trust_env=False).text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples


def wait_idle(url: str, key: str | None, timeout_s: float) -> dict[str, float] | None:
    """The pool's samples once it is idle, or None if it did not get there within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        samples = metric_samples(url, key)
        if pool_is_idle(samples):
            return samples
        time.sleep(0.2)
    return None


class IdleFlood:
    """Connections that send nothing, `per_source` from each of `sources` (addresses of 127/8, which Linux routes
    over loopback, so the server sees other clients than 127.0.0.1), each reopened as soon as the server closes
    it, at most `max_rate` opens a second (None: as fast as it can), on a thread of its own while the with block
    runs. The server must keep serving its other clients as if nothing happened."""

    def __init__(self, url: str, sources: list[str], per_source: int, max_rate: float | None = None) -> None:
        parts = urlsplit(url)
        self.address = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.sources = sources
        self.per_source = per_source
        self.max_rate = max_rate
        self.counts = Counter({"opened": 0, "closed_by_server": 0, "failed": 0})
        self._open: Counter = Counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-flood", daemon=True)
        self._budget, self._refilled = 0.0, time.monotonic()

    def __enter__(self) -> "IdleFlood":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def stats(self) -> dict[str, int]:
        return {**self.counts, "open": sum(self._open.values())}

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            while not self._stop.is_set():
                self._top_up(selector)
                for key, _ in selector.select(timeout=0.02):
                    self._read(selector, key.fileobj, key.data)
        finally:
            for key in list(selector.get_map().values()):
                key.fileobj.close()
            selector.close()

    def _top_up(self, selector: selectors.BaseSelector) -> None:
        now = time.monotonic()
        if self.max_rate is not None:
            self._budget = min(self.max_rate, self._budget + (now - self._refilled) * self.max_rate)
            self._refilled = now
        for source in self.sources:
            while self._open[source] < self.per_source and (self.max_rate is None or self._budget >= 1):
                self._budget -= 1
                self._connect(selector, source)

    def _connect(self, selector: selectors.BaseSelector, source: str) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.bind((source, 0))
            error = sock.connect_ex(self.address)
        except OSError:
            error = -1
        if error not in (0, errno.EINPROGRESS):
            sock.close()
            self.counts["failed"] += 1
            return
        selector.register(sock, selectors.EVENT_READ, source)
        self._open[source] += 1
        self.counts["opened"] += 1

    def _read(self, selector: selectors.BaseSelector, sock: socket.socket, source: str) -> None:
        try:
            if sock.recv(4096):
                return                                 # an answer: read on until the server closes
        except BlockingIOError:
            return
        except OSError:
            pass
        selector.unregister(sock)
        sock.close()
        self._open[source] -= 1
        self.counts["closed_by_server"] += 1


def _flood_beside(config: SoakConfig) -> IdleFlood | contextlib.nullcontext:
    """The idle flood that runs beside the soak's clients: from 127.0.0.2 against a server on 127.0.0.1, more
    connections than one address may hold idle (64 by default), reopened at most 200 times a second."""
    if config.idle_flood < 1 or urlsplit(config.url).hostname != "127.0.0.1":
        return contextlib.nullcontext()
    return IdleFlood(config.url, ["127.0.0.2"], config.idle_flood, max_rate=200)


def soak(config: SoakConfig, idle_timeout_s: float = 120.0) -> SoakResult:
    with _flood_beside(config) as flood:
        result = asyncio.run(Soak(config).run())
    result.idle_flood = flood.stats() if flood is not None else {}
    idle = wait_idle(config.url, config.admin_key or config.keys[0], idle_timeout_s)
    result.idle_pool = {} if idle is None else {k: v for k, v in idle.items() if k.startswith("slora_pool")}
    return result


QUICK_MODEL = "slora-tiny-llama"
QUICK_ADAPTERS = ["demo-r4-attn", "demo-r16-all"]       # two of the tiny model's demo adapters
QUICK_START_TIMEOUT_S = 300.0


@contextlib.contextmanager
def own_server(log_path: str) -> Iterator[str]:
    """`slora serve` of slora-tiny-llama, single-user, on a free loopback port for the block (--quick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    command = [sys.executable, "-m", "slora.cli", "serve", "--model", QUICK_MODEL, "--port", str(port),
               "--shutdown-timeout", "5"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + QUICK_START_TIMEOUT_S
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with {process.returncode}; its log: {log_path}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5, trust_env=False).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server was not healthy after {QUICK_START_TIMEOUT_S:.0f} s; log: {log_path}")
            time.sleep(0.25)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help=f"start a single-user server of {QUICK_MODEL} and soak it with 60 requests (CI)")
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--key", action="append", default=[], help="a tenant key (repeatable; none: single-user)")
    parser.add_argument("--admin-key", default=None)
    parser.add_argument("--base-model", default="slora-tiny-llama")
    parser.add_argument("--adapters", default="", help="comma-separated adapter names tenants may use")
    parser.add_argument("--adapter-path", action="append", default=[], help="adapter-root folder to load by path")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--idle-flood", type=int, default=96,
                        help="connections from 127.0.0.2 that send nothing, held during the soak (server on 127.0.0.1)")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.quick:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="slora-soak-") as tmp, own_server(f"{tmp}/server.log") as url:
            config = SoakConfig(url, [None], None, QUICK_MODEL, QUICK_ADAPTERS, [], requests=60, concurrency=8,
                                seed=args.seed, idle_flood=8)
            result = soak(config)
    else:
        config = SoakConfig(args.url, args.key or [None], args.admin_key, args.base_model,
                            [a for a in args.adapters.split(",") if a], args.adapter_path, args.requests,
                            args.concurrency, seed=args.seed, idle_flood=args.idle_flood)
        result = soak(config)
    report = result.as_dict()
    if args.out:
        with open(args.out, "w") as out:
            json.dump(report, out, indent=1)
    sys.stdout.write(json.dumps(report, indent=1) + "\n")
    failed = result.server_errors or result.hangs or not result.idle_pool
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
