"""Attention behind the model (DESIGN §4): torch references on the CPU, Triton kernels on CUDA."""
from typing import TYPE_CHECKING, Protocol

import torch
from torch import Tensor

from slora.kernels import reference
from slora.kernels.layout import cdiv
from slora.lora_backend import LoraBackend, LoraLaunchPolicy, ReferenceLora, TritonLora
from slora.step_batch import StepBatch

if TYPE_CHECKING:
    from slora.mixed_graphs import AttentionInputs


class AttentionBackend(Protocol):
    """The attention kernels the model calls."""

    # Whether the model's kernels launch with programmatic dependent launch (slora.kernels.pdl).
    pdl: bool

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None: ...

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: Tensor, batch: StepBatch,
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """Attention `[tokens, heads, head_dim]` of the step's queries, written into `out` when given."""


class ReferenceAttention:
    """Every token of the step, prefill or decode, through the reference prefill attention."""

    pdl = False

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        reference.store_kv(key, value, kv_pool, slot_mapping, page_size)

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: Tensor, batch: StepBatch,
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """Attention of the step's queries over the pool, where store_kv has put the step's new_kv too."""
        result = reference.prefill_attention(query, kv_pool, batch.block_tables, batch.query_start_loc,
                                             batch.context_lens, batch.page_size, num_kv_heads, scale)
        return result if out is None else out.copy_(result)


# Prefill tokens from which a step's attention reads their K/V from the step's own rows (tensor descriptors):
# its launch costs the host about 45 us more than reading them back from the pages (H200, triton 3.6), which
# a small step, whose host work runs beside its GPU time, cannot spare; from here on the GPU time it saves
# outweighs it (benchmarks/HISTORY.md, session 18).
NEW_KV_MIN_TOKENS = 2048


class TritonAttention:
    """Decode-only steps through the paged decode kernel (GQA, split context); any step with a prefill
    through the prefill kernel, which handles one-token rows as well. Triton is imported only here, when
    a CUDA engine is built."""

    def __init__(self, pdl: bool = False, new_kv_min_tokens: int = NEW_KV_MIN_TOKENS,
                 flash_prefill: bool = False) -> None:
        from slora.kernels.paged_attention import paged_attention
        from slora.kernels.prefill_attention import LONG_BLOCK_M, prefill_attention
        from slora.kernels.store_kv import store_kv
        if new_kv_min_tokens < 0:
            raise ValueError(f"new_kv_min_tokens must be >= 0, got {new_kv_min_tokens}")
        self._paged, self._prefill, self._store = paged_attention, prefill_attention, store_kv
        self.pdl = pdl   # the model's kernels use programmatic dependent launch (slora.kernels.pdl)
        self.new_kv_min_tokens = new_kv_min_tokens
        # An eager step's trailing prompts from position 0 (StepBatch.fresh_seqs) attend through
        # FlashAttention-2 in bfloat16 / float16 (flash_supported): 164 against 271 us a layer at 8 x 1,024
        # tokens on the H200 (benchmarks/HISTORY.md, session 17).
        self.flash_prefill = flash_prefill
        self._long_block_m = LONG_BLOCK_M

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        self._store(key, value, kv_pool, slot_mapping, page_size, pdl=self.pdl)

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: Tensor, batch: StepBatch,
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """The step's queries `[tokens, heads, head_dim]` over the pool, which holds new_kv (the step's keys
        and values, `[tokens, kv_heads, head_dim]` each) too. With at least new_kv_min_tokens prefill tokens
        the prefill kernel reads them from new_kv, contiguous rows instead of pages spread over the pool,
        and only cached prefixes through pages; a smaller step reads them back from the pages. The step's
        trailing prompts from position 0 (StepBatch.fresh_seqs) read theirs from new_kv through
        FlashAttention-2 instead (flash_prefill)."""
        if batch.max_query_len == 1:
            return self._paged(query, kv_pool, batch.block_tables, batch.context_lens, batch.page_size,
                               num_kv_heads, scale, max_context_len=batch.max_context_len, out=out, pdl=self.pdl)
        seqs, tokens, decodes = batch.context_lens.shape[0], query.shape[0], batch.num_decodes
        flash_seqs = batch.fresh_seqs if self.flash_prefill and query.dtype in _FLASH_DTYPES else 0
        if flash_seqs == seqs and out is None:     # prompts alone (decodes are never fresh)
            return _fresh_flash_attention(query, *new_kv, batch.query_start_loc, batch.max_query_len, scale)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)   # [tokens, heads, head_dim]
        if decodes:
            # The prefill kernel gives a one-token row a block of its own per query head, reading its
            # context once per head: the decode kernel reads it once per KV head. Unsplit: the prefill
            # beside them fills the GPU, and one variant serves every such step.
            self._paged(query[:decodes], kv_pool, batch.block_tables[:decodes], batch.context_lens[:decodes],
                        batch.page_size, num_kv_heads, scale, num_splits=1, out=out[:decodes], pdl=self.pdl)
        flash_rows = batch.fresh_tokens if flash_seqs else 0
        if seqs - flash_seqs > decodes:
            self._triton_prefills(query, new_kv, kv_pool, batch, slice(decodes, seqs - flash_seqs),
                                  tokens - flash_rows - decodes, num_kv_heads, scale, out)
        if flash_seqs:
            first, (key, value) = tokens - flash_rows, new_kv
            out[first:] = _fresh_flash_attention(query[first:], key[first:], value[first:],
                                                 batch.query_start_loc[seqs - flash_seqs:] - first,
                                                 batch.max_query_len, scale)
        return out

    def _triton_prefills(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: Tensor, batch: StepBatch,
                         seqs: slice, rows: int, num_kv_heads: int, scale: float, out: Tensor) -> None:
        """The prefill kernel over the sequences `seqs` (`rows` rows), written into their rows of `out`."""
        starts = batch.query_start_loc[seqs.start:seqs.stop + 1]
        own_rows = new_kv if rows >= self.new_kv_min_tokens else None
        self._prefill(query, kv_pool, batch.block_tables[seqs], starts, batch.context_lens[seqs], batch.page_size,
                      num_kv_heads, scale, out=out, new_kv=own_rows)

    def new_kv_step_shapes(self, longest: int, max_batch: int) -> tuple[tuple[int, int], ...]:
        """(sequences, tokens each) of prefill steps that launch the new_kv kernel in both of its row
        blocks, for the engine's warm-up: at least LONG_BLOCK_M tokens per sequence over as few sequences
        as the longest allowed one needs, and fewer per sequence; each where `max_batch` sequences of at
        most `longest` tokens allow it."""
        tokens, rows = max(self.new_kv_min_tokens, 1), self._long_block_m
        seqs = cdiv(tokens, longest)
        short_each = min(rows - 1, longest)
        shapes = ((seqs, max(rows, cdiv(tokens, seqs))), (cdiv(tokens, short_each), short_each))
        return tuple((n, each) for n, each in shapes if n <= max_batch and each <= longest)

    def attend_in_graph(self, query: Tensor, kv_pool: Tensor, batch: StepBatch, inputs: "AttentionInputs",
                        num_kv_heads: int, scale: float, out: Tensor) -> Tensor:
        """A step with prefill rows inside a bucket's CUDA graph (slora.mixed_graphs), every grid the
        bucket's: the decode kernel over its first `seqs` rows, with context only on the step's decode rows
        (zeros on the others, which the prefill kernel then overwrites where they are the step's), then the
        prefill kernel over its `seqs` sequences, of which the decode ones and those past the step are empty."""
        seqs = batch.context_lens.shape[0]
        self._paged(query[:seqs], kv_pool, batch.block_tables, inputs.decode_context_lens, batch.page_size,
                    num_kv_heads, scale, num_splits=1, out=out[:seqs], pdl=self.pdl)
        return self._prefill(query, kv_pool, batch.block_tables, inputs.prefill_start_loc, batch.context_lens,
                             batch.page_size, num_kv_heads, scale, out=out)


_FLASH_DTYPES = (torch.bfloat16, torch.float16)


def flash_supported(device: torch.device) -> bool:
    """Whether torch's FlashAttention-2 kernels run on this device (CUDA, compute capability 8.0+)."""
    return (device.type == "cuda" and torch.backends.cuda.is_flash_attention_available()
            and torch.cuda.get_device_capability(device) >= (8, 0))


def _fresh_flash_attention(query: Tensor, key: Tensor, value: Tensor, starts: Tensor, longest: int,
                           scale: float) -> Tensor:
    """Causal attention `[tokens, heads, head_dim]` of sequences whose K/V are their own rows
    `starts[s]:starts[s+1]` (`key`, `value`: `[tokens, kv_heads, head_dim]`), through FlashAttention-2's
    varlen forward in torch: the op behind torch.nn.attention.varlen.varlen_attn, called directly because
    that wrapper's signature changed between torch 2.10 and 2.12, while the op's has not."""
    out, *_ = torch.ops.aten._flash_attention_forward(query, key, value, starts, starts, longest, longest,
                                                      0.0, True, False, scale=scale)
    return out


def backends_for(device: torch.device, pdl: bool = False, lora_policy: LoraLaunchPolicy = LoraLaunchPolicy(),
                 flash_prefill: bool = True) -> tuple[AttentionBackend, LoraBackend]:
    """(attention, LoRA) backends for a device. pdl: the model's Triton kernels (all but the prefill
    attention) use programmatic dependent launch where the GPU supports it (compute capability 9.0+).
    flash_prefill: prompts that start at position 0 attend through FlashAttention-2 where it runs."""
    if device.type == "cuda":
        from slora.kernels.pdl import pdl_supported
        pdl = pdl and pdl_supported(device)
        attention = TritonAttention(pdl, flash_prefill=flash_prefill and flash_supported(device))
        return attention, TritonLora(pdl=pdl, policy=lora_policy)
    return ReferenceAttention(), ReferenceLora()
