"""Owns the pool tensor and the model; turns a scheduled step into one forward (DESIGN §3)."""
from dataclasses import dataclass

import torch
from torch import Tensor

from slora.adapters.packing import PackedAdapter
from slora.attention_backend import ReferenceAttention, ReferenceLora
from slora.forward_batch import ForwardBatch, LoraBatch
from slora.models.llama import LlamaForCausalLM
from slora.scheduler import ScheduledSeq


@dataclass(frozen=True)
class PoolShape:
    num_layers: int
    num_pages: int
    page_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        return 2 * self.page_size * self.num_kv_heads * self.head_dim


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, shape: PoolShape, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model, self.shape, self.device = model, shape, device
        # The unified pool: KV pages and adapter pages, page ids shared across layers.
        self.pool = torch.zeros(shape.num_layers, shape.num_pages, shape.page_elems, dtype=dtype,
                                device=device)  # [layers, pages, page_elems]
        self.attention = ReferenceAttention()
        self.lora_ops = ReferenceLora()

    def load_adapter(self, packed: PackedAdapter, pages: list[int]) -> None:
        """Copy an adapter's packed pages from the host cache into its pool pages."""
        index = torch.tensor(pages, dtype=torch.long, device=self.device)
        self.pool.index_copy_(1, index, packed.pages.to(self.device, self.pool.dtype))

    def run(self, scheduled: list[ScheduledSeq], adapters: dict[str, tuple[PackedAdapter, list[int]]]) -> Tensor:
        """One forward over the scheduled tokens; logits `[sampled, vocab]` of the completing sequences."""
        batch = self.prepare(scheduled, adapters)
        return self.model(batch, self.pool, self.attention)

    def prepare(self, scheduled: list[ScheduledSeq],
                adapters: dict[str, tuple[PackedAdapter, list[int]]]) -> ForwardBatch:
        page_size = self.shape.page_size
        input_ids, positions, slots, starts, lens, sample_rows = [], [], [], [0], [], []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_tokens
            input_ids += seq.token_ids[start:end]
            positions += range(start, end)
            slots += [seq.block_table[i // page_size] * page_size + i % page_size for i in range(start, end)]
            starts.append(starts[-1] + item.num_tokens)
            lens.append(end)
            if item.completes:
                sample_rows.append(starts[-1] - 1)
        tensor = lambda values, dtype: torch.tensor(values, dtype=dtype, device=self.device)
        return ForwardBatch(
            input_ids=tensor(input_ids, torch.long), positions=tensor(positions, torch.long),
            slot_mapping=tensor(slots, torch.long),
            block_tables=self._block_tables(scheduled), query_start_loc=tensor(starts, torch.int32),
            context_lens=tensor(lens, torch.int32), sample_indices=tensor(sample_rows, torch.long),
            page_size=page_size, max_query_len=max(s.num_tokens for s in scheduled),
            max_context_len=max(lens), lora=self._lora_batch(scheduled, adapters))

    def _block_tables(self, scheduled: list[ScheduledSeq]) -> Tensor:
        width = max(len(item.seq.block_table) for item in scheduled)
        table = torch.zeros(len(scheduled), width, dtype=torch.int32)
        for row, item in enumerate(scheduled):
            table[row, :len(item.seq.block_table)] = torch.tensor(item.seq.block_table, dtype=torch.int32)
        return table.to(self.device)

    def _lora_batch(self, scheduled: list[ScheduledSeq],
                    adapters: dict[str, tuple[PackedAdapter, list[int]]]) -> LoraBatch | None:
        versions = sorted({item.seq.adapter.version for item in scheduled if item.seq.adapter})
        if not versions:
            return None
        slot_of = {v: i for i, v in enumerate(versions)}
        token_slots = [slot_of[item.seq.adapter.version] if item.seq.adapter else -1
                       for item in scheduled for _ in range(item.num_tokens)]
        packed = [adapters[v][0] for v in versions]
        tables = [adapters[v][1] for v in versions]
        width = max(len(t) for t in tables)
        page_tables = torch.zeros(len(versions), width, dtype=torch.int32)
        for row, table in enumerate(tables):
            page_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
        stack = lambda name: torch.stack([getattr(p.descriptor, name) for p in packed], dim=-1).to(self.device)
        ranks = torch.stack([p.descriptor.ranks for p in packed], dim=-1)      # [layers, modules, slots]
        return LoraBatch(
            token_slots=torch.tensor(token_slots, dtype=torch.int32, device=self.device),
            page_tables=page_tables.to(self.device), ranks=ranks.to(self.device),
            a_offsets=stack("a_offsets"), b_offsets=stack("b_offsets"), scalings=stack("scalings"),
            max_rank=int(ranks.max()), ops=self.lora_ops, active=(ranks.amax(dim=-1) > 0).tolist())
