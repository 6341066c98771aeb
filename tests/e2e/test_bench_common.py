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


def test_prefill_layer_summary_counts_the_engines_rows_not_their_namesakes():
    """prefill.py's layer sum takes each kernel's own row: o and down into the residual, and gate/up alone,
    not the row of gate/up timed with the attention after it, whose name starts the same way."""
    prefill = load_benchmark("prefill.py", "prefill_bench")
    times = {"gemm qkv [8192x4096]x[4096x6144]": 500.0, "gemm o [8192x4096]x[4096x4096]": 400.0,
             "gemm o into the residual": 390.0, "gemm gate_up [8192x4096]x[4096x28672]": 2800.0,
             "gemm down [8192x14336]x[14336x4096]": 1450.0, "gemm down into the residual": 1440.0,
             "gemm gate_up, then the engine's attention": 3070.0, "rms_norm (x alone)": 30.0,
             prefill.ROTARY_STORE: 70.0, "silu_and_mul": 175.0, prefill.ENGINE_ATTENTION: 210.0}
    summary = prefill.layer_summary([{"kernel": name, "us": us} for name, us in times.items()], 8192)
    assert summary["layer_gemm_us"] == 500.0 + 390.0 + 2800.0 + 1440.0
    assert summary["layer_other_us"] == 2 * 30.0 + 70.0 + 175.0 + 210.0
    assert summary["step_ms"] == pytest.approx(32 * (5130.0 + 515.0) / 1e3)


def test_copy_host_refuses_without_a_gpu_and_bad_sizes(monkeypatch):
    """experiments/copy_host.py times CUDA copies: on a machine without one it says so, and it refuses byte
    counts that are not positive before it looks."""
    import argparse

    copy_host = load_benchmark("experiments/copy_host.py", "bench_copy_host")
    assert copy_host.parse_sizes("4096, 65536") == (4096, 65536)
    with pytest.raises(argparse.ArgumentTypeError, match="positive byte counts"):
        copy_host.parse_sizes("4096,0")
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(SystemExit, match="it needs a GPU"):
        copy_host.main(["--quick"])


def test_copy_host_refuses_a_count_of_calls_below_one():
    copy_host = load_benchmark("experiments/copy_host.py", "bench_copy_host_calls")
    with pytest.raises(SystemExit) as refused:
        copy_host.main(["--calls", "0"])
    assert refused.value.code == 2                  # argparse's refusal, before any look for a GPU
