"""Steps with prefill rows, of up to `max_tokens` tokens, replayed from CUDA graphs piece by piece.

A mixed or prefill step is captured per token-count bucket as the pieces between its attention calls
(embedding to the first attention, each attention's output to the next, the last to the logits). Attention
runs eagerly between the pieces, over the step's own sequences, since its kernels' grids follow them; the
rest (GEMMs, LoRA, norms, rotary, the K/V store) depends only on the token count and replays. The inputs
the pieces read live in static buffers as in the decode graphs (`slora.cuda_graphs`): padding tokens have
slot -1 (their K/V are not stored) and no adapter, and their rows are never sampled.
"""
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from slora import step_batch
from slora.attention_backend import AttentionBackend
from slora.cuda_graphs import GraphLimits
from slora.device_copy import copy_from_host
from slora.lora_backend import LoraBackend
from slora.models.registry import CausalLM
from slora.step_batch import StepBatch, TokenFeed

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as MemPool  # what torch.cuda.graph_pool_handle() returns

logger = logging.getLogger(__name__)


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then multiples of 64, and max_tokens itself: every step up to max_tokens has a bucket."""
    candidates = [16, 32, *range(64, max_tokens, 64), max_tokens]
    return sorted({b for b in candidates if b <= max_tokens})


class AttentionCall(NamedTuple):
    """One attention call of a captured forward: its inputs and output, in the graphs' memory."""
    query: Tensor                      # [tokens, heads, head_dim]
    new_kv: tuple[Tensor, Tensor]      # [tokens, kv_heads, head_dim] each
    kv_pool: Tensor                    # [pages, page_elems]: the layer's pool
    num_kv_heads: int
    scale: float
    out: Tensor                        # [tokens, heads, head_dim]


@dataclass
class Pieces:
    """A bucket's captured forward: graph i ends where attention call i starts; the last graph ends at
    the logits."""
    graphs: list[torch.cuda.CUDAGraph]
    calls: list[AttentionCall]
    batch: StepBatch                   # the bucket's static inputs
    logits: Tensor                     # [bucket sequences, vocab]


class _PieceRecorder:
    """The attention backend a piecewise capture runs the model with: the K/V store is captured (its slots
    are static), and each attention call ends the graph being captured, is recorded, and begins the next.
    Without a memory pool nothing is captured: a dry run that compiles the pieces' kernels."""

    def __init__(self, attention: AttentionBackend, mempool: "MemPool | None") -> None:
        self.attention, self.mempool, self.pdl = attention, mempool, attention.pdl
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.calls: list[AttentionCall] = []

    def begin(self) -> None:
        if self.mempool is not None:
            self.graphs.append(torch.cuda.CUDAGraph())
            self.graphs[-1].capture_begin(pool=self.mempool)

    def end(self) -> None:
        if self.mempool is not None:
            self.graphs[-1].capture_end()

    def store_kv(self, key: Tensor, value: Tensor, kv_pool: Tensor, slot_mapping: Tensor, page_size: int) -> None:
        self.attention.store_kv(key, value, kv_pool, slot_mapping, page_size)

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: Tensor, batch: StepBatch,
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        assert out is None, "the model passes no attention output buffer"
        self.end()
        # Made between two captures, so outside the graphs' pool: the recorded call keeps it for the replays.
        # Zeros: attention writes only the step's rows, and the padding rows' stay finite.
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)   # [tokens, heads, head_dim]
        self.calls.append(AttentionCall(query, new_kv, kv_pool, num_kv_heads, scale, out))
        self.begin()
        return out


class PiecewiseGraphs:
    """The pieces of every token bucket up to limits.mixed_tokens, with and without LoRA, over one set of
    static inputs sized for the largest bucket (its sequences and adapter slots as the limits bound them)."""

    def __init__(self, model: CausalLM, pool: Tensor, attention: AttentionBackend, lora: LoraBackend,
                 page_size: int, limits: GraphLimits) -> None:
        assert limits.mixed_tokens > 0, "no piecewise graphs without steps for them"
        self.model, self.pool, self.attention, self.lora, self.limits = model, pool, attention, lora, limits
        self.buckets = token_buckets(limits.mixed_tokens)
        largest = self.buckets[-1]
        self.static = step_batch.empty(self._sizes(largest), pool.device, page_size, limits.max_lora_rank)
        self.pieces: dict[tuple[int, bool], Pieces] = {}   # (bucket tokens, with LoRA) -> its pieces

    def seqs(self, tokens: int) -> int:
        """The most sequences a step of this many tokens has."""
        return min(tokens, self.limits.max_batch)

    def lora_slots(self, tokens: int) -> int:
        """The adapter slots of a bucket's LoRA tables."""
        return self.limits.lora_slots(self.seqs(tokens))

    def _sizes(self, tokens: int) -> dict[str, int]:
        return {**self.limits.sizes(self.seqs(tokens), self.lora_slots(tokens)), "tokens": tokens}

    def capture(self) -> None:
        """Capture every bucket, with and without LoRA, largest first, sharing one memory pool."""
        mempool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.pool.device)
        stream.wait_stream(torch.cuda.current_stream(self.pool.device))
        with torch.cuda.stream(stream):
            for tokens in reversed(self.buckets):
                for with_lora in (False, True):
                    self.pieces[(tokens, with_lora)] = self._capture(tokens, with_lora, mempool)
        torch.cuda.current_stream(self.pool.device).wait_stream(stream)
        torch.cuda.synchronize(self.pool.device)
        logger.info("captured %d piecewise graphs for steps of up to %s tokens",
                    sum(len(p.graphs) for p in self.pieces.values()), self.buckets[-1])

    def _capture(self, tokens: int, with_lora: bool, mempool: "MemPool") -> Pieces:
        batch = step_batch.view(self.static, self._sizes(tokens), with_lora)
        self._record(batch, _PieceRecorder(self.attention, None))   # compiles the kernels outside the capture
        torch.cuda.synchronize(self.pool.device)
        recorder = _PieceRecorder(self.attention, mempool)
        logits = self._record(batch, recorder)
        return Pieces(recorder.graphs, recorder.calls, batch, logits)

    def _record(self, batch: StepBatch, recorder: _PieceRecorder) -> Tensor:
        recorder.begin()
        lora = None if batch.lora is None else self.lora.step(batch.lora)
        logits = self.model(batch, self.pool, recorder, lora)
        recorder.end()
        return logits

    def bucket_for(self, num_tokens: int) -> int | None:
        return next((b for b in self.buckets if b >= num_tokens), None)

    def fits(self, host: StepBatch, num_seqs: int) -> int | None:
        """The bucket of a step with prefill rows that the pieces can run, or None: every sampled row is a
        sequence's last (no prompt-logprob rows), and its tables fit the static buffers."""
        bucket = self.bucket_for(host.input_ids.shape[0])
        if bucket is None or len(host.sample_indices) > num_seqs:
            return None
        return bucket if self.limits.holds(host, self.lora_slots(bucket)) else None

    @torch.inference_mode()
    def replay(self, bucket: int, host: StepBatch, feed: TokenFeed | None) -> Tensor:
        """Copy the step into the bucket's static inputs, then replay its pieces with the step's attention
        between them; logits `[sampled, vocab]`."""
        pieces = self.pieces[(bucket, host.lora is not None)]
        batch = self.stage(pieces.batch, host, feed)
        for graph, call in zip(pieces.graphs, pieces.calls):
            graph.replay()
            self.attention.attend(call.query, call.new_kv, call.kv_pool, batch, call.num_kv_heads, call.scale,
                                  out=call.out)
        pieces.graphs[-1].replay()
        return pieces.logits[:len(host.sample_indices)]

    @staticmethod
    def stage(static: StepBatch, host: StepBatch, feed: TokenFeed | None) -> StepBatch:
        """Copy a step into a bucket's static inputs (its pending input ids fed on the device); the step's
        sequences as its attention reads them, from those buffers."""
        host.copy_into(static)
        # The sampled rows and query_start_loc are aranges in static buffers (the decode graphs' use); here they
        # are the step's. The sampled rows past the step's read row 0, inside every bucket.
        static.sample_indices.zero_()
        copy_from_host(static.sample_indices[:len(host.sample_indices)], host.sample_indices)
        copy_from_host(static.query_start_loc[:len(host.query_start_loc)], host.query_start_loc)
        step_batch.feed_tokens(static, feed)
        seqs = step_batch.view(static, {"seqs": host.context_lens.shape[0]}, with_lora=False)
        return dataclasses.replace(seqs, max_query_len=host.max_query_len, max_context_len=host.max_context_len,
                                   num_decodes=host.num_decodes)
