"""The flat batch of one engine step, as the model sees it, and the per-step LoRA table."""
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor


class AttentionOps(Protocol):
    """The attention kernels the model calls; references on the CPU, Triton on CUDA."""

    # Whether the model's kernels launch with programmatic dependent launch (slora.kernels.pdl).
    pdl: bool

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor,
                 page_size: int) -> None: ...

    def attend(self, query: Tensor, kv_pool: Tensor, batch: "ForwardBatch", num_kv_heads: int,
               scale: float) -> Tensor: ...


class LoraOps(Protocol):
    """Batched LoRA over `[modules, slots]` tables: modules that share an input in one call (q/k/v)."""

    def lora_shrink(self, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                    a_offsets: Tensor, max_rank: int) -> Tensor: ...

    def lora_expand(self, out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                    ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int],
                    add: bool = True) -> None: ...

    # Whether this step's groups whose input is no wider than their output run lora_fused (one launch).
    fused: bool

    def lora_fused(self, out: Tensor, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                   ranks: Tensor, a_offsets: Tensor, b_offsets: Tensor, scalings: Tensor,
                   out_sizes: list[int]) -> None: ...


def lora_fusable(in_features: int, out_features: int) -> bool:
    """Whether a group's LoRA may run as lora_fused: every output tile re-reads x and A, so not where x is
    wider than the output (down_proj: 3.5x in Llama-3-8B)."""
    return in_features <= out_features


@dataclass
class LoraBatch:
    """The adapters of one step. Slot s is the s-th distinct adapter version of the step; tables are
    `[num_layers, num_modules, num_slots]` and `page_tables` `[num_slots, max_adapter_pages]`."""

    token_slots: Tensor     # [tokens] int32, -1 = no adapter
    page_tables: Tensor     # int32
    ranks: Tensor           # int32
    a_offsets: Tensor       # int64
    b_offsets: Tensor       # int64
    scalings: Tensor        # float32
    max_rank: int
    ops: LoraOps
    active: list[list[bool]]   # [layer][module]: whether any adapter of the step targets it (host side)
    # deltas: each group's LoRA is computed apart as a delta (`delta`), which the op reading the projection
    # adds, instead of being added into the projection's output after its GEMM. side_stream (a CUDA stream,
    # with deltas): the delta is computed on it while the GEMM runs on the current stream (decode graphs).
    deltas: bool = False
    side_stream: torch.cuda.Stream | None = None
    _views: dict[tuple[int, int], list[tuple[Tensor, Tensor, Tensor, Tensor]]] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def apply(self, layer: int, modules: slice, x: Tensor, out: Tensor, pool: Tensor,
              out_sizes: list[int]) -> None:
        """out += LoRA(x) for the modules `modules` of layer `layer` (consecutive ones that read the same x,
        their outputs side by side in out, `out_sizes` columns each), each token through its own adapter."""
        if not any(self.active[layer][modules]):
            return
        ranks, a_offsets, b_offsets, scalings = self._group_tables(modules)[layer]   # each [modules, slots]
        if self.ops.fused and lora_fusable(x.shape[1], out.shape[1]):
            self.ops.lora_fused(out, x, pool, self.token_slots, self.page_tables, ranks, a_offsets, b_offsets,
                                scalings, out_sizes)
            return
        self._shrink_expand(layer, modules, x, out, pool, out_sizes, add=True)

    def delta(self, layer: int, modules: slice, x: Tensor, pool: Tensor, out_sizes: list[int]) -> Tensor | None:
        """The LoRA of `modules` alone, `[tokens, sum(out_sizes)]` in x's dtype (the rows of tokens without
        adapter are not written), or None when no adapter of the step targets these modules."""
        if not any(self.active[layer][modules]):
            return None
        delta = x.new_empty(x.shape[0], sum(out_sizes))
        self._shrink_expand(layer, modules, x, delta, pool, out_sizes, add=False)
        return delta

    def _shrink_expand(self, layer: int, modules: slice, x: Tensor, out: Tensor, pool: Tensor, out_sizes: list[int],
                       add: bool) -> None:
        ranks, a_offsets, b_offsets, scalings = self._group_tables(modules)[layer]   # each [modules, slots]
        h = self.ops.lora_shrink(x, pool, self.token_slots, self.page_tables, ranks, a_offsets, self.max_rank)
        self.ops.lora_expand(out, h, pool, self.token_slots, self.page_tables, ranks, b_offsets, scalings,
                             out_sizes, add=add)

    def _group_tables(self, modules: slice) -> list[tuple[Tensor, Tensor, Tensor, Tensor]]:
        """Per layer, the views of the four tables for a group of modules, made once per step and group: in
        eager steps the host bounds the step, and indexing four tables per call was a share of it."""
        assert modules.step is None, "a group is consecutive modules"
        key = (modules.start, modules.stop)
        if key not in self._views:
            tables = (self.ranks, self.a_offsets, self.b_offsets, self.scalings)
            self._views[key] = list(zip(*(t[:, modules].unbind(0) for t in tables)))
        return self._views[key]


@dataclass
class ForwardBatch:
    """Tokens of all scheduled sequences, concatenated. Sequence s owns rows
    `query_start_loc[s]:query_start_loc[s+1]`, the last of its `context_lens[s]` tokens."""

    input_ids: Tensor           # [tokens] int64
    positions: Tensor           # [tokens] int64
    slot_mapping: Tensor        # [tokens] int64, page * page_size + offset
    block_tables: Tensor        # [seqs, max_pages] int32
    query_start_loc: Tensor     # [seqs + 1] int32
    context_lens: Tensor        # [seqs] int32
    sample_indices: Tensor      # [sampled] int64, rows whose logits are wanted
    page_size: int
    max_query_len: int
    max_context_len: int
    lora: LoraBatch | None = None
