"""The parts of the mixed-step graphs (slora.execution.mixed_graphs) that need no GPU: the token buckets, which
steps the graphs take, what a step is staged as, and the switch. Capture and replay against eager steps:
tests/e2e/test_gpu_engine.py; the recorded forward, uncaptured, on the CPU: tests/e2e/test_triton_backend_cpu.py.
Also the decode graphs' (slora.execution.cuda_graphs) choice of the steps they take."""
import contextlib
import dataclasses
import os

import numpy as np
import pytest
import torch

from slora.config import CudaConfig
from slora.execution import step_batch
from slora.execution.cuda_graphs import DecodeGraphs, GraphLimits
from slora.execution.mixed_graphs import (
    ATTENTION_INPUTS,
    CUBLAS_WORKSPACE_CONFIG,
    BucketGraph,
    MixedGraphs,
    attention_inputs,
    buckets_worth_keeping,
    cublas_without_workspace,
    split_attention_inputs,
    token_buckets,
)
from slora.execution.pool_memory import PoolViews
from slora.kernels.reference import KVCache

LIMITS = GraphLimits(max_batch=8, max_blocks=4, max_adapter_pages=3, max_lora_rank=16, num_layers=2,
                     num_lora_modules=7, max_loras=2, mixed_tokens=200)


@pytest.mark.parametrize("max_tokens", [1, 16, 50, 64, 200, 512])
def test_every_step_up_to_max_tokens_has_a_bucket(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    assert all(any(b >= size for b in buckets) for size in range(1, max_tokens + 1))
    # ...padded to at most twice its size, and past 64 tokens by fewer than 64.
    assert all(min(b for b in buckets if b >= n) <= max(min(2 * n, n + 63), 16) for n in range(1, max_tokens + 1))


def test_a_bucket_slower_than_a_larger_one_is_dropped():
    """448 replays slower than 512 (a GEMM cuBLAS picks badly there): its steps pad to 512. Within the margin
    (noise) a bucket stays, and the largest always does."""
    seconds = {64: 1.0, 128: 1.5, 448: 9.0, 512: 6.0}
    assert buckets_worth_keeping(seconds) == [64, 128, 512]
    assert buckets_worth_keeping({16: 1.05, 32: 1.0, 64: 1.2}) == [16, 32, 64]
    assert buckets_worth_keeping({16: 1.2, 32: 1.0, 64: 1.0}) == [32, 64]
    # Compared with the fastest larger bucket, dropped or not: 128 loses to 512 even past a slow 448.
    assert buckets_worth_keeping({128: 7.0, 448: 9.0, 512: 6.0}) == [512]


def test_steps_pad_past_a_dropped_bucket():
    graphs = _graphs()
    graphs.usable = {False: [16, 32, 64, 200], True: graphs.buckets}
    assert graphs.fits(_step(100, 3), 3) == 200
    assert graphs.fits(_step(100, 3, slots=1), 3) == 128


def test_mixed_graph_tokens_is_validated():
    assert CudaConfig().mixed_graph_tokens > 0                       # on by default
    assert CudaConfig(mixed_graph_tokens=0).mixed_graph_tokens == 0  # the switch
    with pytest.raises(ValueError, match="mixed_graph_tokens must be >= 0"):
        CudaConfig(mixed_graph_tokens=-1)


@pytest.mark.parametrize("before", [None, ":4096:8"])
def test_the_workspace_setting_is_restored_after_the_captures(monkeypatch, before):
    """Inside, cuBLAS is told no workspace; after it (an error too), the setting is what it was, or unset."""
    if before is None:
        monkeypatch.delenv(CUBLAS_WORKSPACE_CONFIG, raising=False)
    else:
        monkeypatch.setenv(CUBLAS_WORKSPACE_CONFIG, before)
    with cublas_without_workspace():
        assert os.environ[CUBLAS_WORKSPACE_CONFIG] == ":0:0"
    assert os.environ.get(CUBLAS_WORKSPACE_CONFIG) == before
    with pytest.raises(RuntimeError, match="capture failed"), cublas_without_workspace():
        raise RuntimeError("capture failed")
    assert os.environ.get(CUBLAS_WORKSPACE_CONFIG) == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gemm_captured_without_the_workspace_has_no_memset():
    """The Llama-3-8B gate/up GEMM at 512 rows: cuBLAS (torch 2.11, H200) zeroes a counter in its workspace
    first, a memset node in a graph; captured inside the context on a stream of its own, it has none, and
    its product is the same. Skipped where cuBLAS puts no memset there even with its workspace."""
    x = torch.randn(512, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(28672, 4096, device="cuda", dtype=torch.bfloat16) / 64
    with_workspace, out = _captured_gemm(x, weight, torch.cuda.Stream(), contextlib.nullcontext())
    without, out_without = _captured_gemm(x, weight, torch.cuda.Stream(), cublas_without_workspace())
    if _memsets(with_workspace) == 0:
        pytest.skip("cuBLAS puts no memset before this GEMM on this GPU: nothing for the context to remove")
    assert _memsets(without) == 0
    torch.testing.assert_close(out_without, out, rtol=1e-2, atol=1e-2)


def _captured_gemm(x: torch.Tensor, weight: torch.Tensor, stream: torch.cuda.Stream,
                   context: contextlib.AbstractContextManager) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A graph of `x @ weight.T` captured on `stream` inside `context`, replayed once; and its output."""
    graph = torch.cuda.CUDAGraph()
    with context, torch.cuda.graph(graph, stream=stream):
        out = torch.nn.functional.linear(x, weight)                      # [rows, out features]
    graph.replay()
    torch.cuda.synchronize()
    return graph, out


def _memsets(graph: torch.cuda.CUDAGraph) -> int:
    """The memsets on the device in one replay of the graph."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    return sum(event.device_type == torch.autograd.DeviceType.CUDA and "memset" in event.name.lower()
               for event in prof.events())


def _graphs() -> MixedGraphs:
    """Graphs over a CPU pool, not captured: fits() reads only the step's host tables."""
    return MixedGraphs(torch.nn.Module(), _cpu_pool(), None, None, 16, LIMITS)


def _cpu_pool() -> PoolViews:
    """Two layers of 10 pages of 8 elements: the graphs read only its device."""
    layers = (torch.zeros(10, 8), torch.zeros(10, 8))
    return PoolViews(layers, tuple(KVCache(t) for t in layers))


def _step(tokens: int, seqs: int, width: int = 2, samples: int | None = None, slots: int = 0,
          adapter_pages: int = 1) -> step_batch.HostBatch:
    sizes = {"tokens": tokens, "seqs": seqs, "pages": width, "slots": slots, "adapter_pages": adapter_pages,
             "layers": 2, "modules": 7}
    batch = step_batch.as_host(step_batch.empty(sizes, torch.device("cpu"), 16, 16, with_lora=slots > 0))
    return dataclasses.replace(batch, sample_indices=np.zeros(seqs if samples is None else samples, dtype=np.int64))


def test_steps_the_graphs_take_and_those_they_leave_to_eager():
    graphs = _graphs()
    assert graphs.buckets == [16, 32, 64, 128, 192, 200]
    assert graphs.seqs(16) == 8 and graphs.adapter_slots(16) == 2 and graphs.seqs(200) == 8
    assert graphs.fits(_step(10, 3), 3) == 16
    assert graphs.fits(_step(65, 3), 3) == 128
    assert graphs.fits(_step(200, 8, slots=2), 8) == 200
    assert graphs.fits(_step(201, 3), 3) is None                    # more tokens than the largest bucket
    assert graphs.fits(_step(30, 3, samples=5), 3) is None          # prompt-logprob rows
    assert graphs.fits(_step(30, 3, width=5), 3) is None            # a block table wider than the buffers'
    assert graphs.fits(_step(30, 3, slots=3), 3) is None            # more adapters than the graphs' slots
    assert graphs.fits(_step(30, 3, slots=1, adapter_pages=4), 3) is None   # an adapter wider than the buffers'


def test_the_decode_graphs_take_a_decode_step_whose_tables_fit_their_buffers():
    """The decode graphs' (slora.execution.cuda_graphs) counterpart of fits: the smallest batch bucket, unless the step's
    block table or adapter tables outgrow the bucket's static buffers."""
    limits = dataclasses.replace(LIMITS, lora_side_stream=False)      # no side stream: no CUDA needed
    graphs = DecodeGraphs(torch.nn.Module(), _cpu_pool(), None, None, 16, limits)
    assert graphs.buckets == [1, 2, 4, 8]
    assert graphs.fits(_step(3, 3), 3) == 4
    assert graphs.fits(_step(3, 3, slots=2), 3) == 4
    assert graphs.fits(_step(9, 9), 9) is None                      # more sequences than the largest bucket
    assert graphs.fits(_step(3, 3, width=5), 3) is None             # a block table wider than the buffers'
    assert graphs.fits(_step(3, 3, slots=3), 3) is None             # more adapters than the bucket's slots
    assert graphs.fits(_step(3, 3, slots=1, adapter_pages=4), 3) is None   # an adapter wider than the buffers'


def _host_step() -> step_batch.HostBatch:
    """Two decode rows, then a 8-token prompt."""
    int32 = np.int32
    return dataclasses.replace(
        _step(10, 3), input_ids=np.arange(10) + 100, block_tables=np.array([[3, 4], [5, 0], [6, 8]], dtype=int32),
        query_start_loc=np.array([0, 1, 2, 10], dtype=int32), context_lens=np.array([20, 9, 8], dtype=int32),
        sample_indices=np.array([0, 1, 9]), max_query_len=8, max_context_len=20, num_decodes=2)


def test_attention_inputs_leave_the_decode_sequences_and_those_past_the_step_empty():
    """The decode kernel sees context only on the decode rows; the prefill kernel's sequences start as the
    step's do but for the decode ones, which start (and end) at the first prefill row, and those past the
    step, which start at its end."""
    inputs = attention_inputs(_host_step(), 6)
    assert inputs.decode_context_lens.tolist() == [20, 9, 0, 0, 0, 0]
    assert inputs.prefill_start_loc.tolist() == [2, 2, 2, 10, 10, 10, 10]
    none = attention_inputs(dataclasses.replace(_host_step(), num_decodes=0), 3)
    assert none.decode_context_lens.tolist() == [0, 0, 0] and none.prefill_start_loc.tolist() == [0, 1, 2, 10]


def test_a_step_staged_into_a_bucket_is_what_its_graph_reads():
    """stage() writes a step into a host twin of a bucket's static inputs and sends it, whichever twin is
    current and whatever a larger step left in it: the step's rows, its query starts, its sampled rows and
    then row 0, the sequences past it starting at its end, and its attention inputs."""
    graphs = _graphs()
    seqs = graphs.seqs(32)
    captured = BucketGraph(None, graphs.staged.views(graphs._sizes(32), with_lora=False), torch.zeros(0))
    int32 = np.int32
    larger = dataclasses.replace(_step(30, seqs), query_start_loc=np.full((seqs + 1,), 7, dtype=int32),
                                 sample_indices=np.full((seqs,), 9), context_lens=np.full((seqs,), 5, dtype=int32),
                                 num_decodes=seqs)
    host = _host_step()
    feed = step_batch.TokenFeed([1], [0], torch.tensor([55]))
    for earlier in range(3):                  # after one, two and three larger steps: each twin in turn
        for _ in range(earlier + 1):
            graphs.stage(captured, larger, None)
        graphs.stage(captured, host, feed)
        static = captured.views.device
        assert static.block_tables[:3, :2].tolist() == host.block_tables.tolist()
        assert static.context_lens[:3].tolist() == [20, 9, 8]
        # Past the step, the sequences start at its end (not at the larger step's 7): still ascending.
        assert static.query_start_loc.tolist() == [0, 1, 2, 10] + [10] * (seqs - 3)
        assert static.sample_indices.tolist() == [0, 1, 9] + [0] * 5
        assert static.input_ids[:10].tolist() == [100, 55, *range(102, 110)]      # row 1 fed on the device
        assert static.kv_locations[10:].eq(-1).all()                              # padding rows store no K/V
        packed = graphs.staged.device_extra(ATTENTION_INPUTS)[:2 * seqs + 1]
        for got, want in zip(split_attention_inputs(packed), attention_inputs(host, seqs)):
            assert torch.equal(got, want)
