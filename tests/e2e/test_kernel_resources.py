"""benchmarks/experiments/kernel_resources.py: the occupancy arithmetic (benchmarks/common.py) and the reading
of compiled variants, on the CPU with stand-ins for Triton's compiled kernels (the script itself needs a GPU)."""
from types import SimpleNamespace

import pytest
from benchmark_modules import load_benchmark


@pytest.fixture(scope="module")
def kr():
    return load_benchmark("experiments/kernel_resources.py", "bench_kernel_resources")


@pytest.fixture(scope="module")
def common():
    return load_benchmark("common.py", "bench_common")


@pytest.mark.parametrize("registers,warps,shared,programs,bound", [
    (128, 4, 0, 4, "registers"),          # 4,096 registers a warp: 16 warps fit, 4 programs of 4
    (40, 1, 0, 32, "blocks"),             # 1,280 a warp: 51 warps fit by registers, 32 blocks at most
    (32, 4, 100_000, 2, "shared memory"),
    (16, 16, 0, 4, "warps"),              # 512 a warp: 128 warps by registers, 64 warps at most
])
def test_programs_per_sm_names_the_binding_limit(common, registers, warps, shared, programs, bound):
    assert common.programs_per_sm(registers, warps, shared) == common.Occupancy(programs, bound)


def test_registers_are_allocated_per_warp_in_units(common):
    # 33 registers a thread are 1,056 a warp, allocated as 1,280: 51 warps, so 12 programs of 4 warps.
    assert common.programs_per_sm(33, 4, 0).programs == 12


def test_bad_arguments_are_refused(common):
    with pytest.raises(ValueError, match="num_warps"):
        common.programs_per_sm(32, 0, 0)
    with pytest.raises(ValueError, match="registers"):
        common.SmLimits(registers=0)


def test_compiled_variants_reads_the_kernel_cache_of_every_device(kr):
    first, second = object(), object()
    kernel = SimpleNamespace(device_caches={0: ({"a": first}, {}, "target", "backend", "binder"),
                                            1: ({"b": second}, {}, "target", "backend", "binder")})
    assert kr.compiled_variants(kernel) == [first, second]
    assert kr.compiled_variants(SimpleNamespace()) == []


def test_resource_row_from_a_compiled_variant(kr, common, monkeypatch):
    # The registers come from the cubin through cuobjdump (tests/kernels/test_ptx_loads.py reads a real one);
    # here the reading is stubbed, and the row is built around it.
    cubins = []
    monkeypatch.setattr(kr, "cubin_resources", lambda cubin: cubins.append(cubin) or common.CubinResources(96, 0))
    fn = SimpleNamespace(arg_names=["x_ptr", "n", "BLOCK_M", "USE_PDL"])
    compiled = SimpleNamespace(asm={"cubin": b"cubin"}, metadata=SimpleNamespace(num_warps=4, shared=8192),
                               src=SimpleNamespace(fn=fn, constants={(2,): 16, (3,): True}))
    row = kr.resource_row("expand", compiled, common.SmLimits())
    assert cubins == [b"cubin"] and (row["registers"], row["stack_bytes"]) == (96, 0)
    # 96 x 32 = 3,072 registers a warp: 21 warps, so 5 programs of 4 warps.
    assert row["programs_per_sm"] == 5 and row["bound_by"] == "registers" and row["warps_per_sm"] == 20
    assert row["constexprs"] == "BLOCK_M=16 USE_PDL=True"
    assert kr.constexprs(SimpleNamespace()) == "unknown"
