"""Prometheus metrics in the text exposition format (version 0.0.4), written without a client library.

Request-level counters and histograms are updated on the event loop thread; engine-level values are
read from the snapshot the engine thread publishes, so a scrape never waits for a step.
"""
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from slora.api.async_engine import AsyncEngine
from slora.outputs import EngineSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


def _header(name: str, kind: str, help_text: str) -> list[str]:
    return [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]


@dataclass
class Counter:
    name: str                     # without the _total suffix
    help: str
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        self.values[key] = self.values.get(key, 0.0) + amount

    def render(self) -> list[str]:
        lines = _header(self.name, "counter", self.help)
        values = self.values or {(): 0.0}
        lines += [f"{self.name}_total{_labels(k)} {_number(v)}" for k, v in sorted(values.items())]
        return lines


@dataclass
class Histogram:
    name: str
    help: str
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.buckets):
            if value <= bound:
                self.counts[i] += 1
        self.total += value
        self.count += 1

    def render(self) -> list[str]:
        lines = _header(self.name, "histogram", self.help)
        for bound, cumulative in zip(self.buckets, self.counts):
            lines.append(f'{self.name}_bucket{{le="{_number(bound)}"}} {cumulative}')
        lines.append(f'{self.name}_bucket{{le="+Inf"}} {self.count}')
        lines.append(f"{self.name}_sum {_number(self.total)}")
        lines.append(f"{self.name}_count {self.count}")
        return lines


def gauge(name: str, help_text: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    return _header(name, "gauge", help_text) + [f"{name}{_labels(k)} {_number(v)}" for k, v in samples]


def snapshot_counter(name: str, help_text: str, value: float) -> list[str]:
    return _header(name, "counter", help_text) + [f"{name}_total {_number(value)}"]


def labelled_counter(name: str, help_text: str, label: str, values: Mapping[str, float]) -> list[str]:
    return _header(name, "counter", help_text) + [f"{name}_total{_labels(((label, key),))} {_number(value)}"
                                                  for key, value in sorted(values.items())]


class ServerMetrics:
    """All metrics of one server (one per app: no module-level state)."""

    def __init__(self) -> None:
        self.requests = Counter("slora_requests", "Finished HTTP generation requests by outcome.")
        self.prompt_tokens = Counter("slora_prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = Counter("slora_generation_tokens", "Generated tokens of finished requests.")
        self.errors = Counter("slora_http_errors", "Error responses by HTTP status.")
        self.adapter_registrations = Counter("slora_adapter_registrations", "Adapters loaded through the API.")
        self.ttft = Histogram("slora_time_to_first_token_seconds", "Time to first token.", LATENCY_BUCKETS)
        self.tpot = Histogram("slora_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.", TOKEN_LATENCY_BUCKETS)
        self.e2e = Histogram("slora_e2e_request_latency_seconds", "End-to-end request latency.", LATENCY_BUCKETS)
        self.adapter_load = Histogram("slora_adapter_load_seconds",
                                      "Time to read, validate, pack and register an adapter.", LOAD_BUCKETS)

    def render(self, engine: AsyncEngine, queued: int, inflight: int) -> str:
        lines: list[str] = []
        for metric in (self.requests, self.prompt_tokens, self.generation_tokens, self.errors,
                       self.adapter_registrations, self.ttft, self.tpot, self.e2e, self.adapter_load):
            lines += metric.render()
        lines += gauge("slora_engine_up", "1 while the engine loop is serving.",
                       [((), 1.0 if engine.accepting else 0.0)])
        lines += gauge("slora_requests_inflight", "HTTP requests admitted and not finished.", [((), inflight)])
        lines += gauge("slora_requests_queued", "HTTP requests waiting for a tenant slot.", [((), queued)])
        if engine.snapshot is not None:
            lines += _snapshot_lines(engine.snapshot)
        return "\n".join(lines) + "\n"


def _snapshot_lines(snap: EngineSnapshot) -> list[str]:
    pool = snap.pool
    lines = gauge("slora_pool_pages", "Pages of the unified pool by owner.",
                  [((("owner", owner),), pool.get(f"{owner}_pages", 0))
                   for owner in ("free", "kv", "cached", "adapter")])
    lines += gauge("slora_pool_capacity_pages", "Pages in the unified pool.", [((), pool.get("total_pages", 0))])
    lines += gauge("slora_sequences_running", "Sequences in the running batch.", [((), snap.sequences_running)])
    lines += gauge("slora_sequences_waiting", "Sequences waiting to be scheduled.", [((), snap.sequences_waiting)])
    lines += gauge("slora_engine_requests", "Requests inside the engine.", [((), snap.requests)])
    lines += snapshot_counter("slora_preemptions", "Sequences preempted for lack of pages.", snap.preemptions)
    lines += snapshot_counter("slora_adapter_pool_loads", "Adapter versions copied into the pool.",
                              snap.adapter_pool_loads)
    lines += snapshot_counter("slora_adapter_pool_evictions", "Idle adapter versions evicted from the pool.",
                              snap.adapter_pool_evictions)
    lines += labelled_counter("slora_engine_steps", "Engine steps by kind.", "kind", snap.steps)
    lines += labelled_counter("slora_engine_step_seconds", "Wall time of engine steps by kind (forward and "
                              "sampling included).", "kind", snap.step_seconds)
    lines += snapshot_counter("slora_engine_decode_bytes", "Bytes the decode steps had to read: weights, live KV "
                              "and each distinct adapter once per step (divide by the decode seconds for the "
                              "achieved bandwidth).", snap.decode_bytes)
    lines += gauge("slora_adapters", "Adapters per tier: registered names, versions in host memory, versions "
                   "resident in the pool.", [((("tier", "registered"),), snap.adapters_registered),
                                            ((("tier", "host"),), snap.adapters_host),
                                            ((("tier", "pool"),), snap.adapters_pool)])
    return lines
