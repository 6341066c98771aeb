"""Attention behind the model (DESIGN §4): torch references on the CPU, Triton kernels on CUDA."""
from typing import NamedTuple, Protocol

import torch
from torch import Tensor

from slora.execution.lora_backend import LoraBackend, LoraLaunchPolicy, ReferenceLora, TritonLora
from slora.execution.step_batch import StepBatch
from slora.execution.tensor_parallel import TensorParallel
from slora.kernels import reference
from slora.kernels.layout import cdiv
from slora.kernels.reference import KVCache


class AttentionInputs(NamedTuple):
    """What a bucket's attention reads besides the step's batch, in static buffers."""
    decode_context_lens: Tensor        # [seqs] int32: a decode row's context length, 0 on every other row
    prefill_start_loc: Tensor          # [seqs + 1] int32: query_start_loc with the decode sequences empty


class AttentionBackend(Protocol):
    """The attention kernels the model calls."""

    # Whether the model's kernels launch with programmatic dependent launch (slora.kernels.pdl).
    pdl: bool

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: KVCache, batch: StepBatch[Tensor],
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """Attention `[tokens, heads, head_dim]` of the step's queries, written into `out` when given."""

    def attend_rows(self, query: Tensor, kv_pool: KVCache, rows: "RowQueries", page_size: int, num_kv_heads: int,
                    scale: float) -> Tensor:
        """Attention `[n, heads, head_dim]` of the queries of some rows of the step, every K/V of the step
        already in the pool."""


class RowQueries(NamedTuple):
    """Some rows of a step as decode queries: each over its sequence's pages up to its own position."""
    rows: Tensor              # [n] int64: rows of the step
    block_tables: Tensor      # [n, pages] int32: each row's sequence's
    context_lens: Tensor      # [n] int32: each row's position + 1


def row_queries(batch: StepBatch[Tensor], rows: Tensor) -> RowQueries:
    """A step's rows (`rows` `[n]`) as decode queries. A row is its sequence's up to the next sequence's
    first (query_start_loc ascending from 0: among sequences that start at one row, the last one owns it).
    Built before the step's layers: the decode kernel reads context_lens before its PDL wait, which allows
    only inputs no kernel of the layers writes (slora.kernels.pdl)."""
    seqs = torch.searchsorted(batch.query_start_loc, rows.to(batch.query_start_loc.dtype), right=True) - 1
    return RowQueries(rows, batch.block_tables[seqs], (batch.positions[rows] + 1).to(torch.int32))


class ReferenceAttention:
    """Every token of the step, prefill or decode, through the reference prefill attention."""

    pdl = False

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: KVCache, batch: StepBatch[Tensor],
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """Attention of the step's queries over the pool, which holds the step's new_kv too."""
        result = reference.prefill_attention(query, kv_pool.pages, batch.block_tables, batch.query_start_loc,
                                             batch.context_lens, batch.page_size, num_kv_heads, scale, kv_pool.scales)
        return result if out is None else out.copy_(result)

    def attend_rows(self, query: Tensor, kv_pool: KVCache, rows: RowQueries, page_size: int, num_kv_heads: int,
                    scale: float) -> Tensor:
        """The rows' queries through the reference decode attention."""
        return reference.paged_attention(query, kv_pool.pages, rows.block_tables, rows.context_lens, page_size,
                                         num_kv_heads, scale, kv_pool.scales)


# Prefill tokens from which a step's attention reads their K/V from the step's own rows (tensor descriptors):
# its launch costs the host about 45 us more than reading them back from the pages (H200, triton 3.6), which
# a small step, whose host work runs beside its GPU time, cannot spare; from here on the GPU time it saves
# outweighs it (docs/decisions.md, "What bounds the prefill step?").
NEW_KV_MIN_TOKENS = 2048


class TritonAttention:
    """Decode-only steps through the paged decode kernel (GQA, split context); any step with a prefill
    through the prefill kernel, which handles one-token rows as well. Triton is imported only here, when
    a CUDA engine is built."""

    def __init__(self, pdl: bool = False, new_kv_min_tokens: int = NEW_KV_MIN_TOKENS) -> None:
        from slora.kernels.paged_attention import paged_attention
        from slora.kernels.prefill_attention import LONG_BLOCK_M, prefill_attention
        if new_kv_min_tokens < 0:
            raise ValueError(f"new_kv_min_tokens must be >= 0, got {new_kv_min_tokens}")
        self._paged, self._prefill = paged_attention, prefill_attention
        self.pdl = pdl   # the model's kernels use programmatic dependent launch (slora.kernels.pdl)
        self.new_kv_min_tokens = new_kv_min_tokens
        self._long_block_m = LONG_BLOCK_M

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: KVCache, batch: StepBatch[Tensor],
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        """The step's queries `[tokens, heads, head_dim]` over the pool, which holds new_kv (the step's keys
        and values, `[tokens, kv_heads, head_dim]` each) too. With at least new_kv_min_tokens prefill tokens
        the prefill kernel reads them from new_kv, contiguous rows instead of pages spread over the pool,
        and only cached prefixes through pages; a smaller step reads them back from the pages. Not from an
        FP8 cache: there every query must see the keys as the pages hold them, quantized."""
        pages, scales = kv_pool
        if batch.max_query_len == 1:
            return self._paged(query, pages, batch.block_tables, batch.context_lens, batch.page_size,
                               num_kv_heads, scale, max_context_len=batch.max_context_len, out=out, pdl=self.pdl,
                               kv_scales=scales)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)   # [tokens, heads, head_dim]
        decodes = batch.num_decodes
        if decodes:
            # The prefill kernel gives a one-token row a block of its own per query head, reading its
            # context once per head: the decode kernel reads it once per KV head. Unsplit: the prefill
            # beside them fills the GPU, and one variant serves every such step.
            self._paged(query[:decodes], pages, batch.block_tables[:decodes], batch.context_lens[:decodes],
                        batch.page_size, num_kv_heads, scale, num_splits=1, out=out[:decodes], pdl=self.pdl,
                        kv_scales=scales)
        own_rows = new_kv if query.shape[0] - decodes >= self.new_kv_min_tokens and scales is None else None
        return self._prefill(query, pages, batch.block_tables[decodes:], batch.query_start_loc[decodes:],
                             batch.context_lens[decodes:], batch.page_size, num_kv_heads, scale, out=out,
                             new_kv=own_rows, kv_scales=scales)

    def attend_rows(self, query: Tensor, kv_pool: KVCache, rows: RowQueries, page_size: int, num_kv_heads: int,
                    scale: float) -> Tensor:
        """The rows' queries through the decode kernel, unsplit as a mixed step's decode rows are (one
        compiled variant for every such call; the rows are few, beside the rest of the step's layer)."""
        return self._paged(query, kv_pool.pages, rows.block_tables, rows.context_lens, page_size, num_kv_heads,
                           scale, num_splits=1, pdl=self.pdl, kv_scales=kv_pool.scales)

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

    def attend_in_graph(self, query: Tensor, kv_pool: KVCache, batch: StepBatch[Tensor], inputs: AttentionInputs,
                        num_kv_heads: int, scale: float, out: Tensor) -> Tensor:
        """A step with prefill rows inside a bucket's CUDA graph (slora.execution.mixed_graphs), every grid the
        bucket's: the decode kernel over its first `seqs` rows, with context only on the step's decode rows
        (zeros on the others, which the prefill kernel then overwrites where they are the step's), then the
        prefill kernel over its `seqs` sequences, of which the decode ones and those past the step are empty."""
        seqs = batch.context_lens.shape[0]
        pages, scales = kv_pool
        self._paged(query[:seqs], pages, batch.block_tables, inputs.decode_context_lens, batch.page_size,
                    num_kv_heads, scale, num_splits=1, out=out[:seqs], pdl=self.pdl, kv_scales=scales)
        return self._prefill(query, pages, batch.block_tables, inputs.prefill_start_loc, batch.context_lens,
                             batch.page_size, num_kv_heads, scale, out=out, kv_scales=scales)


def backends_for(device: torch.device, pdl: bool = False, lora_policy: LoraLaunchPolicy = LoraLaunchPolicy(),
                 tp: TensorParallel | None = None) -> tuple[AttentionBackend, LoraBackend]:
    """(attention, LoRA) backends for a device. pdl: the model's Triton kernels (all but the prefill
    attention) use programmatic dependent launch where the GPU supports it (compute capability 9.0+). tp: the
    rank's place when the model is split over several; the LoRA sends messages of its own only when adapters
    are fully sharded (the replicated scheme's deltas ride in the base model's all-reduces)."""
    lora_tp = tp if tp is not None and tp.fully_sharded_loras else None
    if device.type == "cuda":
        from slora.kernels.pdl import pdl_supported
        pdl = pdl and pdl_supported(device)
        return TritonAttention(pdl), TritonLora(pdl=pdl, policy=lora_policy, tp=lora_tp)
    return ReferenceAttention(), ReferenceLora(lora_tp)
