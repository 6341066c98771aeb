"""Prometheus metrics of one server, kept and written by prometheus_client.

Each server has a registry of its own (never the library's global one), so that two apps in one process, as
in the tests, count apart. Request-level counters and histograms are updated on the event loop thread;
engine-level values are read at scrape time from the snapshot the engine thread publishes, so a scrape never
waits for a step. The library writes a `_created` series beside each counter and histogram (when it started,
which lets Prometheus tell a restart from a reset); PROMETHEUS_DISABLE_CREATED_SERIES=True in the server's
environment leaves them out.
"""
from collections.abc import Iterator, Mapping

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from slora.api.async_engine import AsyncEngine
from slora.api.tenants import LOCAL_TENANT_ID
from slora.core.outputs import EngineSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
POOL_OWNERS = ("free", "kv", "cached", "adapter")


class SnapshotCollector(Collector):
    """The engine snapshot's values, as metric families built at each scrape from the latest snapshot (the
    engine counts them itself: nothing here keeps a total)."""

    def __init__(self) -> None:
        self.latest: EngineSnapshot | None = None      # set by ServerMetrics.render just before it collects

    def collect(self) -> Iterator[Metric]:
        if self.latest is not None:
            yield from snapshot_families(self.latest)


class ServerMetrics:
    """All metrics of one server (one per app: no module-level state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        registry = self.registry
        self.requests = Counter("slora_requests", "Finished HTTP generation requests by outcome.", ("outcome",),
                                registry=registry)
        self.prompt_tokens = Counter("slora_prompt_tokens", "Prompt tokens of finished requests.",
                                     registry=registry)
        self.generation_tokens = Counter("slora_generation_tokens", "Generated tokens of finished requests.",
                                         registry=registry)
        self.errors = Counter("slora_http_errors", "Error responses by HTTP status.", ("status",), registry=registry)
        self.adapter_registrations = Counter("slora_adapter_registrations", "Adapters loaded through the API.",
                                             registry=registry)
        self.ttft = Histogram("slora_time_to_first_token_seconds", "Time to first token.", buckets=LATENCY_BUCKETS,
                              registry=registry)
        self.tpot = Histogram("slora_time_per_output_token_seconds",
                              "Mean time per output token after the first, per request.",
                              buckets=TOKEN_LATENCY_BUCKETS, registry=registry)
        self.e2e = Histogram("slora_e2e_request_latency_seconds", "End-to-end request latency.",
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.adapter_load = Histogram("slora_adapter_load_seconds",
                                      "Time to read, validate, pack and register an adapter.", buckets=LOAD_BUCKETS,
                                      registry=registry)
        self.engine_up = Gauge("slora_engine_up", "1 while the engine loop is serving.", registry=registry)
        self.inflight = Gauge("slora_requests_inflight", "HTTP requests admitted and not finished.",
                              registry=registry)
        self.queued = Gauge("slora_requests_queued", "HTTP requests waiting for a tenant slot.", registry=registry)
        self.snapshot = SnapshotCollector()
        registry.register(self.snapshot)

    def render(self, engine: AsyncEngine, queued: int, inflight: int) -> str:
        """The exposition text of every metric, the scrape-time values read now. Called on the event loop
        thread only, so nothing runs between setting them and collecting them."""
        self.engine_up.set(1.0 if engine.accepting else 0.0)
        self.inflight.set(inflight)
        self.queued.set(queued)
        self.snapshot.latest = engine.snapshot
        return generate_latest(self.registry).decode()


def tenant_families(snap: EngineSnapshot) -> list[Metric]:
    """Each tenant's service as the scheduler charges it. The tenants are those of the tenants file (the engine
    counts only the namespaces of authenticated tenants), or the one local user: the label set stays bounded."""
    tokens = CounterMetricFamily("slora_tenant_tokens", "Tokens computed for each tenant: prompt tokens (prefix-cache "
                                 "hits and recomputation not counted) and generated tokens.", labels=("tenant", "kind"))
    pages = CounterMetricFamily("slora_tenant_adapter_pages", "Pool pages each tenant's adapters were brought into.",
                                labels=("tenant",))
    counters = GaugeMetricFamily("slora_tenant_virtual_tokens", "Each tenant's virtual token counter: its weighted "
                                 "service; under vtc the waiting tenant with the smallest is admitted first.",
                                 labels=("tenant",))
    for tenant, share in sorted(snap.tenants.items(), key=lambda item: item[0] or ""):
        name = tenant or LOCAL_TENANT_ID
        tokens.add_metric((name, "prompt"), share.prompt_tokens)
        tokens.add_metric((name, "output"), share.output_tokens)
        pages.add_metric((name,), share.adapter_pages)
        counters.add_metric((name,), share.counter)
    return [tokens, pages, counters]


def snapshot_families(snap: EngineSnapshot) -> list[Metric]:
    pool = snap.pool
    pages = GaugeMetricFamily("slora_pool_pages", "Pages of the unified pool by owner.", labels=("owner",))
    for owner in POOL_OWNERS:
        pages.add_metric((owner,), pool.get(f"{owner}_pages", 0))
    adapters = GaugeMetricFamily("slora_adapters", "Adapters per tier: registered names, versions in host memory, "
                                 "versions resident in the pool.", labels=("tier",))
    for tier, count in (("registered", snap.adapters_registered), ("host", snap.adapters_host),
                        ("pool", snap.adapters_pool)):
        adapters.add_metric((tier,), count)
    return [
        pages,
        GaugeMetricFamily("slora_pool_capacity_pages", "Pages in the unified pool.", value=pool.get("total_pages", 0)),
        GaugeMetricFamily("slora_sequences_running", "Sequences in the running batch.", value=snap.sequences_running),
        GaugeMetricFamily("slora_sequences_waiting", "Sequences waiting to be scheduled.",
                          value=snap.sequences_waiting),
        GaugeMetricFamily("slora_engine_requests", "Requests inside the engine.", value=snap.requests),
        CounterMetricFamily("slora_preemptions", "Sequences preempted for lack of pages.", value=snap.preemptions),
        CounterMetricFamily("slora_adapter_pool_loads", "Adapter versions copied into the pool.",
                            value=snap.adapter_pool_loads),
        CounterMetricFamily("slora_adapter_pool_evictions", "Idle adapter versions evicted from the pool.",
                            value=snap.adapter_pool_evictions),
        labelled_counter("slora_engine_steps", "Engine steps by kind.", "kind", snap.steps),
        labelled_counter("slora_engine_step_seconds", "Wall time of engine steps by kind (forward and sampling "
                         "included).", "kind", snap.step_seconds),
        CounterMetricFamily("slora_engine_decode_bytes", "Bytes the decode steps had to read: weights, live KV and "
                            "each distinct adapter once per step (divide by the decode seconds for the achieved "
                            "bandwidth).", value=snap.decode_bytes),
        adapters,
        *tenant_families(snap),
    ]


def labelled_counter(name: str, help_text: str, label: str, values: Mapping[str, float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, help_text, labels=(label,))
    for key, value in sorted(values.items()):
        family.add_metric((key,), value)
    return family
