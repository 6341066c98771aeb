"""Kernels behind the model: torch references on the CPU, Triton kernels on CUDA (DESIGN §4)."""
from torch import Tensor

from slora.forward_batch import ForwardBatch
from slora.kernels import reference


class ReferenceAttention:
    """Every token of the step, prefill or decode, through the reference prefill attention."""

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        reference.store_kv(key, value, kv_pool, slot_mapping, page_size)

    def attend(self, query: Tensor, kv_pool: Tensor, batch: ForwardBatch, num_kv_heads: int,
               scale: float) -> Tensor:
        return reference.prefill_attention(query, kv_pool, batch.block_tables, batch.query_start_loc,
                                           batch.context_lens, batch.page_size, num_kv_heads, scale)


class ReferenceLora:
    def prepare(self, token_slots: Tensor, num_slots: int) -> "ReferenceLora":
        return self

    lora_shrink = staticmethod(reference.lora_shrink)
    lora_expand = staticmethod(reference.lora_expand)


class TritonAttention:
    """Decode-only steps through the paged decode kernel (GQA, split context); any step with a prefill
    through the prefill kernel, which handles one-token rows as well. Triton is imported only here, when
    a CUDA engine is built."""

    def __init__(self) -> None:
        from slora.kernels.paged_attention import paged_attention
        from slora.kernels.prefill_attention import prefill_attention
        from slora.kernels.store_kv import store_kv
        self._paged, self._prefill, self._store = paged_attention, prefill_attention, store_kv

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None:
        self._store(key, value, kv_pool, slot_mapping, page_size)

    def attend(self, query: Tensor, kv_pool: Tensor, batch: ForwardBatch, num_kv_heads: int,
               scale: float) -> Tensor:
        if batch.max_query_len == 1:
            return self._paged(query, kv_pool, batch.block_tables, batch.context_lens, batch.page_size,
                               num_kv_heads, scale, max_context_len=batch.max_context_len)
        return self._prefill(query, kv_pool, batch.block_tables, batch.query_start_loc, batch.context_lens,
                             batch.page_size, num_kv_heads, scale)


class TritonLora:
    """Batched LoRA kernels; the tokens are grouped by adapter once per step and reused by every call."""

    def __init__(self, segments: object | None = None) -> None:
        from slora.kernels import lora
        self._lora, self.segments = lora, segments

    def prepare(self, token_slots: Tensor, num_slots: int) -> "TritonLora":
        return TritonLora(self._lora.lora_segments(token_slots, num_slots))

    def lora_shrink(self, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                    a_offsets: Tensor, max_rank: int) -> Tensor:
        # The split partial sums go straight to expand, which adds them up as it reads them.
        return self._lora.lora_shrink_partials(x, pool, token_slots, page_tables, ranks, a_offsets, max_rank,
                                               segments=self.segments)

    def lora_expand(self, out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                    ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int]) -> None:
        self._lora.lora_expand(out, h, pool, token_slots, page_tables, ranks, b_offsets, scalings,
                               out_sizes=out_sizes, segments=self.segments)


def backends_for(device_type: str) -> tuple[object, object]:
    """(attention ops, LoRA ops) for a device type."""
    if device_type == "cuda":
        return TritonAttention(), TritonLora()
    return ReferenceAttention(), ReferenceLora()
