"""benchmarks/common.py's Llama-3-8B shape facts, which the GPU-only experiments build their GEMMs from."""
from benchmark_modules import load_benchmark


def test_fused_gemm_shapes_are_the_layers_four_projections_as_the_model_fuses_them():
    common = load_benchmark("common.py", "bench_common_shapes")
    # q/k/v: 4,096 in, 4,096 + 2 x 1,024 out; o; gate/up: 2 x 14,336 out; down: 14,336 in.
    assert common.fused_gemm_shapes() == [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]
