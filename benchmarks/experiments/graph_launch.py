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
- gate_up: the gate/up projection that brings them, 32 times, fused at 256 to 640 rows, split by rows or by
  columns into pieces that write one output, under cuBLASLt, and as an addmm with a zero bias (cuBLASLt's
  bias epilogue), and as its transpose (weight @ x^T) at 448 and 512 rows, with device µs: which form
  avoids the memsets, at what cost to the GPU;
- engine: step_host.py's engine (Llama-3-8B shape, 8 rank-16 adapters), after one pass of its chunked
  prompts: its 64-sequence decode graphs and its 64- and 512-token mixed-step graphs; and before it, every
  mixed-step graph (16 to 512 tokens) over its inputs as captured; with device µs;
- split_k: each fused projection alone, 32 times, at 320, 448 and 512 rows, under cuBLAS and under cuBLASLt
  with torch's bf16 reduction setting at each of its three values (reduced precision with split-K, full
  precision with split-K, full precision without split-K: cuBLASLt's reduction-scheme mask), with device µs:
  whether a cuBLASLt capture without split-K keeps the memsets out, at what cost to the GPU;
- gate_up_forms: the gate/up projection at 320, 448 and 512 rows as one GEMM, as a batched GEMM of its two
  halves (gate and up as one `[2, rows, inter]` output), over a weight or into an output whose rows are padded
  by 64 columns (another leading dimension, the same alignment), with device µs and the first memset's bytes:
  whether another form of the same product gets a kernel without the memsets, at no cost to the GPU (run it
  once more with CUBLAS_WORKSPACE_CONFIG=:0:0 to see whether the memsets need cuBLAS's workspace).

    python benchmarks/experiments/graph_launch.py [--replays 40] [--out FILE]
        [--groups synthetic,gemms,shapes,gate_up,engine,split_k,gate_up_forms]
"""
import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
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
GATE_UP_ROWS = (256, 320, 384, 448, 512, 528, 576, 640)
# (rows, row parts, column parts) of the gate/up projection split into pieces
GATE_UP_PIECES = ((512, 1, 2), (448, 1, 2), (384, 1, 2), (256, 1, 2), (512, 2, 1), (448, 2, 1), (512, 1, 4),
                  (512, 2, 2))
TRANSPOSED_ROWS = (448, 512)
GROUPS = ("synthetic", "gemms", "shapes", "gate_up", "engine", "split_k", "gate_up_forms")
PROBE_ROWS = (320, 448, 512)      # split_k and gate_up_forms: rows where the gate/up memsets appear
# torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction: (reduced precision, split-K)
REDUCTIONS = {"reduced, split-K": (True, True), "full, split-K": (False, True), "full, no split-K": (False, False)}
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


def per_layer(layer: Callable[[], object]) -> Callable[[], None]:
    """A body that runs `layer` once for each of Llama-3-8B's 32 layers."""
    def body() -> None:
        for _ in range(LLAMA3_8B["num_hidden_layers"]):
            layer()
    return body


def gemm_body(rows: int) -> Callable[[], None]:
    """The 128 bf16 GEMMs of 32 Llama-3-8B layers at `rows` tokens, into preallocated outputs. The weights are
    `[in, out]`, not the engine's `[out, in]`, so cuBLAS picks other kernels than the engine's for them."""
    shapes = fused_gemm_shapes()
    weights = [torch.randn(k, n, **BF16) for k, n in shapes]
    inputs = [torch.randn(rows, k, **BF16) for k, _ in shapes]
    outputs = [torch.empty(rows, n, **BF16) for _, n in shapes]

    def layer() -> None:
        for x, w, out in zip(inputs, weights, outputs):
            torch.mm(x, w, out=out)
    return per_layer(layer)


def measured(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, object]:
    return {"replay_host_us": round(replay_us(graph, replays), 1), "activities": activity_kinds(graph)}


def measured_on_device(graph: torch.cuda.CUDAGraph, replays: int) -> dict[str, object]:
    """measured(), and the device µs of one replay."""
    return {**measured(graph, replays), "device_us": round(device_us(graph), 1)}


def synthetic_rows(replays: int) -> dict[str, dict[str, object]]:
    return {kind: measured(captured(synthetic_body(kind)), replays)
            for kind in ("kernels", "fill", "memcpy", "side_stream")}


@contextmanager
def blas_library(name: str) -> Iterator[None]:
    """torch's preferred BLAS library set to `name` while the context is open, then the one before."""
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def gemm_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {}
    for library in ("cublas", "cublaslt"):
        with blas_library(library):
            for tokens in GEMM_ROWS:
                rows[f"{library}, {tokens} rows"] = measured(captured(gemm_body(tokens)), replays)
    return rows


def device_us(graph: torch.cuda.CUDAGraph) -> float:
    """The device µs of one replay's kernels and memsets, summed (torch.profiler)."""
    return sum(e.self_device_time_total for e in profiled_replay(graph).key_averages())


def linear_body(shape: tuple[int, int], rows: int) -> Callable[[], None]:
    """A layer's worth of one fused projection 32 times over, as the engine runs it: F.linear of `rows`
    tokens over an `[out, in]` weight (one weight for all: the launches, not the cache, are measured)."""
    fin, fout = shape
    weight, x = torch.randn(fout, fin, **BF16), torch.randn(rows, fin, **BF16)
    return per_layer(lambda: torch.nn.functional.linear(x, weight))


@contextmanager
def bf16_reduction(setting: tuple[bool, bool]) -> Iterator[None]:
    """torch's bf16 reduction setting (reduced precision, split-K) while the context is open, then the one
    before."""
    matmul = torch.backends.cuda.matmul
    before = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_bf16_reduced_precision_reduction_split_k)
    matmul.allow_bf16_reduced_precision_reduction = setting
    try:
        yield
    finally:
        matmul.allow_bf16_reduced_precision_reduction = before


def shape_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {}
    for reduced in (True, False):
        with bf16_reduction((reduced, True)):
            for names, shape in zip(LORA_GROUPS, fused_gemm_shapes()):
                rows[f"{'+'.join(names)}, reduced reduction {reduced}"] = \
                    measured_on_device(captured(linear_body(shape, SHAPE_ROWS)), replays)
    return rows


def pieces_body(rows: int, row_parts: int, col_parts: int) -> Callable[[], None]:
    """The gate/up projection of `rows` tokens 32 times over, as row_parts x col_parts GEMMs, each writing its
    block of one `[rows, out]` output in place (torch.mm into a strided view: no copy)."""
    fin, fout = fused_gemm_shapes()[2]
    weight, x = torch.randn(fout, fin, **BF16), torch.randn(rows, fin, **BF16)
    out = torch.empty(rows, fout, **BF16)
    row_step, col_step = -(-rows // row_parts), fout // col_parts
    blocks = [(slice(r, r + row_step), slice(c, c + col_step))
              for r in range(0, rows, row_step) for c in range(0, fout, col_step)]

    def layer() -> None:
        for r, c in blocks:
            torch.mm(x[r], weight[c].t(), out=out[r, c])
    return per_layer(layer)


def gate_up_bodies() -> dict[str, Callable[[], None]]:
    """The gate/up projection's forms, each a layer's worth 32 times over."""
    fin, fout = fused_gemm_shapes()[2]
    bodies = {f"fused, {rows} rows": linear_body((fin, fout), rows) for rows in GATE_UP_ROWS}
    for rows, row_parts, col_parts in GATE_UP_PIECES:
        bodies[f"{row_parts} x {col_parts} pieces, {rows} rows"] = pieces_body(rows, row_parts, col_parts)
    weight, x, bias = torch.randn(fout, fin, **BF16), torch.randn(SHAPE_ROWS, fin, **BF16), torch.zeros(fout, **BF16)
    bodies["addmm with a zero bias, 512 rows"] = per_layer(lambda: torch.addmm(bias, x, weight.t()))
    for rows in TRANSPOSED_ROWS:
        bodies[f"transposed (weight @ x^T), {rows} rows"] = transposed_body(rows)
    return bodies


def transposed_body(rows: int) -> Callable[[], None]:
    """The gate/up projection as its transpose, `[out, rows]` = weight @ x^T, 32 times over: cuBLAS sees the
    operands swapped and may pick another kernel, without the memset (a SiLU kernel could read the
    transposed layout through its strides)."""
    fin, fout = fused_gemm_shapes()[2]
    weight, x = torch.randn(fout, fin, **BF16), torch.randn(rows, fin, **BF16)
    return per_layer(lambda: torch.mm(weight, x.t()))


def gate_up_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {name: measured_on_device(captured(body), replays) for name, body in gate_up_bodies().items()}
    with blas_library("cublaslt"):
        rows["fused, 512 rows, cuBLASLt"] = \
            measured_on_device(captured(linear_body(fused_gemm_shapes()[2], SHAPE_ROWS)), replays)
    return rows


def split_k_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {}
    for tokens in PROBE_ROWS:
        for names, shape in zip(LORA_GROUPS, fused_gemm_shapes()):
            name = f"{'+'.join(names)}, {tokens} rows"
            rows[f"{name}, cuBLAS"] = measured_on_device(captured(linear_body(shape, tokens)), replays)
            for label, setting in REDUCTIONS.items():
                with blas_library("cublaslt"), bf16_reduction(setting):
                    rows[f"{name}, cuBLASLt, {label}"] = \
                        measured_on_device(captured(linear_body(shape, tokens)), replays)
    return rows


def gate_up_form_bodies(rows: int) -> dict[str, Callable[[], None]]:
    """The gate/up projection of `rows` tokens in four forms, each a layer's worth 32 times over."""
    fin, fout = fused_gemm_shapes()[2]
    weight, x = torch.randn(fout, fin, **BF16), torch.randn(rows, fin, **BF16)
    halves = weight.view(2, fout // 2, fin).transpose(1, 2)                  # [2, in, inter]
    padded_weight = torch.randn(fout, fin + 64, **BF16)[:, :fin]
    padded_out = torch.empty(rows, fout + 64, **BF16)[:, :fout]
    return {"one GEMM": per_layer(lambda: torch.nn.functional.linear(x, weight)),
            "batched halves": per_layer(lambda: torch.bmm(x.expand(2, rows, fin), halves)),
            "padded weight rows": per_layer(lambda: torch.nn.functional.linear(x, padded_weight)),
            "padded output rows": per_layer(lambda: torch.mm(x, weight.t(), out=padded_out))}


def first_memset_args(graph: torch.cuda.CUDAGraph) -> dict[str, object] | None:
    """The profiler's arguments of a replay's first memset (its bytes among them), or None."""
    with tempfile.TemporaryDirectory(prefix="slora-graph-launch-") as tmp:
        trace = Path(tmp) / "trace.json"
        profiled_replay(graph).export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    memsets = [e for e in events if "memset" in str(e.get("name", "")).lower() and e.get("ph") == "X"]
    return memsets[0].get("args") if memsets else None


def gate_up_form_rows(replays: int) -> dict[str, dict[str, object]]:
    rows = {}
    for tokens in PROBE_ROWS:
        for form, body in gate_up_form_bodies(tokens).items():
            graph = captured(body)
            rows[f"{form}, {tokens} rows"] = {**measured_on_device(graph, replays),
                                             "first_memset": first_memset_args(graph)}
    return rows


def engine_rows(replays: int) -> dict[str, dict[str, object]]:
    """The step_host engine's mixed-step graphs over their inputs as captured; then, after a pass of its
    prompts, its graphs of 64 sequences and of 64 and 512 tokens."""
    import step_host
    from engine_throughput import timed_call

    scenario = step_host.FULL
    with tempfile.TemporaryDirectory(prefix="slora-graph-launch-") as tmp:
        setup = step_host.prepare_model("cuda", Path(tmp))
        llm, adapters = step_host.build_llm(setup, scenario, {}, Path(tmp))
        engine = llm.engine
        decode, mixed = engine.runner.graphs, engine.runner.mixed_graphs
        log.info("mixed-step buckets in use, by LoRA: %s", mixed.usable)
        # Every bucket over its inputs as captured (what the engine times them over): after a step, a smaller
        # bucket's static inputs may hold a larger step's rows.
        rows = {f"mixed, {k[0]} tokens, lora {k[1]}, as captured": measured_on_device(g.graph, replays)
                for k, g in sorted(mixed.graphs.items())}
        step_host.start_decoders(engine, scenario, adapters, setup.vocab_size)
        step_host.one_pass(engine, scenario, adapters, setup.vocab_size, 2, "cuda", timed_call)
        graphs = {f"decode, 64 seqs, lora {k[1]}, few {k[2]}": g for k, (g, _, _) in decode.graphs.items()
                  if k[0] == 64}
        graphs.update({f"mixed, {k[0]} tokens, lora {k[1]}": g.graph for k, g in mixed.graphs.items()
                       if k[0] in (64, 512)})
        return {**rows, **{name: measured_on_device(graph, replays) for name, graph in graphs.items()}}


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
    runs = {"synthetic": synthetic_rows, "gemms": gemm_rows, "shapes": shape_rows, "gate_up": gate_up_rows,
            "engine": engine_rows, "split_k": split_k_rows,
            "gate_up_forms": gate_up_form_rows}
    results = {group: runs[group](args.replays) for group in GROUPS if group in groups}
    write_json(args.out, {"benchmark": "graph_launch", "replays": args.replays, "gpu": torch.cuda.get_device_name(),
                          **results})
    for group, rows in results.items():
        for name, row in rows.items():
            log.info("%-10s %-34s %7.1f µs  %s", group, name, row["replay_host_us"], row["activities"])


if __name__ == "__main__":
    main()
