"""Does the LoRA of a decode step hide behind the base GEMMs when it runs on a second CUDA stream?

One Llama-3-8B layer's four projections (q/k/v, o, gate/up, down) as cuBLAS GEMMs at a decode batch, with
the layer's LoRA (rank 16, one shared adapter or one adapter per token) either

- `serial`: after each GEMM, shrink + expand adding into its output (the engine's decode graphs before
  `lora_side_stream`), or `serial+pdl`: the same launched with programmatic dependent launch (each LoRA
  kernel starts while the kernel before it ends), or
- `side stream`: each group's memset + shrink + expand into a delta buffer on a second, high-priority
  stream, issued before the GEMM so the two run at once; the main stream waits for it after the GEMM
  (`+ add`: then adds the delta with a torch add; without: the add is left to a kernel that follows,
  as the engine folds it into its fused elementwise kernels).

Eight layers with their own weights (3.5 GB, so the L2 cache holds none of them), replayed from a CUDA
graph. Prints one table and writes JSON. An experiment for the GPU only (no --quick: there is nothing
to run without CUDA streams and cuBLAS); its results are in benchmarks/README.md and HISTORY.md.

    python benchmarks/experiments/lora_overlap.py [--batch 64 128 256] [--modes ...] [--out PATH]
"""
import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import (  # noqa: E402
    LLAMA3_8B_MODULES,
    LORA_GROUPS,
    PAGE_ELEMS,
    RESULTS,
    fused_gemm_shapes,
    graph_time_us,
    pack_lora_layer,
)

LAYERS = 8
RANK = 16


def _layer_weights(dtype: torch.dtype) -> list[Tensor]:
    """The weights `[out, in]` of one layer's four fused projections."""
    return [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for k, n in fused_gemm_shapes()]


def _runner(batch: int, num_adapters: int, table_slots: int, mode: str) -> Callable[[], None]:
    from slora.kernels.lora import lora_expand, lora_segments, lora_shrink
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    lora = pack_lora_layer(table_slots, RANK, PAGE_ELEMS, dtype, gen)
    slots = (torch.arange(batch) % num_adapters).to(torch.int32).cuda()
    segments = lora_segments(slots, table_slots)
    shapes = {name: (fin, fout) for name, fin, fout in LLAMA3_8B_MODULES}
    tables = [(torch.stack([lora.ranks] * len(names)), torch.stack([lora.offsets[n][0] for n in names]),
               torch.stack([lora.offsets[n][1] for n in names]), torch.stack([lora.scalings] * len(names)),
               [shapes[n][1] for n in names]) for names in LORA_GROUPS]
    weights = [_layer_weights(dtype) for _ in range(LAYERS)]
    x4096 = torch.randn(batch, 4096, device="cuda", dtype=dtype)
    x14336 = torch.randn(batch, 14336, device="cuda", dtype=dtype)
    inputs = [x4096, x4096, x4096, x14336]
    workspace = torch.zeros(LAYERS * batch * RANK * 7, device="cuda")   # h of every layer, zeroed per step
    side = torch.cuda.Stream(priority=-1)

    pdl = mode == "serial+pdl"

    def shrink(x: Tensor, group: int, used: int) -> Tensor:
        ranks, a_off, _, _, sizes = tables[group]
        h = workspace[used:used + batch * len(sizes) * RANK].view(batch, len(sizes) * RANK)
        return lora_shrink(x, lora.pool, slots, lora.page_tables, ranks, a_off, RANK, out=h, segments=segments,
                           pdl=pdl)

    def expand(out: Tensor, h: Tensor, group: int) -> None:
        ranks, _, b_off, scalings, sizes = tables[group]
        lora_expand(out, h, lora.pool, slots, lora.page_tables, ranks, b_off, scalings, out_sizes=sizes,
                    segments=segments, pdl=pdl)

    def lora_into(out: Tensor, x: Tensor, group: int, used: int) -> None:
        expand(out, shrink(x, group, used), group)

    def serial(w: Tensor, x: Tensor, group: int, used: int) -> None:
        lora_into(torch.mm(x, w.t()), x, group, used)

    def shrink_beside(w: Tensor, x: Tensor, group: int, used: int) -> None:
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            h = shrink(x, group, used)
        out = torch.mm(x, w.t())
        main.wait_stream(side)
        expand(out, h, group)

    def lora_beside(w: Tensor, x: Tensor, group: int, used: int) -> None:
        # Allocated on the main stream, written on the side stream, read on the main one after the join.
        main = torch.cuda.current_stream()
        delta = torch.empty(batch, w.shape[0], device="cuda", dtype=dtype)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            delta.zero_()
            lora_into(delta, x, group, used)
        out = torch.mm(x, w.t())
        main.wait_stream(side)
        if mode == "side+add":
            out.add_(delta)

    project = {"none": lambda w, x, group, used: torch.mm(x, w.t()), "serial": serial, "serial+pdl": serial,
               "shrink-side": shrink_beside, "side+add": lora_beside, "side": lora_beside}[mode]

    def step() -> None:
        workspace.zero_()
        used = 0
        for layer in weights:
            for group, (w, x) in enumerate(zip(layer, inputs)):
                project(w, x, group, used)
                used += len(tables[group][4]) * RANK * batch
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--modes", nargs="+", default=["serial", "serial+pdl", "shrink-side", "side"],
                        choices=["serial", "serial+pdl", "shrink-side", "side+add", "side"],
                        help="how the LoRA runs (the GEMMs alone are always timed)")
    parser.add_argument("--out", default=str(RESULTS / "lora_overlap.json"))
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/experiments/lora_overlap.py: needs a CUDA GPU")
        return 0
    from slora.kernels.pdl import pdl_supported
    if "serial+pdl" in args.modes and not pdl_supported(torch.device("cuda")):
        print("benchmarks/experiments/lora_overlap.py: this GPU has no programmatic dependent launch; "
              "leave out serial+pdl")
        return 1
    rows = []
    print(f"{'batch':>5} {'adapters':>8} {'mode':>10} {'graph us / layer':>17}")
    for batch in args.batch:
        for adapters, table_slots in ((0, 4), (1, 4), (batch, batch)):
            for mode in (("none",) if adapters == 0 else tuple(args.modes)):
                us = graph_time_us(_runner(batch, max(adapters, 1), table_slots, mode))
                per_layer = None if us is None else us / LAYERS
                rows.append({"batch": batch, "adapters": adapters, "table_slots": table_slots, "mode": mode,
                             "graph_us_per_layer": per_layer})
                shown = float("nan") if per_layer is None else per_layer
                print(f"{batch:5d} {adapters:8d} {mode:>10} {shown:17.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "layers": LAYERS, "rank": RANK,
                               "rows": rows}, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
