"""What each compiled variant of the LoRA kernels asks of a multiprocessor, and how many of its programs fit
on one at a time.

The decode step's LoRA kernels are chains of dependent loads (benchmarks/README.md): how many programs
each multiprocessor keeps in flight decides how much of that latency overlaps. This script runs the
Llama-3-8B layer's LoRA (common.lora_layer_step: 64 tokens, 1 shared and 64 distinct rank-16 adapters,
64 table slots, with and without programmatic dependent launch) so that the kernels compile, then lists
every compiled variant of the shrink and the expand with its registers per thread and stack (where
spilled registers go; both read from the cubin with cuobjdump), shared memory and warps, and the programs
per multiprocessor that those allow (common.programs_per_sm: registers, warps, shared memory and the
block limit, whichever binds first).

A diagnostic for the GPU only (no --quick: it runs the kernels, with the GPU machine's Triton);
experiments/ptx_loads.py reads the same from code it compiles on any machine.

    python benchmarks/experiments/kernel_resources.py [--adapters 1 64] [--out PATH]

Under Nsight Compute (`STEPS=ncu bash benchmarks/gpu_check.sh`; ncu reads hardware counters only on some
of the device tool's machines, see its notes) with `--adapters 64` the first four expand launches are
the distinct-adapter layer's, without programmatic dependent launch.
"""
import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # benchmarks/, for common.py
from common import RESULTS, LoraKnobs, SmLimits, cubin_resources, lora_layer_step, occupancy_columns  # noqa: E402

log = logging.getLogger("benchmarks.kernel_resources")


def compiled_variants(kernel: object) -> list[object]:
    """The compiled variants a Triton JIT function holds for every device: its device caches' first
    element (the kernel cache) in Triton 3.x. Empty when this Triton keeps them elsewhere."""
    variants = []
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            variants += list(cache.values())
    return variants


def resource_row(name: str, compiled: object, limits: SmLimits) -> dict:
    """Compile-time arguments, registers, stack, shared memory, warps and occupancy of one compiled variant."""
    metadata = compiled.metadata
    return {"kernel": name, "constexprs": constexprs(compiled),
            **occupancy_columns(cubin_resources(compiled.asm["cubin"]), metadata.num_warps, metadata.shared, limits)}


def constexprs(compiled: object) -> str:
    """`NAME=value` for the compile-time arguments of a variant (which launch choice it is), or "unknown"
    where this Triton's compiled kernel does not say them the way Triton 3.x does (src.constants keyed
    by argument index paths)."""
    try:
        names, constants = compiled.src.fn.arg_names, compiled.src.constants
        return " ".join(f"{names[path[0]]}={value}" for path, value in sorted(constants.items())
                        if names[path[0]].isupper())
    except (AttributeError, IndexError, TypeError):
        return "unknown"


def lora_kernels() -> dict[str, object]:
    from slora.kernels import lora
    return {"shrink": lora._lora_shrink_kernel, "expand": lora._lora_expand_kernel}


def compile_lora_layer(adapter_counts: tuple[int, ...] = (1, 64)) -> None:
    """Run the layer's LoRA in the configurations the decode step uses, so that their variants compile."""
    from slora.kernels.pdl import pdl_supported

    gen = torch.Generator().manual_seed(0)
    pdl_options = (False, True) if pdl_supported(torch.device("cuda")) else (False,)
    for adapters in adapter_counts:
        for pdl in pdl_options:
            lora_layer_step(adapters, 64, 16, gen, LoraKnobs(pdl=pdl), table_slots=64).run()
    torch.cuda.synchronize()


def print_rows(rows: list[dict]) -> None:
    columns = list(rows[0]) if rows else []
    sys.stdout.write("  ".join(f"{c:>14}" for c in columns) + "\n")
    for row in rows:
        sys.stdout.write("  ".join(f"{str(row[c]):>14}" for c in columns) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / "kernel_resources.json"))
    parser.add_argument("--adapters", type=int, nargs="+", default=[1, 64],
                        help="adapters of the 64-token layers run (1: shared, 64: one per token)")
    args = parser.parse_args(argv)
    if any(count < 1 or count > 64 for count in args.adapters):
        parser.error(f"--adapters must be between 1 and 64 (the layer has 64 tokens), got {args.adapters}")
    logging.basicConfig(level=logging.INFO)
    if not torch.cuda.is_available():
        log.warning("kernel_resources.py reads compiled GPU kernels: no GPU here, nothing to do")
        return 0
    compile_lora_layer(tuple(args.adapters))
    limits = SmLimits.of_device(torch.device("cuda"))
    rows = [resource_row(name, compiled, limits)
            for name, kernel in lora_kernels().items() for compiled in compiled_variants(kernel)]
    if not rows:
        log.error("found no compiled variants: this Triton keeps them somewhere compiled_variants does not look")
        return 1
    print_rows(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "limits": asdict(limits), "rows": rows},
                              indent=2))
    log.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
