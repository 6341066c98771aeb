"""Steps with prefill rows, of up to `max_tokens` tokens, replayed from one CUDA graph per token-count bucket,
attention included.

A bucket's graph holds the whole forward, from the embedding to the logits. Its inputs live in static
buffers as in the decode graphs (`slora.execution.cuda_graphs`): padding tokens have KV location -1 (their K/V are not
stored) and no adapter, and their rows are never sampled. Attention launches with grids that follow the
bucket, not the step (AttentionInputs): the decode kernel over the bucket's first `seqs` rows, with a
context length only on the step's decode rows (the others cost it nothing), then the prefill kernel over
`seqs` sequences, of which the decode ones and those past the step are empty.
"""
import logging
import os
import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

import numpy as np
import torch
from torch import Tensor

from slora.execution import step_batch
from slora.execution.attention_backend import AttentionBackend, AttentionInputs, RowQueries
from slora.execution.causal_lm import CausalLM
from slora.execution.cuda_graphs import GraphLimits
from slora.execution.lora_backend import LoraBackend
from slora.execution.pool_memory import PoolViews
from slora.execution.staging import BatchViews, StagedBatch
from slora.execution.step_batch import HostArrays, HostBatch, StepBatch, TokenFeed
from slora.kernels.reference import KVCache

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE as MemPool  # what torch.cuda.graph_pool_handle() returns

logger = logging.getLogger(__name__)

# The staged extra tensor of the buckets' packed AttentionInputs.
ATTENTION_INPUTS = "attention_inputs"
# A packed AttentionInputs region: the staged tensor, or a numpy view of its host twin.
Packed = TypeVar("Packed", Tensor, np.ndarray)


# A bucket whose graph runs this much slower than a larger bucket's is not used: its steps pad to the larger
# one. cuBLAS picks some GEMMs badly at some row counts (on an H200, the Llama-3-8B gate/up projection at 448
# rows: docs/decisions.md); the margin keeps timing noise from dropping buckets.
SLOWER_BUCKET_MARGIN = 1.10
TIMED_REPLAYS = 5
# cuBLAS's workspace size as torch reads it, at every GEMM (torch 2.11's CublasHandlePool): ":0:0" is none.
CUBLAS_WORKSPACE_CONFIG = "CUBLAS_WORKSPACE_CONFIG"
NO_WORKSPACE = ":0:0"


def token_buckets(max_tokens: int) -> list[int]:
    """16, 32, 64, then multiples of 64, and max_tokens itself: every step up to max_tokens has a bucket."""
    candidates = [16, 32, *range(64, max_tokens, 64), max_tokens]
    return sorted({b for b in candidates if b <= max_tokens})


def write_attention_inputs(host: HostBatch, packed: np.ndarray) -> None:
    """Write a step's AttentionInputs for a bucket into its packed `[2 * bucket sequences + 1]` int32 host
    array, a numpy view (every mixed step slices it, and a numpy slice costs the host a fraction of a
    tensor's): the decode sequences start where the first prefill row does, and the sequences past the
    step where it ends, so both are empty."""
    decodes, count = host.num_decodes, host.context_lens.shape[0]
    context_lens, starts = _halves(packed)
    step_starts = host.query_start_loc
    context_lens.fill(0)
    context_lens[:decodes] = host.context_lens[:decodes]
    starts.fill(step_starts[count])
    starts[:decodes + 1] = step_starts[decodes]
    starts[decodes + 1:count + 1] = step_starts[decodes + 1:]


@contextmanager
def cublas_without_workspace() -> Iterator[None]:
    """cuBLAS GEMMs launched inside the context run without a workspace; outside it, with the one set before.

    With its workspace, cuBLAS zeroes a 4-byte counter in it before each of some GEMMs (on an H200, the
    Llama-3-8B gate/up projection from 320 rows up). Captured, each zeroing is a memset node, and a graph's
    replay pays the host for each one: 32 of them made a 512-token mixed-step graph's replay cost 0.16 against
    0.05 ms. Without the workspace cuBLAS picks kernels without the counter, for 0.5-0.8% more GPU time on that
    GEMM (docs/decisions.md). The decode graphs keep the workspace: they have no such
    memset. Torch allocates a (handle, stream)'s workspace at its first GEMM, at the size then set, and later
    tells cuBLAS the size set at each GEMM: a stream first used inside the context must never run a GEMM
    outside it. Not thread-safe: no other thread may launch GEMMs while the context is open."""
    previous = os.environ.get(CUBLAS_WORKSPACE_CONFIG)
    os.environ[CUBLAS_WORKSPACE_CONFIG] = NO_WORKSPACE
    try:
        yield
    finally:
        if previous is None:
            del os.environ[CUBLAS_WORKSPACE_CONFIG]
        else:
            os.environ[CUBLAS_WORKSPACE_CONFIG] = previous


def buckets_worth_keeping(seconds: dict[int, float], margin: float = SLOWER_BUCKET_MARGIN) -> list[int]:
    """The buckets, by their graphs' replay seconds, that no larger bucket beats by more than `margin`: a
    step goes to the smallest bucket kept that holds it, so a slow bucket's steps pad to a faster one."""
    kept: list[int] = []
    fastest_larger = float("inf")
    for bucket in sorted(seconds, reverse=True):
        if seconds[bucket] <= margin * fastest_larger:
            kept.append(bucket)
        fastest_larger = min(fastest_larger, seconds[bucket])
    return sorted(kept)


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int = TIMED_REPLAYS) -> float:
    """The median device seconds of a graph's replay (CUDA events), after one untimed replay."""
    graph.replay()
    seconds = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def packed_length(seqs: int) -> int:
    """The length of a bucket's packed AttentionInputs: `seqs` context lengths and `seqs + 1` starts."""
    return 2 * seqs + 1


def packed_attention_inputs(host: HostBatch, seqs: int) -> Tensor:
    """A step's AttentionInputs for a bucket of `seqs` sequences, packed (write_attention_inputs)."""
    packed = torch.empty(packed_length(seqs), dtype=torch.int32)
    write_attention_inputs(host, packed.numpy())
    return packed


def _halves(packed: Packed) -> tuple[Packed, Packed]:
    """A packed `[2 * seqs + 1]` region's context lengths `[seqs]` and starts `[seqs + 1]`, as views."""
    seqs = (packed.shape[0] - 1) // 2
    return packed[:seqs], packed[seqs:]


def split_attention_inputs(packed: Tensor) -> AttentionInputs:
    """The AttentionInputs that a packed `[2 * seqs + 1]` tensor holds, as views of it."""
    return AttentionInputs(*_halves(packed))


def attention_inputs(host: HostBatch, seqs: int) -> AttentionInputs:
    """packed_attention_inputs, as its two views."""
    return split_attention_inputs(packed_attention_inputs(host, seqs))


class BucketAttention(AttentionBackend, Protocol):
    """The attention a bucket's graph is captured with (slora.execution.attention_backend.TritonAttention): the model's,
    and its attention over a bucket's grids."""

    def attend_in_graph(self, query: Tensor, kv_pool: KVCache, batch: StepBatch[Tensor], inputs: AttentionInputs,
                        num_kv_heads: int, scale: float, out: Tensor) -> Tensor: ...


@dataclass
class BucketGraph:
    """A bucket's captured forward, its static inputs and its logits."""
    graph: torch.cuda.CUDAGraph
    views: BatchViews                  # the bucket's static inputs, and their host twins
    logits: Tensor                     # [bucket sequences, vocab]

    @property
    def seqs(self) -> int:
        return self.views.device.context_lens.shape[0]


class _BucketModelAttention:
    """The attention backend a bucket's forward runs the model with: every call reads the bucket's
    AttentionInputs, so that its grids follow the bucket, and writes into `out_for(query)`."""

    def __init__(self, attention: BucketAttention, inputs: AttentionInputs,
                 out_for: Callable[[Tensor], Tensor]) -> None:
        self.attention, self.inputs, self.pdl, self.out_for = attention, inputs, attention.pdl, out_for

    def attend(self, query: Tensor, new_kv: tuple[Tensor, Tensor], kv_pool: KVCache, batch: StepBatch[Tensor],
               num_kv_heads: int, scale: float, out: Tensor | None = None) -> Tensor:
        assert out is None, "the model passes no attention output buffer"
        return self.attention.attend_in_graph(query, kv_pool, batch, self.inputs, num_kv_heads, scale,
                                              self.out_for(query))

    def attend_rows(self, query: Tensor, kv_pool: KVCache, rows: RowQueries, page_size: int, num_kv_heads: int,
                    scale: float) -> Tensor:
        """The sampled rows' (the bucket's `seqs`: the step's, then row 0 again), found in the bucket's
        query_start_loc, which _stage_extras keeps ascending past the step."""
        return self.attention.attend_rows(query, kv_pool, rows, page_size, num_kv_heads, scale)


class MixedGraphs:
    """The graphs of every token bucket up to limits.mixed_tokens, with and without LoRA, over one set of
    static inputs sized for the largest bucket (its sequences and adapter slots as the limits bound them)."""

    def __init__(self, model: CausalLM, pool: PoolViews, attention: BucketAttention, lora: LoraBackend,
                 page_size: int, limits: GraphLimits) -> None:
        assert limits.mixed_tokens > 0, "no mixed-step graphs without steps for them"
        self.model, self.pool, self.attention, self.lora, self.limits = model, pool, attention, lora, limits
        self.buckets = token_buckets(limits.mixed_tokens)
        # with LoRA -> the buckets a step may use: all of them until capture() times their graphs
        self.usable: dict[bool, list[int]] = {False: self.buckets, True: self.buckets}
        largest = self.buckets[-1]
        template = step_batch.empty(self._sizes(largest), torch.device("cpu"), page_size, limits.max_lora_rank)
        # One AttentionInputs region for every bucket: a bucket's are its leading [2 * seqs + 1].
        packed = torch.zeros(packed_length(self.seqs(largest)), dtype=torch.int32)
        self.device = pool.weights[0].device
        self.staged = StagedBatch(template, self.device, {ATTENTION_INPUTS: packed})
        self.graphs: dict[tuple[int, bool], BucketGraph] = {}   # (bucket tokens, with LoRA) -> its graph
        self._attention_out: Tensor | None = None               # [largest bucket, heads, head_dim]

    def seqs(self, tokens: int) -> int:
        """The most sequences a step of this many tokens has."""
        return min(tokens, self.limits.max_batch)

    def adapter_slots(self, tokens: int) -> int:
        """The adapter slots of a bucket's LoRA tables."""
        return self.limits.adapter_slots(self.seqs(tokens))

    def _sizes(self, tokens: int) -> dict[str, int]:
        return {**self.limits.sizes(self.seqs(tokens), self.adapter_slots(tokens)), "tokens": tokens}

    def capture(self) -> None:
        """Capture every bucket, with and without LoRA, largest first, sharing one memory pool and one capture
        stream of their own: only their captures run GEMMs on it, all without cuBLAS's workspace."""
        mempool, stream = torch.cuda.graph_pool_handle(), torch.cuda.Stream(self.device)
        for tokens in reversed(self.buckets):
            for with_lora in (False, True):
                self.graphs[(tokens, with_lora)] = self._capture(tokens, with_lora, mempool, stream)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d mixed-step graphs for steps of up to %s tokens", len(self.graphs),
                    self.buckets[-1])
        self._drop_slow_buckets()

    def _drop_slow_buckets(self) -> None:
        """Time every graph's replay (over the static inputs as captured: no KV slot, no adapter) and keep
        the buckets worth keeping, with LoRA and without."""
        tp = self.model.tensor_parallel
        for with_lora in (False, True):
            seconds = {tokens: replay_seconds(self.graphs[(tokens, with_lora)].graph) for tokens in self.buckets}
            if tp is not None:                  # every rank keeps the same buckets: by the slowest rank's times
                seconds = dict(zip(seconds, tp.slowest(list(seconds.values()), self.device)))
            self.usable[with_lora] = buckets_worth_keeping(seconds)
            dropped = {tokens: f"{seconds[tokens] * 1e3:.2f} ms" for tokens in self.buckets
                       if tokens not in self.usable[with_lora]}
            if dropped:
                logger.info("mixed-step buckets %s (LoRA %s) replay slower than a larger bucket (largest: %.2f ms):"
                            " their steps pad to it", dropped, with_lora, seconds[self.buckets[-1]] * 1e3)

    def _capture(self, tokens: int, with_lora: bool, mempool: "MemPool", stream: torch.cuda.Stream) -> BucketGraph:
        views = self.staged.views(self._sizes(tokens), with_lora)
        packed = self.staged.device_extra(ATTENTION_INPUTS)[:packed_length(self.seqs(tokens))]
        inputs = split_attention_inputs(packed)
        self._record(views.device, inputs)          # compiles the kernels outside the capture
        torch.cuda.synchronize(self.device)
        graph = torch.cuda.CUDAGraph()
        with cublas_without_workspace(), torch.cuda.graph(graph, pool=mempool, stream=stream):
            logits = self._record(views.device, inputs)
        return BucketGraph(graph, views, logits)

    def _record(self, batch: StepBatch[Tensor], inputs: AttentionInputs) -> Tensor:
        lora = None if batch.lora is None else self.lora.step(batch.lora)
        return self.model(batch, self.pool, _BucketModelAttention(self.attention, inputs, self._out_for), lora)

    def _out_for(self, query: Tensor) -> Tensor:
        """The attention output of every layer of every bucket: leading rows of one buffer, zeroed once when
        the largest bucket first runs (outside its capture), so attention adds no memset to the graphs.
        Attention writes only the step's rows; the padding rows keep zeros or an earlier step's values,
        finite either way."""
        if self._attention_out is None:
            self._attention_out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        assert self._attention_out.shape[0] >= query.shape[0], "the largest bucket is recorded first"
        return self._attention_out[:query.shape[0]]                         # [tokens, heads, head_dim]

    def bucket_for(self, num_tokens: int, with_lora: bool) -> int | None:
        return next((b for b in self.usable[with_lora] if b >= num_tokens), None)

    def fits(self, host: HostBatch, num_seqs: int) -> int | None:
        """The bucket of a step with prefill rows that a bucket's graph can run, or None: every sampled row is a
        sequence's last (no prompt-logprob rows), and its tables fit the static buffers."""
        bucket = self.bucket_for(host.input_ids.shape[0], host.lora is not None)
        if bucket is None or len(host.sample_indices) > num_seqs:
            return None
        return bucket if self.limits.holds(host, self.adapter_slots(bucket)) else None

    def replay(self, bucket: int, host: HostBatch, feed: TokenFeed | None) -> Tensor:
        """Copy the step into the bucket's static inputs, then replay its graph; logits `[sampled, vocab]`."""
        captured = self.graphs[(bucket, host.lora is not None)]
        self.stage(captured, host, feed)
        captured.graph.replay()
        return captured.logits[:len(host.sample_indices)]

    def stage(self, captured: BucketGraph, host: HostBatch, feed: TokenFeed | None) -> None:
        """Copy a step into a bucket's static inputs, in one copy from a host twin (its pending input ids fed
        on the device after it)."""
        twin = self.staged.begin(captured.views)
        host.copy_into(twin.batch)
        self._stage_extras(twin.batch, host, twin.extras[ATTENTION_INPUTS][:packed_length(captured.seqs)])
        self.staged.send()
        step_batch.feed_tokens(captured.views.device, feed)

    @staticmethod
    def _stage_extras(twin: HostArrays, host: HostBatch, packed: np.ndarray) -> None:
        """What a mixed step stages beyond copy_into: the sampled rows and query_start_loc are aranges in
        static buffers (the decode graphs' use); here they are the step's. The sampled rows past the step's
        read row 0, inside every bucket; the sequences past the step start at its end, so query_start_loc
        stays ascending (row_queries searches it). Then the step's AttentionInputs. Through numpy, as
        copy_into."""
        sample_indices, query_start_loc = twin["sample_indices"], host.query_start_loc
        sample_indices.fill(0)
        sample_indices[:len(host.sample_indices)] = host.sample_indices
        starts = twin["query_start_loc"]
        starts.fill(query_start_loc[-1])
        starts[:len(query_start_loc)] = query_start_loc
        write_attention_inputs(host, packed)
