"""Prometheus metrics of one server, kept and written by prometheus_client.

Each server has a registry of its own (never the library's global one), so that two apps in one process, as
in the tests, count apart. Request-level counters and histograms are updated on the event loop thread;
engine-level values are read at scrape time from the snapshot the engine thread publishes, so a scrape never
waits for a step. The library writes a `_created` series beside each counter and histogram (when it started,
which lets Prometheus tell a restart from a reset); PROMETHEUS_DISABLE_CREATED_SERIES=True in the server's
environment leaves them out.

Beside the slora_* series, the ones LLM routers and autoscalers built for vLLM read, under vLLM's names
(router_families). Their adapter names are labels a hostile tenant could otherwise read or grow: they name only
adapters in the pool, in host memory, running or queued here, and each scrape only those its reader may see
(AdapterNamer).
"""
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from slora.api.async_engine import AsyncEngine
from slora.api.tenants import LOCAL_TENANT_ID, Tenant
from slora.core.outputs import AdapterName, AdapterPlacement, DurationCounts, EngineSnapshot

CONTENT_TYPE = CONTENT_TYPE_LATEST
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
LOAD_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
POOL_OWNERS = ("free", "kv", "cached", "adapter")


class Scrape(NamedTuple):
    """What one scrape reads: the latest snapshot, who reads it, and the name the base model is served as."""

    snapshot: EngineSnapshot
    viewer: Tenant | None              # None: an anonymous scrape of a server with tenants
    model_name: str


class SnapshotCollector(Collector):
    """The engine snapshot's values, as metric families built at each scrape from the latest snapshot (the
    engine counts them itself: nothing here keeps a total)."""

    def __init__(self) -> None:
        self.latest: Scrape | None = None      # set by ServerMetrics.render just before it collects

    def collect(self) -> Iterator[Metric]:
        scrape = self.latest
        if scrape is not None:
            yield from replica_families(scrape) if scrape.snapshot.replicas else engine_families(scrape)


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

    def render(self, engine: AsyncEngine, queued: int, inflight: int, viewer: Tenant | None = None,
               model_name: str = "") -> str:
        """The exposition text of every metric, the scrape-time values read now, adapter names as `viewer`
        may see them (None: anonymous, no names). Called on the event loop thread only, so nothing runs
        between setting them and collecting them."""
        self.engine_up.set(1.0 if engine.accepting else 0.0)
        self.inflight.set(inflight)
        self.queued.set(queued)
        snap = engine.snapshot
        self.snapshot.latest = None if snap is None else Scrape(snap, viewer, model_name)
        return generate_latest(self.registry).decode()


def engine_families(scrape: Scrape) -> list[Metric]:
    return [*snapshot_families(scrape.snapshot), *router_families(scrape)]


def replica_families(scrape: Scrape) -> list[Metric]:
    """A cluster ingress's engine series: each replica's, with a `replica` label (Ray's replica tag), one family
    per name. The adapter names are the catalog's, shown as the scrape's reader may see them."""
    merged: dict[str, Metric] = {}
    for replica_id, snap in sorted(scrape.snapshot.replicas.items()):
        for family in engine_families(scrape._replace(snapshot=snap)):
            into = merged.setdefault(family.name, Metric(family.name, family.documentation, family.type,
                                                         family.unit))
            into.samples.extend(sample._replace(labels={**sample.labels, "replica": replica_id})
                                for sample in family.samples)
    return list(merged.values())


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
        GaugeMetricFamily("slora_kv_token_capacity", "Tokens the pool's pages not holding adapter weights can hold "
                          "(free, live and cached KV): twice as many with an FP8 cache.",
                          value=pool.get("kv_token_capacity", 0)),
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


# ---- vLLM's names, for routers and autoscalers ----------------------------------------------------------------
ENGINE_INDEX = "0"      # vLLM labels its series with the engine (data-parallel rank); this server has one


@dataclass(frozen=True)
class AdapterNamer:
    """The adapter names one scrape may show. An admin (the single user of a server without tenants is one)
    sees every name, a tenant's as `<owner>/<name>` (two tenants may use one name), a public or un-owned one as
    `<name>`, what requests send as `model`. A non-admin tenant sees its own names and public ones, and only
    for versions it loaded first or ran and sequences of its own: its /v1/adapters tells no more (another
    tenant's use of the same weights, or of a public adapter, is not told). An anonymous scrape sees none."""

    viewer: Tenant | None

    def label(self, name: AdapterName) -> str | None:
        viewer = self.viewer
        if viewer is None:
            return None
        if viewer.is_admin:
            return name.name if name.public or name.owner is None else f"{name.owner}/{name.name}"
        return name.name if name.public or name.owner == viewer.namespace else None

    def sees_version(self, placement: AdapterPlacement) -> bool:
        viewer = self.viewer
        return viewer is not None and (viewer.is_admin or viewer.namespace in placement.used_by)

    def sees_sequences_of(self, tenant: str | None) -> bool:
        viewer = self.viewer
        return viewer is not None and (viewer.is_admin or viewer.namespace == tenant)

    def labels(self, names: Iterable[AdapterName]) -> list[str]:
        shown = (self.label(name) for name in names)
        return sorted({label for label in shown if label is not None})


def sequence_names(snap: EngineSnapshot, pairs: Iterable[tuple[str | None, str]], namer: AdapterNamer) -> str:
    """The adapters of these (tenant, version) sequences, comma-joined and sorted: each under the names its
    tenant could have asked for it by (its own and public ones), as far as the scrape may see them."""
    shown: set[str] = set()
    for tenant, version in pairs:
        placement = snap.adapter_placements.get(version)
        if placement is not None and namer.sees_sequences_of(tenant):
            usable = (n for n in placement.names if n.public or n.owner == tenant)
            shown.update(namer.labels(usable))
    return ",".join(sorted(shown))


def kv_cache_usage(snap: EngineSnapshot) -> float:
    """Live KV pages over the pages KV may have: cached prefix pages and idle adapters count as free (both are
    reclaimed on demand, as vLLM counts its evictable cached blocks free), the pages of adapters that running
    sequences use are not KV's to have. 1.0: no new KV page without a preemption."""
    pool = snap.pool
    room = pool.get("total_pages", 0) - snap.pinned_adapter_pages
    return min(1.0, pool.get("kv_pages", 0) / room) if room > 0 else 0.0


def lora_requests_info(snap: EngineSnapshot, namer: AdapterNamer) -> GaugeMetricFamily:
    """vLLM's info gauge: the adapters of the running and of the waiting sequences as labels, its value the
    time the snapshot was taken (a router keeps the newest series)."""
    family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on lora requests: adapters of the running "
                               "and waiting sequences; value: the time of the sample.",
                               labels=("running_lora_adapters", "waiting_lora_adapters", "max_lora"))
    family.add_metric((sequence_names(snap, snap.running_adapters, namer),
                       sequence_names(snap, snap.waiting_adapters, namer), str(snap.adapter_slots)), snap.taken_at)
    return family


def adapter_loaded(snap: EngineSnapshot, namer: AdapterNamer, base: tuple[str, str]) -> GaugeMetricFamily:
    """1 for each name of each version in the pool (level gpu) or in host memory only (level cpu)."""
    family = GaugeMetricFamily("vllm:lora_adapter_loaded", "1 for each adapter loaded: level gpu in the pool, cpu "
                               "in host memory only; pinned while running sequences use it.",
                               labels=("model_name", "engine", "adapter_name", "level", "pinned"))
    series: set[tuple[str, str, str]] = set()          # one name may be given twice (public in two namespaces)
    for placement in snap.adapter_placements.values():
        if (placement.in_pool or placement.on_host) and namer.sees_version(placement):
            level, pinned = "gpu" if placement.in_pool else "cpu", "true" if placement.pinned else "false"
            series.update((name, level, pinned) for name in namer.labels(placement.names))
    for labels in sorted(series):
        family.add_metric(base + labels, 1.0)
    return family


def load_histogram(durations: DurationCounts, base: tuple[str, str]) -> HistogramMetricFamily:
    family = HistogramMetricFamily("vllm:lora_adapter_load_seconds", "Time to read, validate, hash and pack an "
                                   "adapter version brought into host memory (a load or a read back from disk).",
                                   labels=("model_name", "engine"))
    cumulative, buckets = 0, []
    for bound, count in zip((*map(str, durations.bounds), "+Inf"), durations.counts, strict=True):
        cumulative += count
        buckets.append((bound, cumulative))
    family.add_metric(base, buckets, durations.total)
    return family


def base_gauge(name: str, help_text: str, base: tuple[str, str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=("model_name", "engine"))
    family.add_metric(base, value)
    return family


def router_families(scrape: Scrape) -> list[Metric]:
    """vLLM's series that LLM routers (llm-d's endpoint picker, the Gateway API Inference Extension) and
    autoscalers read. vLLM counts requests where this server counts sequences (a request with n > 1 has n)."""
    snap, namer, base = scrape.snapshot, AdapterNamer(scrape.viewer), (scrape.model_name, ENGINE_INDEX)
    placements = snap.adapter_placements.values()
    return [
        base_gauge("vllm:num_requests_running", "Sequences in the running batch.", base, snap.sequences_running),
        base_gauge("vllm:num_requests_waiting", "Sequences waiting to be scheduled.", base, snap.sequences_waiting),
        base_gauge("vllm:kv_cache_usage_perc", "Share of the pool's pages KV may have that hold live KV (1 = full).",
                   base, kv_cache_usage(snap)),
        lora_requests_info(snap, namer),
        adapter_loaded(snap, namer, base),
        base_gauge("vllm:num_gpu_loaded_lora_adapters", "Adapter versions resident in the pool.", base,
                   sum(p.in_pool for p in placements)),
        base_gauge("vllm:num_cpu_loaded_lora_adapters", "Adapter versions in host memory (in the pool too or not).",
                   base, sum(p.on_host for p in placements)),
        base_gauge("vllm:max_gpu_lora_adapters", "Distinct adapters one batch may run (max_loras, else "
                   "max_num_seqs); idle ones may stay in the pool beyond it.", base, snap.adapter_slots),
        load_histogram(snap.adapter_load_seconds, base),
    ]
