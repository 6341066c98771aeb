"""Host time of `CUDAGraph.replay()`: why a 512-token mixed-step graph costs the host more to launch than a
decode graph (step_host.py's graph_replay phase).

Three sets of graphs, each replayed `--replays` times, every replay 1 ms after a synchronize (so the GPU is
idle and the host has left the wait), the median host time of the call reported, beside the graph's
device activities by kind (one replay under torch.profiler):
- synthetic: 640 small elementwise kernels, alone and with another kernel (torch's zero_, a fill: not a
  memset node), device copies or a side stream among them (what might slow a launch);
- gemms: the 128 GEMMs of 32 Llama-3-8B layers (qkv, o, gate_up, down, torch.mm) at 64, 448 and 512 rows,
  under cuBLAS and under cuBLASLt (torch.backends.cuda.preferred_blas_library);
- shapes: each fused projection alone, 32 times (a layer's worth each) at 512 rows, as the engine runs it
  (F.linear over `[out, in]` weights), with cuBLAS's reduced-precision bf16 reduction allowed (torch's
  default) and not, and the GEMMs' device µs per replay: which projection brings the 512-token mixed graph's
  32 memsets, and what avoiding them would cost the GPU;
- engine: step_host.py's engine (Llama-3-8B shape, 8 rank-16 adapters), after one pass of its chunked
  prompts: its 64-sequence decode graphs and its 64- and 512-token mixed-step graphs.

    python benchmarks/experiments/graph_launch.py [--replays 40] [--groups synthetic,gemms,shapes,engine]
                                                  [--out FILE]
"""
import argparse
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py and step_host.py
from common import LLAMA3_8B, LORA_GROUPS, RESULTS, fused_gemm_shapes, write_json  # noqa: E402

log = logging.getLogger("benchmarks.graph_launch")
SYNTHETIC_NODES = 640
GEMM_ROWS = (64, 448, 512)
SHAPE_ROWS = 512          # the largest mixed-step graph's tokens
GROUPS = ("synthetic", "gemms", "shapes", "engine")
BF16 = MappingProxyType({"device": "cuda", "dtype": torch.bfloat16})   # the GEMMs' tensors


def replay_us(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Median host µs of `graph.replay()`, each call 1 ms after a synchronize (spun, not slept)."""
    seconds = []
    for _ in range(replays):
        torch.cuda.synchronize()
        until = time.perf_counter() + 1e-3
        while time.perf_counter() < until:
            pass
        start = time.perf_counter()
        graph.replay()
        seconds.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return 1e6 * statistics.median(seconds)


def profiled_replay(graph: torch.cuda.CUDAGraph) -> profile:
    """One replay under torch.profiler, finished."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return prof


def activity_kinds(graph: torch.cuda.CUDAGraph) -> dict[str, int]:
    """The device activities of one replay, counted as kernel, memset or memcpy."""
    kinds: Counter[str] = Counter()
    for event in profiled_replay(graph).events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = event.name.lower()
            kinds["memset" if "memset" in name else "memcpy" if "memcpy" in name else "kernel"] += 1
    return dict(kinds)


def captured(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
    """A graph of `body`, run once before the capture (kernels chosen and compiled) and once after it."""
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def synthetic_body(kind: str) -> Callable[[], None]:
    """SYNTHETIC_NODES small adds, every 20th a fill kernel or a side-stream add, or every 200th a device copy."""
    x, y, z = (torch.zeros(n, device="cuda") for n in (4096, 16, 4096))
    side = torch.cuda.Stream()

    def on_side() -> None:
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            y.add_(1)
        torch.cuda.current_stream().wait_stream(side)
    # kind -> (every how many nodes, the node put there); "kernels" has none
    special: dict[str, tuple[int, Callable[[], object]]] = {
        "fill": (20, y.zero_), "memcpy": (200, lambda: z.copy_(x)), "side_stream": (20, on_side)}
    placed = special.get(kind)

    def body() -> None:
        for i in range(SYNTHETIC_NODES):
            if placed is not None and i % placed[0] == 0:
                placed[1]()
            else:
                x.add_(1)
    return body


def gemm_body(rows: int) -> Callable[[], None]:
    """The 128 bf16 GEMMs of 32 Llama-3-8B layers at `rows` tokens, into preallocated outputs. The weights are
    `[in, out]`, not the engine's `[out, in]`, so cuBLAS picks other kernels than the engine's for them."""
    shapes = fused_gemm_shapes()
    weights = [torch.randn(k, n, **BF16) for k, n in shapes]
    inputs = [torch.randn(rows, k, **BF16) for k, _ in shapes]
    outputs = [torch.empty(rows, n, **BF16) for _, n in shapes]

    def body() -> None:
        for _ in range(LLAMA3_8B["num_hidden_layers"]):
            for x, w, out in zip(inputs, weights, outputs):
                torch.mm(x, w, out=out)
    return body


def measured(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, object]:
    return {"replay_host_us": round(replay_us(graph, replays), 1), "activities": activity_kinds(graph)}


def synthetic_rows(replays: int) -> dict[str, dict[str, object]]:
    return {kind: measured(captured(synthetic_body(kind)), replays)
            for kind in ("kernels", "fill", "memcpy", "side_stream")}


def gemm_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        for tokens in GEMM_ROWS:
            rows[f"{library}, {tokens} rows"] = measured(captured(gemm_body(tokens)), replays)
    torch.backends.cuda.preferred_blas_library("cublas")
    return rows


def device_us(graph: torch.cuda.CUDAGraph) -> float:
    """The device µs of one replay's kernels and memsets, summed (torch.profiler)."""
    return sum(e.self_device_time_total for e in profiled_replay(graph).key_averages())


def linear_body(shape: tuple[int, int], rows: int) -> Callable[[], None]:
    """A layer's worth of one fused projection 32 times over, as the engine runs it: F.linear of `rows`
    tokens over an `[out, in]` weight (one weight for all: the launches, not the cache, are measured)."""
    fin, fout = shape
    weight, x = torch.randn(fout, fin, **BF16), torch.randn(rows, fin, **BF16)

    def body() -> None:
        for _ in range(LLAMA3_8B["num_hidden_layers"]):
            torch.nn.functional.linear(x, weight)
    return body


def shape_rows(replays: int) -> dict[str, dict[str, object]]:
    matmul, rows = torch.backends.cuda.matmul, {}
    default = matmul.allow_bf16_reduced_precision_reduction
    for reduced in (True, False):
        matmul.allow_bf16_reduced_precision_reduction = reduced
        for names, shape in zip(LORA_GROUPS, fused_gemm_shapes()):
            graph = captured(linear_body(shape, SHAPE_ROWS))
            rows[f"{'+'.join(names)}, reduced reduction {reduced}"] = \
                {**measured(graph, replays), "device_us": round(device_us(graph), 1)}
    matmul.allow_bf16_reduced_precision_reduction = default
    return rows


def engine_rows(replays: int) -> dict[str, dict[str, object]]:
    """The step_host engine's graphs of 64 sequences and of 64 and 512 tokens, after a pass of its prompts."""
    import step_host
    from engine_throughput import timed_call

    scenario = step_host.FULL
    with tempfile.TemporaryDirectory(prefix="slora-graph-launch-") as tmp:
        setup = step_host.prepare_model("cuda", Path(tmp))
        llm, adapters = step_host.build_llm(setup, scenario, {}, Path(tmp))
        engine = llm.engine
        step_host.start_decoders(engine, scenario, adapters, setup.vocab_size)
        step_host.one_pass(engine, scenario, adapters, setup.vocab_size, 2, "cuda", timed_call)
        decode, mixed = engine.runner.graphs, engine.runner.mixed_graphs
        graphs = {f"decode, 64 seqs, lora {k[1]}, few {k[2]}": g for k, (g, _, _) in decode.graphs.items()
                  if k[0] == 64}
        graphs.update({f"mixed, {k[0]} tokens, lora {k[1]}": g.graph for k, g in mixed.graphs.items()
                       if k[0] in (64, 512)})
        return {name: measured(graph, replays) for name, graph in graphs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replays", type=int, default=40)
    parser.add_argument("--groups", default=",".join(GROUPS), help="comma-separated, of " + ", ".join(GROUPS))
    parser.add_argument("--out", type=Path, default=RESULTS / "graph_launch.json")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    logging.getLogger("slora").setLevel(logging.WARNING)
    groups = args.groups.split(",")
    unknown = sorted(set(groups) - set(GROUPS))
    if unknown:
        raise SystemExit(f"unknown groups {unknown}: pick from {', '.join(GROUPS)}")
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch.py replays CUDA graphs: it needs a GPU")
    runs = {"synthetic": synthetic_rows, "gemms": gemm_rows, "shapes": shape_rows, "engine": engine_rows}
    results = {group: runs[group](args.replays) for group in GROUPS if group in groups}
    write_json(args.out, {"benchmark": "graph_launch", "replays": args.replays, "gpu": torch.cuda.get_device_name(),
                          **results})
    for group, rows in results.items():
        for name, row in rows.items():
            log.info("%-10s %-34s %7.1f µs  %s", group, name, row["replay_host_us"], row["activities"])


if __name__ == "__main__":
    main()
