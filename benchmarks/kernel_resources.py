"""What each compiled variant of the LoRA kernels asks of a multiprocessor, and how many of its programs fit
on one at a time.

The decode step's LoRA kernels are chains of dependent loads (benchmarks/README.md): how many programs
each multiprocessor keeps in flight decides how much of that latency overlaps. This script runs the
Llama-3-8B layer's LoRA (kernels.py's `bench_lora`: 64 tokens, 1 shared and 64 distinct rank-16
adapters, 64 table slots, with and without programmatic dependent launch, and with 128- and 64-column tiles) so that
the kernels compile, then lists every compiled variant of the shrink and the expand with its registers
per thread and stack (where spilled registers go; both read from the cubin with cuobjdump), shared
memory and warps, and the programs per multiprocessor that those allow (`programs_per_sm`: registers,
warps, shared memory and the block limit, whichever binds first).

A diagnostic for the GPU only (no --quick: it runs the kernels, with the GPU machine's Triton);
benchmarks/ptx_loads.py reads the same from code it compiles on any machine. Results go to
benchmarks/README.md.

    python benchmarks/kernel_resources.py [--adapters 1 64] [--out PATH]

Under Nsight Compute (`STEPS=ncu bash benchmarks/gpu_check.sh`; ncu reads hardware counters only on some
of the device tool's machines, see its notes) with `--adapters 64` the first four expand launches are
the distinct-adapter layer's, without programmatic dependent launch.
"""
import argparse
import json
import logging
import re
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

# Registers are allocated per warp in units of this many (sm_90 and the generations before it).
REGISTER_UNIT = 256
# Shared memory the CUDA runtime reserves per block on sm_80 and later.
RESERVED_SHARED_PER_BLOCK = 1024

log = logging.getLogger("benchmarks.kernel_resources")


@dataclass(frozen=True)
class SmLimits:
    """One multiprocessor's limits; the defaults are the H100/H200's (sm_90)."""
    registers: int = 65536
    warps: int = 64
    blocks: int = 32
    shared_bytes: int = 233472

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    @classmethod
    def of_device(cls, device: torch.device) -> "SmLimits":
        props = torch.cuda.get_device_properties(device)
        default = cls()
        return cls(registers=getattr(props, "regs_per_multiprocessor", default.registers),
                   warps=props.max_threads_per_multi_processor // 32,
                   shared_bytes=getattr(props, "shared_memory_per_multiprocessor", default.shared_bytes))


@dataclass(frozen=True)
class Occupancy:
    programs: int   # programs (thread blocks) resident on one multiprocessor at once
    bound: str      # what limits them: "registers", "warps", "shared memory" or "blocks"


def programs_per_sm(registers_per_thread: int, num_warps: int, shared_bytes: int,
                    limits: SmLimits = SmLimits()) -> Occupancy:
    """Programs of a kernel that one multiprocessor holds at once, and the resource that bounds them."""
    if registers_per_thread < 0 or num_warps < 1 or shared_bytes < 0:
        raise ValueError(f"need registers_per_thread >= 0, num_warps >= 1 and shared_bytes >= 0, got "
                         f"{registers_per_thread}, {num_warps}, {shared_bytes}")
    per_warp = -(-max(registers_per_thread, 1) * 32 // REGISTER_UNIT) * REGISTER_UNIT
    by = {"registers": limits.registers // per_warp // num_warps,
          "warps": limits.warps // num_warps,
          "shared memory": limits.shared_bytes // (shared_bytes + RESERVED_SHARED_PER_BLOCK),
          "blocks": limits.blocks}
    bound = min(by, key=by.__getitem__)
    return Occupancy(by[bound], bound)


def compiled_variants(kernel: object) -> list[object]:
    """The compiled variants a Triton JIT function holds for every device: its device caches' first
    element (the kernel cache) in Triton 3.x. Empty when this Triton keeps them elsewhere."""
    variants = []
    for entry in getattr(kernel, "device_caches", {}).values():
        cache = entry[0] if isinstance(entry, tuple) else entry
        if isinstance(cache, dict):
            variants += list(cache.values())
    return variants


class CubinResources(NamedTuple):
    registers: int     # per thread
    stack_bytes: int   # per thread: the stack frame, where spilled registers go


def cubin_resources(cubin: bytes) -> CubinResources | None:
    """Registers and stack of a cubin's kernel, from cuobjdump (the one in Triton's wheel); None without it.
    Reads the compiled code itself, on any machine (benchmarks/ptx_loads.py compiles without a GPU)."""
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        done = subprocess.run([str(tool), "--dump-resource-usage", file.name], capture_output=True, text=True,
                              timeout=60)
    found = re.search(r"REG:(\d+) STACK:(\d+)", done.stdout)
    return CubinResources(int(found.group(1)), int(found.group(2))) if found else None


def occupancy_columns(resources: CubinResources | None, num_warps: int, shared_bytes: int,
                      limits: SmLimits = SmLimits()) -> dict:
    """A compiled kernel's registers, stack, shared memory and warps, and the programs they leave room for
    on one multiprocessor (None where the registers are unknown)."""
    occupancy = programs_per_sm(resources.registers, num_warps, shared_bytes, limits) if resources else None
    return {"registers": resources.registers if resources else None,
            "stack_bytes": resources.stack_bytes if resources else None,
            "shared_bytes": shared_bytes, "num_warps": num_warps,
            "programs_per_sm": occupancy.programs if occupancy else None,
            "bound_by": occupancy.bound if occupancy else None,
            "warps_per_sm": occupancy.programs * num_warps if occupancy else None}


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
    from kernels import LoraKnobs, bench_lora
    from slora.kernels.pdl import pdl_supported

    gen = torch.Generator().manual_seed(0)
    pdl_options = (False, True) if pdl_supported(torch.device("cuda")) else (False,)
    for adapters in adapter_counts:
        for pdl in pdl_options:
            for tile in (None, 64):
                knobs = LoraKnobs(pdl=pdl, shrink_tile=tile, expand_tile=tile)
                bench_lora(adapters, 64, 16, gen, knobs=knobs, baseline=False, table_slots=64)


def print_rows(rows: list[dict]) -> None:
    columns = list(rows[0]) if rows else []
    sys.stdout.write("  ".join(f"{c:>14}" for c in columns) + "\n")
    for row in rows:
        sys.stdout.write("  ".join(f"{str(row[c]):>14}" for c in columns) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="benchmarks/results/kernel_resources.json")
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
