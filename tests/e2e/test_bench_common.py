"""benchmarks/common.py's Llama-3-8B shape facts, which the GPU-only experiments build their GEMMs from, and
what one of those experiments checks before it needs a GPU."""
import pytest
from benchmark_modules import load_benchmark


def test_fused_gemm_shapes_are_the_layers_four_projections_as_the_model_fuses_them():
    common = load_benchmark("common.py", "bench_common_shapes")
    # q/k/v: 4,096 in, 4,096 + 2 x 1,024 out; o; gate/up: 2 x 14,336 out; down: 14,336 in.
    assert common.fused_gemm_shapes() == [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]


def test_graph_launch_refuses_an_unknown_group_before_it_looks_for_a_gpu(monkeypatch):
    graph_launch = load_benchmark("experiments/graph_launch.py", "bench_graph_launch")
    monkeypatch.setattr("sys.argv", ["graph_launch.py", "--groups", "shapes,bogus"])
    with pytest.raises(SystemExit, match=r"unknown groups \['bogus'\]: pick from synthetic, gemms, shapes, gate_up, engine"):
        graph_launch.main()
