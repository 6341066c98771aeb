"""Programmatic dependent launch (pdl=True) of the decode-path kernels: refused where unsupported, and on a
GPU that has it, the same numbers as without it when a chain of dependent kernels runs from a CUDA graph."""
import pytest
import torch
from kernel_helpers import has_pdl, make_generator, make_paged_kv, randn

from slora.kernels.fused_ops import rms_norm, rotary_qk_, silu_and_mul
from slora.kernels.paged_attention import paged_attention
from slora.kernels.reference import PagedKV

HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 64, 16


def _cpu_calls() -> dict[str, object]:
    gen = make_generator(3)
    kv = make_paged_kv([20, 5], PAGE, KV_HEADS, HEAD_DIM, torch.float32, gen)
    qkv = randn((2, (HEADS + 2 * KV_HEADS) * HEAD_DIM), torch.float32, gen)
    cos_sin = randn((2, HEAD_DIM), torch.float32, gen)
    return {
        "rms_norm": lambda: rms_norm(qkv, torch.ones(qkv.shape[1]), 1e-6, pdl=True),
        "rotary_qk_": lambda: rotary_qk_(qkv, cos_sin, cos_sin, HEADS, KV_HEADS, HEAD_DIM, pdl=True),
        "silu_and_mul": lambda: silu_and_mul(qkv, pdl=True),
        "rotary_qk_ with kv": lambda: rotary_qk_(qkv, cos_sin, cos_sin, HEADS, KV_HEADS, HEAD_DIM,
                                                 kv=PagedKV(kv.kv_pool, torch.tensor([3, 4]), PAGE), pdl=True),
        "paged_attention": lambda: paged_attention(qkv[:, :HEADS * HEAD_DIM].view(2, HEADS, HEAD_DIM), kv.kv_pool,
                                                   kv.block_tables, kv.context_lens, PAGE, KV_HEADS, 0.125, pdl=True),
    }


@pytest.mark.parametrize("name", sorted(_cpu_calls()))
def test_pdl_is_refused_without_a_gpu_that_has_it(name):
    with pytest.raises(ValueError, match="compute capability 9.0"):
        _cpu_calls()[name]()


def _decode_chain(qkv_source: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv, slots: torch.Tensor,
                  weights: tuple[torch.Tensor, torch.Tensor], num_splits: int, pdl: bool) -> torch.Tensor:
    """The decode layer's Triton kernels back to back, each reading what the one before it wrote (all
    launched with pdl when it is set: every link of the chain is kernel to kernel)."""
    batch = qkv_source.shape[0]
    qkv, _ = rms_norm(qkv_source, weights[0], 1e-6, pdl=pdl)   # [batch, (heads + 2 kv) * head_dim]
    rotary_qk_(qkv, cos, sin, HEADS, KV_HEADS, HEAD_DIM, kv=PagedKV(kv.kv_pool, slots, PAGE), pdl=pdl)
    q = qkv[:, :HEADS * HEAD_DIM]
    attn = paged_attention(q.view(batch, HEADS, HEAD_DIM), kv.kv_pool, kv.block_tables, kv.context_lens, PAGE,
                           KV_HEADS, HEAD_DIM ** -0.5, num_splits=num_splits, pdl=pdl).view(batch, -1)
    normed, _ = rms_norm(attn, weights[1], 1e-6, pdl=pdl)   # [batch, heads * head_dim]
    return silu_and_mul(normed, pdl=pdl)


@pytest.mark.gpu
@pytest.mark.skipif(not has_pdl(), reason="needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_splits", [1, 4])          # with and without the merge kernel
def test_pdl_decode_chain_in_a_graph_matches_plain_launches_gpu(dtype, num_splits):
    gen = make_generator(num_splits)
    batch, lengths = 6, [700, 1, 16, 17, 300, 64]         # the new token is the last of each context
    kv = make_paged_kv(lengths, PAGE, KV_HEADS, HEAD_DIM, dtype, gen, "cuda")
    pages = kv.block_tables.long()
    last = torch.tensor(lengths, device="cuda") - 1
    slots = pages[torch.arange(batch, device="cuda"), last // PAGE] * PAGE + last % PAGE
    source = randn((batch, (HEADS + 2 * KV_HEADS) * HEAD_DIM), dtype, gen, "cuda")
    cos, sin = randn((batch, HEAD_DIM), dtype, gen, "cuda"), randn((batch, HEAD_DIM), dtype, gen, "cuda")
    weights = (randn((source.shape[1],), dtype, gen, "cuda"), randn((HEADS * HEAD_DIM,), dtype, gen, "cuda"))
    args = (cos, sin, kv, slots, weights, num_splits)
    _decode_chain(source, *args, pdl=True)                 # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = _decode_chain(source, *args, pdl=True)
    for _ in range(2):                                     # replays read the new inputs, not stale ones
        source.copy_(randn(tuple(source.shape), dtype, gen, "cuda"))
        graph.replay()
        want = _decode_chain(source, *args, pdl=False)
        torch.cuda.synchronize()
        assert torch.equal(result, want)
