"""Adapter affinity across engine replicas on Ray Serve: one power-law trace over more adapters than a replica's
pool holds, served in one invocation three ways:
  affinity   two replicas, each request sent with its adapter's version as Ray's multiplexed model id (what
             `slora serve --replicas` does): Ray prefers a replica that already holds the version
  load       two replicas, requests sent without a model id: Ray routes by load alone (power of two choices),
             and each replica registers a version on its first request for it
  single     one replica alone (the whole machine's share of one engine), the baseline of throughput

Trace: --requests requests, Poisson arrivals at --rate req/s; each asks for the base model (--base-share) or for
one of --adapters adapters (rank 8 on q/k/v/o) with Zipf popularity (adapter i with weight 1 / i^--alpha);
prompts and outputs uniform in [16, 64] tokens, seeded. Each replica's pool holds --pool-adapters adapters
beside the KV of a full batch of average requests, and its host tier as many packed copies; the trace's adapters
are 3x that by default. --quick: 20 requests, affinity and load only (the smoke test).

Reported per mode: adapter loads, summed over replicas: `pool_loads`, versions copied into a pool;
`registrations`, versions a replica took on (its first use of each); `disk_reads`, versions read from disk,
checked and packed (the registrations, and every read back after a host copy was dropped); generated tokens
per second from the first arrival to the last finish; TTFT p50/p99 from arrival to the first output through
the handle. The goal: at least 3x
fewer loads and a lower TTFT p99 with affinity than by load, and no throughput lost against one replica.

The CPU run (the default) serves slora-tiny-llama, replicas of --replica-cpus each. A GPU run (two replicas of
--replica-gpus 0.45 on one GPU) needs Ray on the GPU machine.

    python benchmarks/replicas.py [--device cpu|cuda] [--quick] [--requests N] [--rate R] [--adapters A]
                                  [--pool-adapters K] [--ray-address ADDR] [--out FILE]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from common import ModelSetup, default_out, prepare_model, print_table, write_adapters, write_json

from slora.api.cluster_engine import build_catalog
from slora.api.replica import DEFAULT_MAX_ONGOING_REQUESTS, EngineReplica, ReplicaRequest, ReplicaStats
from slora.config import EngineConfig
from slora.models.config import load_model_config
from slora.sampling.params import SamplingParams

log = logging.getLogger("benchmarks.replicas")
LENGTHS = (16, 64)              # prompt and output tokens, uniform
MAX_NUM_SEQS = 16
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MODES = ("affinity", "load", "single")


class LoadRoutedReplica(EngineReplica):
    """The baseline replica: requests come without a multiplexed model id, so Ray routes them by load alone; a
    version is registered on its first request here and kept (the engine's tiers bound its memory)."""

    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self._registering: dict[str, asyncio.Future] = {}

    async def _adapter_for(self, request: ReplicaRequest) -> None:
        version, folder = request.adapter_version, request.adapter_folder
        assert version is not None and folder is not None
        if version not in self._registering:
            self._folder.set(folder)            # read by _register, in the task's copy of this context
            self._registering[version] = asyncio.ensure_future(self._register(version))
        await asyncio.shield(self._registering[version])


@dataclass(frozen=True)
class TraceRequest:
    arrival: float
    prompt: list[int]
    max_tokens: int
    adapter: int | None          # index into the adapters, None: the base model


def make_trace(args: argparse.Namespace, vocab: int) -> list[TraceRequest]:
    rng = random.Random(args.seed)
    weights = [1.0 / (i + 1) ** args.alpha for i in range(args.adapters)]
    trace, now = [], 0.0
    for _ in range(args.requests):
        now += rng.expovariate(args.rate)
        adapter = None if rng.random() < args.base_share else rng.choices(range(args.adapters), weights)[0]
        prompt = [rng.randrange(3, vocab) for _ in range(rng.randint(*LENGTHS))]
        trace.append(TraceRequest(now, prompt, rng.randint(*LENGTHS), adapter))
    return trace


def engine_config(setup: ModelSetup, folders: list[Path], pool_adapters: int, device: str) -> EngineConfig:
    """Each replica's pool: `pool_adapters` adapters beside the KV of a full batch of average requests (more
    would stay resident in the pages such a batch leaves free); its host tier as many copies."""
    probe = EngineConfig(model=str(setup.folder), device=device, max_num_seqs=MAX_NUM_SEQS)
    model_config = load_model_config(setup.folder)
    packed = build_catalog(probe, model_config, setup.context, 1 << 16).prepare(folders[0]).packed
    kv_pages = MAX_NUM_SEQS * (-(-(LENGTHS[0] + LENGTHS[1]) // probe.page_size) + 1)
    num_pages = pool_adapters * packed.num_pages + kv_pages
    host_gib = pool_adapters * packed.num_bytes / 2 ** 30
    return EngineConfig(model=str(setup.folder), device=device, max_num_seqs=MAX_NUM_SEQS, num_pages=num_pages,
                        adapter_host_cache_gib=host_gib)


def deploy(mode: str, config: EngineConfig, args: argparse.Namespace) -> Any:
    from ray import serve

    replica_class = LoadRoutedReplica if mode == "load" else EngineReplica
    options = {"num_gpus": args.replica_gpus, "num_cpus": args.replica_cpus}
    deployment = serve.deployment(num_replicas=1 if mode == "single" else 2,
                                  max_ongoing_requests=args.max_ongoing, ray_actor_options=options)(replica_class)
    return serve.run(deployment.bind(config), name=f"bench-{mode}", route_prefix=None)


async def replay(handle: Any, trace: list[TraceRequest], versions: list[tuple[str, str]],
                 affinity: bool) -> list[dict[str, float]]:
    """Each request sent at its arrival time; its TTFT and finish read from its stream."""
    began = time.perf_counter()

    async def one(index: int, item: TraceRequest) -> dict[str, float]:
        await asyncio.sleep(max(0.0, item.arrival - (time.perf_counter() - began)))
        version, folder = versions[item.adapter] if item.adapter is not None else (None, None)
        params = SamplingParams(max_tokens=item.max_tokens, temperature=0.0, ignore_eos=True)
        options: dict[str, Any] = {"stream": True, "method_name": "generate"}
        if affinity and version is not None:
            options["multiplexed_model_id"] = version
        request = ReplicaRequest(f"r{index}", item.prompt, params, version, folder)
        first, last = None, None
        async for output in handle.options(**options).remote(request):
            first = first or time.perf_counter() - began
            last = output
        assert last is not None and last.finished, f"request {index} did not finish"
        return {"ttft": first - item.arrival, "end": time.perf_counter() - began, "tokens": len(last.token_ids)}
    return await asyncio.gather(*(one(i, item) for i, item in enumerate(trace)))


def replica_stats(handle: Any, count: int) -> list[ReplicaStats]:
    seen: dict[str, ReplicaStats] = {}
    for _ in range(200 * count):
        stats = handle.load_count.remote().result()
        seen.setdefault(stats.replica_id, stats)
        if len(seen) == count:
            break
    return list(seen.values())


def run_mode(mode: str, config: EngineConfig, trace: list[TraceRequest], versions: list[tuple[str, str]],
             args: argparse.Namespace) -> dict[str, Any]:
    from ray import serve

    handle = deploy(mode, config, args)
    try:
        results = asyncio.run(replay(handle, trace, versions, affinity=mode != "load"))
        stats = replica_stats(handle, 1 if mode == "single" else 2)
    finally:
        serve.delete(f"bench-{mode}")
    ttfts = np.array([r["ttft"] for r in results])
    span = max(r["end"] for r in results) - trace[0].arrival
    row = {"mode": mode, "replicas": len(stats), "pool_loads": sum(s.pool_loads for s in stats),
           "registrations": sum(sum(s.loads.values()) for s in stats),
           "disk_reads": sum(sum(s.loads.values()) + s.reloads for s in stats),
           "gen_tok_s": sum(r["tokens"] for r in results) / span,
           "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99))}
    log.info("%s: %s", mode, row)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--quick", action="store_true", help="a short trace (the smoke test)")
    parser.add_argument("--requests", type=int, default=600)
    parser.add_argument("--rate", type=float, default=7.0, help="arrivals per second")
    parser.add_argument("--pool-adapters", type=int, default=8, help="adapters one replica's pool holds")
    parser.add_argument("--adapters", type=int, default=None, help="adapters of the trace (3 x --pool-adapters)")
    parser.add_argument("--alpha", type=float, default=1.0, help="Zipf exponent of the adapters' popularity")
    parser.add_argument("--base-share", type=float, default=0.1)
    parser.add_argument("--replica-cpus", type=float, default=0.5)
    parser.add_argument("--replica-gpus", type=float, default=None, help="default: 0 on the CPU, 0.45 on a GPU")
    parser.add_argument("--max-ongoing", type=int, default=DEFAULT_MAX_ONGOING_REQUESTS,
                        help="requests Ray lets one replica hold; past it, Ray sends an adapter's requests to a "
                             "replica without it (default: slora's)")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster (its Serve started) instead of starting one of the run's own")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.requests, args.rate, args.pool_adapters = 20, 20.0, 2
    args.adapters = args.adapters or 3 * args.pool_adapters
    args.replica_gpus = args.replica_gpus if args.replica_gpus is not None else (0.0 if args.device == "cpu" else 0.45)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    import ray
    from ray import serve

    with tempfile.TemporaryDirectory(prefix="slora-replicas-") as tmp:
        setup = prepare_model(args.device, Path(tmp))
        folders = write_adapters(Path(tmp) / "adapters", setup, [8] * args.adapters, TARGETS)
        config = engine_config(setup, folders, args.pool_adapters, args.device)
        catalog = build_catalog(config, load_model_config(setup.folder), setup.context, 1 << 16)
        versions = [(catalog.prepare(folder).version, str(folder)) for folder in folders]
        trace = make_trace(args, setup.vocab_size)
        if args.ray_address is None:
            ray.init(include_dashboard=False, log_to_driver=False)
            serve.start(proxy_location="Disabled")
        else:
            ray.init(address=args.ray_address, log_to_driver=False)
        try:
            rows = [run_mode(mode, config, trace, versions, args) for mode in (MODES[:2] if args.quick else MODES)]
        finally:
            if args.ray_address is None:      # a joined cluster's Serve is its owner's
                serve.shutdown()
            ray.shutdown()
    print_table(rows)
    by_mode = {row["mode"]: row for row in rows}
    single = by_mode.get("single")
    summary = {"load_ratio": by_mode["load"]["pool_loads"] / max(1, by_mode["affinity"]["pool_loads"]),
               "throughput_vs_single": by_mode["affinity"]["gen_tok_s"] / single["gen_tok_s"] if single else None}
    print(json.dumps(summary))  # noqa: T201 - the script's output
    out = args.out or default_out("replicas", args.device)
    engine = {"num_pages": config.num_pages, "max_num_seqs": MAX_NUM_SEQS,
              "adapter_host_cache_gib": config.adapter_host_cache_gib}
    write_json(out, {"model": setup.description, "args": vars(args) | {"out": str(out)}, "engine": engine,
                     "rows": rows, "summary": summary})


if __name__ == "__main__":
    main()
