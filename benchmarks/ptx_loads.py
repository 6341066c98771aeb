"""How the LoRA kernels load from global memory and what they ask of a multiprocessor, read from their code
for sm_90 (H100/H200), on any machine.

Triton compiles a kernel for a GPU it is not running on (the NVIDIA backend and its ptxas come with the
wheel), so the width of every global load can be counted without a GPU. The shrink and the expand are
compiled the way a decode step launches them (bfloat16, rank 16, pointers and sizes specialised as Triton
specialises them at launch: 16-byte aligned, divisible by 16), once with 128-column tiles (the default: a
tile's row may cross a page, so the page is chosen per column) and once with 64-column tiles (ALIGN, the
tiles of 64-element pages: the page is chosen per row, slora.kernels.lora._load_run), and the
global load instructions in each PTX are counted by width (instructions in the code, not executions: a
loop's body counts once). A 2-byte load (`b16`) moves one bfloat16; a `v4.b32` moves eight. From the
cubin (cuobjdump, also in the wheel): registers per thread; with Triton's shared memory, the programs one
multiprocessor holds at once (common.occupancy_columns). What the counts say depends on the Triton
version: run it with the GPU machine's (3.6; kernel_resources.py reads the variants compiled there).
Triton 3.9 compiles the 128-column tiles' per-column page choice to 2-byte loads, Triton 3.6 to 16-byte
loads.

    python benchmarks/ptx_loads.py [--quick] [--out PATH]

--quick is the same run (it takes seconds); it exists so that CI runs the script like the others. It
must run without TRITON_INTERPRET (the interpreter replaces the JIT functions that are compiled here).
"""
import argparse
import collections
import logging
import os
import re
import sys
from pathlib import Path

from common import cubin_resources, default_out, occupancy_columns, print_table, write_json

# Element types of the kernels' pointer arguments (the rest are int32 tables).
POINTER_TYPES = {"x_ptr": "*bf16", "pool_ptr": "*bf16", "out_ptr": "*bf16", "h_ptr": "*fp32", "scale_ptr": "*fp32",
                 "a_off_ptr": "*i64", "b_off_ptr": "*i64"}
# Integer arguments that a Llama-3-8B decode step passes as multiples of 16 (Triton specialises on it).
MULTIPLES_OF_16 = {"n0", "n1", "n2", "h_rank", "page_elems", "in_features", "row_stride", "max_rank", "k_per_split",
                   "stride_xt", "stride_ht", "stride_ot", "num_tiles", "rank_blocks"}
SM_90 = ("cuda", 90, 32)
# Tile widths: the kernels' default (128 columns, pages chosen per column) and ALIGN (64, page per row), the
# width of every tile in pages of 64 elements (a tile lies within a page).
TILES = (128, 64)
LOAD = re.compile(r"ld\.global(?:\.[a-z]+\d*)*?\.(v\d\.b\d+|b\d+)\s")

log = logging.getLogger("benchmarks.ptx_loads")


def signature_and_attrs(kernel: object) -> tuple[dict[str, str], dict[tuple[int, ...], list]]:
    """Argument types, and the divisibility Triton would give each argument at a decode step's launch
    (none for the ones the kernel does not specialise)."""
    unspecialised = set(getattr(kernel, "do_not_specialize", ()) or ())
    signature, attrs = {}, {}
    for index, param in enumerate(kernel.params):
        name = param.name
        if param.is_constexpr:
            signature[name] = "constexpr"
            continue
        signature[name] = POINTER_TYPES.get(name, "*i32") if name.endswith("_ptr") else "i32"
        specialised = name not in unspecialised and index not in unspecialised
        if specialised and (name.endswith("_ptr") or name in MULTIPLES_OF_16):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def compile_sm90(kernel: object, constexprs: dict[str, object]) -> object:
    """The kernel compiled for sm_90 with 4 warps and 2 stages (the LoRA kernels' launch options)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, attrs = signature_and_attrs(kernel)
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*SM_90), options={"num_warps": 4, "num_stages": 2})


def load_widths(ptx: str) -> collections.Counter:
    """Global loads in PTX, by width (`b16`, `b32`, `v4.b32`, ...)."""
    return collections.Counter(LOAD.findall(ptx))


def kernel_cases(tile: int) -> dict[str, tuple[object, dict[str, object]]]:
    """The decode step's LoRA kernels with the compile-time arguments of a rank-16, 64-token step whose tiles
    are `tile` columns wide (of these, each kernel gets the ones it declares)."""
    from slora.kernels import lora
    common = {"BLOCK_M": 16, "BLOCK_R": 16, "ALIGN_ELEMS": 64, "DOT_PRECISION": "tf32", "USE_PDL": False}
    cases = {"shrink": (lora._lora_shrink_kernel,
                        {**common, "BLOCK_K": tile, "ACCUMULATE": True, "HOIST_PAGES": True}),
             "expand": (lora._lora_expand_kernel, {**common, "BLOCK_N": tile, "N_TILES": 1, "ADD": True})}
    return {name: (kernel, {key: value for key, value in constexprs.items() if key in declared_constexprs(kernel)})
            for name, (kernel, constexprs) in cases.items()}


def declared_constexprs(kernel: object) -> set[str]:
    return {param.name for param in kernel.params if param.is_constexpr}


def rows() -> list[dict]:
    return [row(name, tile, kernel, constexprs)
            for tile in TILES for name, (kernel, constexprs) in kernel_cases(tile).items()]


def row(name: str, tile: int, kernel: object, constexprs: dict[str, object]) -> dict:
    compiled = compile_sm90(kernel, constexprs)
    widths = load_widths(compiled.asm["ptx"])
    return {"kernel": name, "tile": tile, "b16": widths.get("b16", 0), "v4_b32": widths.get("v4.b32", 0),
            "other": sum(widths.values()) - widths.get("b16", 0) - widths.get("v4.b32", 0),
            **occupancy_columns(cubin_resources(compiled.asm["cubin"]), compiled.metadata.num_warps,
                                compiled.metadata.shared)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the same run (seconds), as CI runs every script")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if os.environ.get("TRITON_INTERPRET") == "1":
        log.error("TRITON_INTERPRET=1 replaces the JIT functions this script compiles: run it without")
        return 2
    import triton
    table = rows()
    log.info("compiled by Triton %s", triton.__version__)
    print_table(table)
    out = Path(args.out) if args.out else default_out("ptx_loads", "cpu")
    write_json(out, {"benchmark": "ptx-loads", "target": "sm_90", "triton": triton.__version__, "quick": args.quick,
                     "rows": table})
    return 0


if __name__ == "__main__":
    sys.exit(main())
