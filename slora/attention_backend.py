"""Attention kernels behind the model: torch references on the CPU, Triton kernels on CUDA."""
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
    lora_shrink = staticmethod(reference.lora_shrink)
    lora_expand = staticmethod(reference.lora_expand)
