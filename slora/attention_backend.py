"""Kernels behind the model: torch references on the CPU, Triton kernels on CUDA (DESIGN §4)."""
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.forward_batch import ForwardBatch
from slora.kernels.checks import check_lora_n_tiles, check_lora_tile
from slora.kernels import reference
from slora.kernels.layout import LORA_MODULES


class ReferenceAttention:
    """Every token of the step, prefill or decode, through the reference prefill attention."""

    pdl = False

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        reference.store_kv(key, value, kv_pool, slot_mapping, page_size)

    def attend(self, query: Tensor, kv_pool: Tensor, batch: ForwardBatch, num_kv_heads: int,
               scale: float) -> Tensor:
        return reference.prefill_attention(query, kv_pool, batch.block_tables, batch.query_start_loc,
                                           batch.context_lens, batch.page_size, num_kv_heads, scale)


class ReferenceLora:
    fused = False

    def prepare(self, token_slots: Tensor, num_slots: int, num_layers: int, fused: bool = False) -> "ReferenceLora":
        return self

    lora_shrink = staticmethod(reference.lora_shrink)
    lora_expand = staticmethod(reference.lora_expand)
    lora_fused = staticmethod(reference.lora_fused)   # the LoraOps protocol's; never called while fused is False


class TritonAttention:
    """Decode-only steps through the paged decode kernel (GQA, split context); any step with a prefill
    through the prefill kernel, which handles one-token rows as well. Triton is imported only here, when
    a CUDA engine is built."""

    def __init__(self, pdl: bool = False) -> None:
        from slora.kernels.paged_attention import paged_attention
        from slora.kernels.prefill_attention import prefill_attention
        from slora.kernels.store_kv import store_kv
        self._paged, self._prefill, self._store = paged_attention, prefill_attention, store_kv
        self.pdl = pdl   # the model's kernels use programmatic dependent launch (slora.kernels.pdl)

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        self._store(key, value, kv_pool, slot_mapping, page_size, pdl=self.pdl)

    def attend(self, query: Tensor, kv_pool: Tensor, batch: ForwardBatch, num_kv_heads: int,
               scale: float) -> Tensor:
        if batch.max_query_len == 1:
            return self._paged(query, kv_pool, batch.block_tables, batch.context_lens, batch.page_size,
                               num_kv_heads, scale, max_context_len=batch.max_context_len, pdl=self.pdl)
        return self._prefill(query, kv_pool, batch.block_tables, batch.query_start_loc, batch.context_lens,
                             batch.page_size, num_kv_heads, scale)


@dataclass(frozen=True)
class LoraLaunchPolicy:
    """How the CUDA LoRA ops cut a step, decided per step from its size (fixed per captured graph).

    accumulate_max_tokens: steps of at most this many tokens shrink into one h (lora_shrink_into: the
        reduction split finely, the splits added atomically); larger ones keep split partial sums that
        expand adds up. Decode steps on the H200 with the first against the second (benchmarks/README.md,
        third session): one shared adapter 7.8% / 7.7% / 5.5% / 3.5% / 1.1% faster at batch 1 / 16 / 64 /
        128 / 256; a distinct adapter per request 8.0% / 4.6% faster at 1 / 16, then 1.3% / 3.9% / 4.7%
        slower at 64 / 128 / 256. Batch 64 is the trade-off.
    accumulate_max_slots, accumulate_few_max_tokens: steps of at most accumulate_few_max_tokens tokens
        whose adapter tables have at most accumulate_max_slots slots (the few-adapter decode graphs, 4 by
        default) also shrink into one h. Decode steps with one shared adapter on the H200 (seventh session,
        benchmarks/README.md): 10.2 against 10.8 ms at batch 128, 16.1 against 16.9 ms at batch 256. The
        token bound keeps the step's float32 workspace (layers x 7 x tokens x max_rank) small in eager
        prefill steps, which were not measured with it.
    block_m_tokens_per_slot: tokens are cut into blocks of 64 (instead of 16) when the step has at least
        this many tokens per adapter slot: long segments on average. 16 (64-token blocks from batch 64 in
        a 4-slot graph) made the shared-adapter decode step slower on the H200: 7.99 against 7.76 ms at
        batch 64, 11.1 against 10.8 ms at batch 128.
    lora_tile: columns of a row that the shrink and expand kernels load per tile (a power of two from
        ALIGN = 64 to slora.kernels.checks.MAX_LORA_TILE); None: the kernels' defaults (128). 64 columns
        were slower on the H200 (decode with a distinct adapter per request at batch 256: 34.3 against
        27.9 ms; benchmarks/README.md).
    expand_n_tiles: output tiles per expand program (one of slora.kernels.checks.LORA_N_TILES); None: the
        kernel's default (1).
    gemv_expand_min_tokens: steps of at least this many tokens whose adapter tables have a slot per token
        (the full decode graphs: an adapter per request; in eager steps, one per token) expand with the
        one-token kernel (`lora_expand(gemv=True)`: blocks of one token without tl.dot, longer ones with
        tl.dot over 128-column parts of 1,024-column tiles; lora_tile and expand_n_tiles do not apply to
        it) and shrink into one h, which that kernel reads more cheaply than split
        partial sums; None: never. On the H200 (ninth session, benchmarks/README.md): decode with an adapter
        per request 69.0% / 69.5% / 71.1% of the roofline at batch 64 / 128 / 256 with the rule from 64
        tokens, against 66.1% / 63.8% / 61.8% without it (another command). It starts at 128 because at
        64 tokens the layer's LoRA with 16 or 32 adapters over 64 slots (blocks of 2-4 tokens) took 70.5 and
        88.9 µs with it against 56.3 and 66.8 µs without; at 256 tokens with 5 or 32 adapters it was faster
        (96.3 and 113.8 µs against 152.2 and 159.3). With the LoRA on a side stream (tenth session), from 64
        tokens it took decode with an adapter per request at batch 64 from 71.1% to 73.1% of the roofline
        but 2 and 4 requests per adapter from 73.7% / 74.5% to 66.5% / 68.9%; at 128 tokens on 64 adapters
        (blocks of 2) the layer's LoRA took 129.6 µs with it against 113.0 without."""
    accumulate_max_tokens: int = 64
    accumulate_max_slots: int = 4
    accumulate_few_max_tokens: int = 256
    block_m_tokens_per_slot: int = 64
    lora_tile: int | None = None
    expand_n_tiles: int | None = None
    gemv_expand_min_tokens: int | None = 128

    def __post_init__(self) -> None:
        for name in ("accumulate_max_tokens", "accumulate_max_slots", "accumulate_few_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_m_tokens_per_slot < 1:
            raise ValueError(f"block_m_tokens_per_slot must be >= 1, got {self.block_m_tokens_per_slot}")
        if self.gemv_expand_min_tokens is not None and self.gemv_expand_min_tokens < 1:
            raise ValueError(f"gemv_expand_min_tokens must be >= 1 or None, got {self.gemv_expand_min_tokens}")
        # The kernels' own rules, checked when the policy is made rather than at a step's first launch.
        if self.lora_tile is not None:
            check_lora_tile(self.lora_tile, "lora_tile")
        if self.expand_n_tiles is not None:
            check_lora_n_tiles(self.expand_n_tiles, "expand_n_tiles")

    def accumulates(self, num_tokens: int, num_slots: int) -> bool:
        few_slots = num_slots <= self.accumulate_max_slots and num_tokens <= self.accumulate_few_max_tokens
        return num_tokens <= self.accumulate_max_tokens or few_slots or self.expands_by_gemv(num_tokens, num_slots)

    def expands_by_gemv(self, num_tokens: int, num_slots: int) -> bool:
        """A step of at least gemv_expand_min_tokens tokens whose adapter tables have a slot per token."""
        min_tokens = self.gemv_expand_min_tokens
        return min_tokens is not None and num_slots >= num_tokens >= min_tokens

    def block_m(self, num_tokens: int, num_slots: int) -> int:
        return 64 if num_tokens >= self.block_m_tokens_per_slot * max(num_slots, 1) else 16


class TritonLora:
    """Batched LoRA kernels for one step: the tokens are grouped by adapter once and reused by every call.
    In small steps every shrink adds into a slice of one float32 workspace that the step's first shrink
    zeroes (one memset per step, inside the captured graph for decode)."""

    def __init__(self, segments: object | None = None, num_layers: int = 0, fused: bool = False,
                 pdl: bool = False, policy: LoraLaunchPolicy = LoraLaunchPolicy(), accumulate: bool = True,
                 gemv: bool = False) -> None:
        from slora.kernels import lora
        self._lora, self.segments, self._num_layers = lora, segments, num_layers
        self.fused, self.pdl, self.policy, self._accumulate, self._gemv = fused, pdl, policy, accumulate, gemv
        self._workspace: Tensor | None = None
        self._used = 0

    def prepare(self, token_slots: Tensor, num_slots: int, num_layers: int, fused: bool = False) -> "TritonLora":
        """The ops of one step; fused: groups run lora_fused (LoraBatch.apply says which). The segments are
        computed here, once per step, so that the kernels may read them before the previous kernel ends
        (pdl)."""
        tokens = token_slots.shape[0]
        segments = self._lora.lora_segments(token_slots, num_slots, self.policy.block_m(tokens, num_slots))
        return TritonLora(segments, num_layers, fused, self.pdl, self.policy,
                          self.policy.accumulates(tokens, num_slots), self.policy.expands_by_gemv(tokens, num_slots))

    def lora_fused(self, out: Tensor, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                   ranks: Tensor, a_offsets: Tensor, b_offsets: Tensor, scalings: Tensor,
                   out_sizes: list[int]) -> None:
        self._lora.lora_fused(out, x, pool, token_slots, page_tables, ranks, a_offsets, b_offsets, scalings,
                              out_sizes=out_sizes, segments=self.segments, tile=self.policy.lora_tile)

    def lora_shrink(self, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                    a_offsets: Tensor, max_rank: int) -> Tensor:
        if not self._accumulate:
            # The split partial sums go straight to expand, which adds them up as it reads them.
            return self._lora.lora_shrink_partials(x, pool, token_slots, page_tables, ranks, a_offsets, max_rank,
                                                   segments=self.segments, pdl=self.pdl,
                                                   tile=self.policy.lora_tile)
        modules = 1 if ranks.dim() == 1 else ranks.shape[0]
        h = self._zeroed(x.shape[0], modules * max_rank, max_rank, x.device)
        self._lora.lora_shrink_into(h, x, pool, token_slots, page_tables, ranks, a_offsets, max_rank,
                                    segments=self.segments, pdl=self.pdl, tile=self.policy.lora_tile)
        return h

    def _zeroed(self, rows: int, width: int, max_rank: int, device: torch.device) -> Tensor:
        """A zeroed float32 `[rows, width]` slice of the step's workspace, sized at the first call for every
        module of every layer (max_rank columns for each of the seven modules)."""
        if self._workspace is None:
            capacity = self._num_layers * len(LORA_MODULES) * rows * max_rank
            self._workspace = torch.zeros(capacity, dtype=torch.float32, device=device)
        assert self._used + rows * width <= self._workspace.numel(), "more shrinks in a step than modules"
        chunk = self._workspace[self._used:self._used + rows * width].view(rows, width)
        self._used += rows * width
        return chunk

    def lora_expand(self, out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                    ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int], add: bool = True) -> None:
        self._lora.lora_expand(out, h, pool, token_slots, page_tables, ranks, b_offsets, scalings,
                               out_sizes=out_sizes, segments=self.segments, pdl=self.pdl,
                               tile=self.policy.lora_tile, n_tiles=self.policy.expand_n_tiles, gemv=self._gemv,
                               add=add)


def backends_for(device: torch.device, pdl: bool = False,
                 lora_policy: LoraLaunchPolicy = LoraLaunchPolicy()) -> tuple[object, object]:
    """(attention ops, LoRA ops) for a device. pdl: the model's Triton kernels (all but the prefill
    attention) use programmatic dependent launch where the GPU supports it (compute capability 9.0+)."""
    if device.type == "cuda":
        from slora.kernels.pdl import pdl_supported
        pdl = pdl and pdl_supported(device)
        return TritonAttention(pdl), TritonLora(pdl=pdl, policy=lora_policy)
    return ReferenceAttention(), ReferenceLora()
