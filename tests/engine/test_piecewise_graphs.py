"""The parts of the piecewise graphs (slora.piecewise_graphs) that need no GPU: the token buckets, which
steps the pieces take, and the switch. Capture and replay against eager steps: tests/e2e/test_gpu_engine.py."""
import dataclasses

import pytest
import torch

from slora import step_batch
from slora.config import CudaConfig
from slora.cuda_graphs import GraphLimits
from slora.piecewise_graphs import PiecewiseGraphs, token_buckets

LIMITS = GraphLimits(max_batch=8, max_blocks=4, max_adapter_pages=3, max_lora_rank=16, num_layers=2,
                     num_lora_modules=7, max_loras=2, mixed_tokens=200)


@pytest.mark.parametrize("max_tokens", [1, 16, 50, 64, 200, 512])
def test_every_step_up_to_max_tokens_has_a_bucket(max_tokens):
    buckets = token_buckets(max_tokens)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_tokens
    assert all(any(b >= size for b in buckets) for size in range(1, max_tokens + 1))
    # ...padded to at most twice its size, and past 64 tokens by fewer than 64.
    assert all(min(b for b in buckets if b >= n) <= max(min(2 * n, n + 63), 16) for n in range(1, max_tokens + 1))


def test_mixed_graph_tokens_is_validated():
    assert CudaConfig().mixed_graph_tokens > 0                       # on by default
    assert CudaConfig(mixed_graph_tokens=0).mixed_graph_tokens == 0  # the switch
    with pytest.raises(ValueError, match="mixed_graph_tokens must be >= 0"):
        CudaConfig(mixed_graph_tokens=-1)


def _pieces() -> PiecewiseGraphs:
    """Pieces over a CPU pool, not captured: fits() reads only the step's host tables."""
    return PiecewiseGraphs(torch.nn.Module(), torch.zeros(2, 10, 8), None, None, 16, LIMITS, LIMITS.mixed_tokens)


def _step(tokens: int, seqs: int, width: int = 2, samples: int | None = None, slots: int = 0,
          adapter_pages: int = 1) -> step_batch.StepBatch:
    sizes = {"tokens": tokens, "seqs": seqs, "pages": width, "slots": slots, "adapter_pages": adapter_pages,
             "layers": 2, "modules": 7}
    batch = step_batch.empty(sizes, torch.device("cpu"), 16, 16, with_lora=slots > 0)
    return dataclasses.replace(batch, sample_indices=torch.zeros(seqs if samples is None else samples,
                                                                 dtype=torch.long))


def test_steps_the_pieces_take_and_those_they_leave_to_eager():
    pieces = _pieces()
    assert pieces.buckets == [16, 32, 64, 128, 192, 200]
    assert pieces.seqs(16) == 8 and pieces.lora_slots(16) == 2 and pieces.seqs(200) == 8
    assert pieces.fits(_step(10, 3), 3) == 16
    assert pieces.fits(_step(65, 3), 3) == 128
    assert pieces.fits(_step(200, 8, slots=2), 8) == 200
    assert pieces.fits(_step(201, 3), 3) is None                    # more tokens than the largest bucket
    assert pieces.fits(_step(30, 3, samples=5), 3) is None          # prompt-logprob rows
    assert pieces.fits(_step(30, 3, width=5), 3) is None            # a block table wider than the buffers'
    assert pieces.fits(_step(30, 3, slots=3), 3) is None            # more adapters than the graphs' slots
    assert pieces.fits(_step(30, 3, slots=1, adapter_pages=4), 3) is None   # an adapter wider than the buffers'
