"""One engine step's flat inputs, as the model reads them (DESIGN §3).

A `StepBatch` of numpy arrays (a `HostBatch`) is built on the host, moved with `to(device)` for an eager
step, or copied with `copy_into` into a host twin of the CUDA graphs' static buffers (slora.execution.staging), which
one copy then sends. The model reads a `StepBatch` of tensors. The static buffers are one too, made by
`empty` at the largest size and cut per graph by `view`. All four are derived from the fields' metadata:
an array field names its dimensions, its dtype and, where the kernels would misread leftovers, the value
that pads it. A new per-step field is one field here.
"""
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from slora.adapters.packing import AdapterDescriptor
from slora.core.scheduler import ScheduledSeq
from slora.execution.device_copy import select_rows, to_device, write_rows
from slora.kernels.layout import align_up

# Sizes a tensor dimension may name: "tokens", "seqs", "seqs+1", "pages" (block-table width), "slots"
# (adapter slots of the step), "adapter_pages" (page-table width), "layers", "modules".
Sizes = Mapping[str, int]
# version -> (where its weights lie in its buffer, its pages in the pool)
StepAdapters = dict[str, tuple[AdapterDescriptor, list[int]]]
# A batch's arrays: numpy on the host (no tensor to convert per step: `.numpy()` and `from_numpy` cost about as
# much as a small copy), tensors where the model reads them.
Array = TypeVar("Array", Tensor, np.ndarray)
# A static batch's host twin as numpy views, by field name (host_arrays); a view without LoRA has no LoRA names.
HostArrays = Mapping[str, np.ndarray]
# Step max ranks are multiples of this (step_max_rank).
RANK_ALIGN = 16


def _tensor(dims: tuple[str, ...], dtype: torch.dtype, pad: int | None = None, arange: bool = False) -> Any:
    """A tensor field. pad: the value the rows the step leaves unused must hold in a static buffer (KV location -1:
    K/V not stored; context 0: attention reads nothing; rank 0: no adapter weight is read). arange: the
    buffer holds 0, 1, 2, ... (the decode graphs' one token per sequence), and a decode step is never
    copied into it."""
    return field(metadata={"dims": dims, "dtype": dtype, "pad": pad, "arange": arange})


@dataclass(kw_only=True)
class StepLora(Generic[Array]):
    """The adapters of one step. Slot s is the s-th distinct adapter version of the step."""

    token_slots: Array = _tensor(("tokens",), torch.int32, pad=-1)              # -1: no adapter
    page_tables: Array = _tensor(("slots", "adapter_pages"), torch.int32)
    ranks: Array = _tensor(("layers", "modules", "slots"), torch.int32, pad=0)
    a_offsets: Array = _tensor(("layers", "modules", "slots"), torch.int64)
    b_offsets: Array = _tensor(("layers", "modules", "slots"), torch.int64)
    scalings: Array = _tensor(("layers", "modules", "slots"), torch.float32)
    max_rank: int = 0                  # the kernels' rank bound (step_max_rank of the highest rank)
    active: list[list[bool]] = field(default_factory=list)   # [layer][module]: any adapter targets it


@dataclass(kw_only=True)
class StepBatch(Generic[Array]):
    """Tokens of all scheduled sequences, concatenated. Sequence s owns rows
    `query_start_loc[s]:query_start_loc[s+1]`, the last of its `context_lens[s]` tokens."""

    input_ids: Array = _tensor(("tokens",), torch.int64)
    positions: Array = _tensor(("tokens",), torch.int64)
    kv_locations: Array = _tensor(("tokens",), torch.int64, pad=-1)      # page * page_size + offset
    block_tables: Array = _tensor(("seqs", "pages"), torch.int32)
    query_start_loc: Array = _tensor(("seqs+1",), torch.int32, arange=True)
    context_lens: Array = _tensor(("seqs",), torch.int32, pad=0)
    # Rows whose logits are wanted: the completing sequences' last rows, then prompt-logprob rows (eager).
    sample_indices: Array = _tensor(("seqs",), torch.int64, arange=True)
    page_size: int = 16
    max_query_len: int = 1
    max_context_len: int = 0
    lora: StepLora[Array] | None = None
    # The leading sequences with one new token each (all of them in a decode step).
    num_decodes: int = 0

    def to(self: "HostBatch", device: torch.device) -> "StepBatch[Tensor]":
        """A host batch's tensors on `device` (copies that do not block the host)."""
        return _map_tensors(self, lambda array, spec: to_device(_as_tensor(array, spec), device))

    def copy_into(self: "HostBatch", target: "HostArrays") -> None:
        """Copy a host step into a host twin of a graph's static views (each at least as large), given as
        `host_arrays` of them: every tensor into its leading corner, padded fields filled first; arange
        fields keep their values. Runs every graph replay, so it walks the fields' metadata read once at
        import, and copies through numpy, whose small copies cost the host less than half of torch's."""
        assert self.lora is None or "token_slots" in target, "a step with adapters copied into a graph without LoRA"
        for spec, source in _host_fields(self):
            destination = target[spec.name]
            if spec.pad is not None:
                destination.fill(spec.pad)
            destination[tuple(map(slice, source.shape))] = source


# A step's inputs as built on the host.
HostBatch = StepBatch[np.ndarray]


def as_host(batch: StepBatch[Tensor]) -> HostBatch:
    """A batch of CPU tensors as a host batch of numpy views of them (tests and benchmarks build steps from
    tensors)."""
    return _map_tensors(batch, lambda tensor, _: tensor.numpy())


class _FieldSpec(NamedTuple):
    """A tensor field's name and metadata (see _tensor)."""
    name: str
    dims: tuple[str, ...]
    dtype: torch.dtype
    pad: int | None
    arange: bool


def _specs(cls: type) -> tuple[_FieldSpec, ...]:
    return tuple(_FieldSpec(f.name, **f.metadata) for f in dataclasses.fields(cls) if "dims" in f.metadata)


_BATCH_SPECS, _LORA_SPECS = _specs(StepBatch), _specs(StepLora)
_COPIED_BATCH_SPECS = tuple(spec for spec in _BATCH_SPECS if not spec.arange)
_COPIED_LORA_SPECS = tuple(spec for spec in _LORA_SPECS if not spec.arange)
assert not {s.name for s in _BATCH_SPECS} & {s.name for s in _LORA_SPECS}, "tensors_of keys both by name"


def empty(sizes: Sizes, device: torch.device, page_size: int, max_rank: int,
          with_lora: bool = True) -> StepBatch[Tensor]:
    """Static buffers of these sizes, padded fields at their pad value and arange fields counting."""
    def make(spec: _FieldSpec) -> Tensor:
        shape = [_size(sizes, d) for d in spec.dims]
        if spec.arange:
            return torch.arange(shape[0], dtype=spec.dtype, device=device)
        return torch.full(shape, spec.pad or 0, dtype=spec.dtype, device=device)
    lora = None
    if with_lora:
        lora = StepLora(**{spec.name: make(spec) for spec in _LORA_SPECS}, max_rank=max_rank,
                        active=[[True] * sizes["modules"]] * sizes["layers"])
    return StepBatch(**{spec.name: make(spec) for spec in _BATCH_SPECS}, page_size=page_size,
                     max_query_len=1, max_context_len=sizes["pages"] * page_size, lora=lora, num_decodes=0)


def view(static: StepBatch[Tensor], sizes: Sizes, with_lora: bool) -> StepBatch[Tensor]:
    """The leading `sizes` of static buffers (a graph's batch): dims not named in `sizes` stay whole."""
    def cut(tensor: Tensor, spec: _FieldSpec) -> Tensor:
        return tensor[tuple(slice(0, _size(sizes, d)) if _named(sizes, d) else slice(None) for d in spec.dims)]
    cut_batch = _map_tensors(static, cut)
    return cut_batch if with_lora else dataclasses.replace(cut_batch, lora=None)


def tensors_of(batch: StepBatch[Tensor]) -> dict[str, Tensor]:
    """Every tensor field of a batch and of its adapter tables, by field name (the two share none)."""
    tensors = {spec.name: getattr(batch, spec.name) for spec in _BATCH_SPECS}
    if batch.lora is not None:
        tensors.update({spec.name: getattr(batch.lora, spec.name) for spec in _LORA_SPECS})
    return tensors


def with_tensors(template: StepBatch[Tensor], tensors: Mapping[str, Tensor]) -> StepBatch[Tensor]:
    """The template with each tensor field replaced by the tensor of its name (the inverse of tensors_of)."""
    return _map_tensors(template, lambda _, spec: tensors[spec.name])


def _size(sizes: Sizes, dim: str) -> int:
    return sizes["seqs"] + 1 if dim == "seqs+1" else sizes[dim]


def _named(sizes: Sizes, dim: str) -> bool:
    return (dim == "seqs+1" and "seqs" in sizes) or dim in sizes


def _map_tensors(batch: Any, fn: Callable[[Any, _FieldSpec], Any]) -> Any:
    """A copy of a StepBatch (or StepLora) with fn(array, spec) applied to every array field."""
    specs = _BATCH_SPECS if isinstance(batch, StepBatch) else _LORA_SPECS
    changes = {spec.name: fn(getattr(batch, spec.name), spec) for spec in specs}
    if isinstance(batch, StepBatch) and batch.lora is not None:
        changes["lora"] = _map_tensors(batch.lora, fn)
    return dataclasses.replace(batch, **changes)


def _as_tensor(array: np.ndarray, spec: _FieldSpec) -> Tensor:
    """A host field as a tensor of its declared dtype (copy_into casts into the static buffers' dtypes, so a
    wrong one would go unseen there and reach the eager path alone)."""
    tensor = torch.from_numpy(array)
    assert tensor.dtype == spec.dtype, f"host field {spec.name} is {tensor.dtype}, not {spec.dtype}"
    return tensor


def _host_fields(batch: HostBatch) -> Iterator[tuple[_FieldSpec, np.ndarray]]:
    """The tensor fields a step copies into a graph's static inputs: all but the aranges."""
    for spec in _COPIED_BATCH_SPECS:
        yield spec, getattr(batch, spec.name)
    if batch.lora is not None:
        for spec in _COPIED_LORA_SPECS:
            yield spec, getattr(batch.lora, spec.name)


def host_arrays(static: StepBatch[Tensor]) -> HostArrays:
    """Numpy views of a host twin's static tensors, by field name (copy_into's target). Made once per graph:
    a tensor's `.numpy()` costs the host about as much as the small copy through it."""
    return {name: tensor.numpy() for name, tensor in tensors_of(static).items()}


def flat_fields(host: HostBatch) -> tuple[list[int], list[np.ndarray]]:
    """A host batch as ints and arrays in a fixed order (what tensor-parallel rank 0 sends the other ranks
    each step; from_flat_fields is the inverse)."""
    lora = host.lora
    ints = [host.page_size, host.max_query_len, host.max_context_len, host.num_decodes, int(lora is not None),
            0 if lora is None else lora.max_rank]
    arrays = [getattr(host, spec.name) for spec in _BATCH_SPECS]
    if lora is not None:
        arrays += [getattr(lora, spec.name) for spec in _LORA_SPECS] + [np.array(lora.active, dtype=np.bool_)]
    return ints, arrays


def from_flat_fields(ints: Sequence[int], arrays: Sequence[np.ndarray]) -> HostBatch:
    """The host batch that flat_fields flattened."""
    page_size, max_query_len, max_context_len, num_decodes, has_lora, max_rank = ints
    batch_arrays = dict(zip((spec.name for spec in _BATCH_SPECS), arrays))
    lora = None
    if has_lora:
        lora_arrays = dict(zip((spec.name for spec in _LORA_SPECS), arrays[len(_BATCH_SPECS):]))
        lora = StepLora(**lora_arrays, max_rank=max_rank, active=arrays[-1].tolist())
    return StepBatch(**batch_arrays, page_size=page_size, max_query_len=max_query_len,
                     max_context_len=max_context_len, lora=lora, num_decodes=num_decodes)


def padded_rows(rows: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ints (block tables' page arrays, adapter page tables) as one zero-padded `[rows, longest]`
    int32 matrix, copied row by row, and the rows' lengths."""
    lengths = np.array([len(row) for row in rows])
    matrix = np.zeros((len(rows), int(lengths.max())), dtype=np.int32)
    for target, row, length in zip(matrix, rows, lengths):
        target[:length] = row
    return matrix, lengths


class _Rows(NamedTuple):
    """What a step's rows say on the host, before the per-token arrays are derived from it."""
    input_ids: np.ndarray     # [tokens] int64
    computed: list[int]       # per row: its tokens already in the cache
    counts: list[int]         # per row: its new tokens
    sample_rows: list[int]
    first_longer: int | None  # the first row of more than one token


def _walk_rows(scheduled: list[ScheduledSeq]) -> _Rows:
    """The step's rows in order: their input ids, counts and sampled rows (the Python part of the build)."""
    pieces: list[np.ndarray] = []            # input ids: each run of one-token rows, then each longer row's
    run: list[int] = []
    computed, counts, sample_rows = [], [], []
    end, first_longer = 0, None
    for index, item in enumerate(scheduled):
        seq, start, count = item.seq, item.seq.num_computed_tokens, item.num_tokens
        if count == 1:               # a decode row, most of a step's: no array built for it
            # A pending token is on the device: token_feed writes it there, over this 0.
            run.append(0 if seq.pending_row is not None else seq.token_at(start))
        else:
            assert seq.pending_row is None, "a pending token is its sequence's only uncomputed one"
            first_longer = index if first_longer is None else first_longer
            pieces += [np.array(run, dtype=np.int64), seq.token_array(start, start + count)]
            run = []
        computed.append(start)
        counts.append(count)
        end += count
        if item.completes:
            sample_rows.append(end - 1)
    last_run = np.array(run, dtype=np.int64)
    input_ids = np.concatenate([*pieces, last_run]) if pieces else last_run     # int64 either way
    return _Rows(input_ids, computed, counts, sample_rows, first_longer)


class _TokenArrays(NamedTuple):
    starts: np.ndarray        # [seqs + 1] int32: query_start_loc
    positions: np.ndarray     # [tokens] int64
    locations: np.ndarray     # [tokens] int64: kv_locations


def _token_arrays(counts: np.ndarray, computed: np.ndarray, block_tables: np.ndarray,
                  page_size: int) -> _TokenArrays:
    """Each token's position and KV location from its row's counts, over all the step's tokens at once."""
    starts = np.zeros(len(counts) + 1, dtype=np.int32)
    np.cumsum(counts, out=starts[1:])
    token_rows = np.repeat(np.arange(len(counts)), counts)                              # [tokens]
    positions = computed[token_rows] + np.arange(len(token_rows)) - starts[token_rows]  # [tokens]
    pages = block_tables[token_rows, positions // page_size].astype(np.int64)           # [tokens]
    return _TokenArrays(starts, positions, pages * page_size + positions % page_size)


def build(scheduled: list[ScheduledSeq], adapters: StepAdapters, page_size: int,
          tables: "LoraTables | None" = None) -> HostBatch:
    """The flat batch of a step, built on the host: a walk over its rows, then numpy over its tokens."""
    rows = _walk_rows(scheduled)
    counts, computed = np.array(rows.counts), np.array(rows.computed)
    lens = (computed + counts).astype(np.int32)
    block_tables, table_lengths = padded_rows([item.seq.block_table.pages for item in scheduled])
    # A position past its table would read the padding, page 0: another sequence's page.
    assert ((lens - 1) // page_size < table_lengths).all(), "a token without its page"
    tokens = _token_arrays(counts, computed, block_tables, page_size)
    sample_rows = rows.sample_rows
    if any_prompt_logprobs(scheduled):
        sample_rows += _prompt_logit_rows(scheduled, tokens.starts.tolist())
    return StepBatch(
        input_ids=rows.input_ids, positions=tokens.positions, kv_locations=tokens.locations,
        block_tables=block_tables, query_start_loc=tokens.starts, context_lens=lens,
        sample_indices=np.array(sample_rows, dtype=np.int64), page_size=page_size,
        max_query_len=int(counts.max()), max_context_len=int(lens.max()),
        lora=_step_lora(scheduled, counts, adapters, tables or LoraTables()),
        # the scheduler puts one-token rows first
        num_decodes=len(scheduled) if rows.first_longer is None else rows.first_longer)


class TokenFeed(NamedTuple):
    """Input ids still on the device (overlapped scheduling): rows of a step's input_ids, and the rows of
    the ids the step before sampled that go into them."""

    rows: list[int]       # rows of the step's input_ids
    sources: list[int]    # rows of `sampled`
    sampled: Tensor       # [rows of the step before] int64, on the device


def token_feed(scheduled: list[ScheduledSeq], sampled: Tensor | None) -> TokenFeed | None:
    """The feed of the step's pending tokens from `sampled` `[rows]`, the ids of the step before; None when
    every input id is known on the host."""
    rows, sources, end = [], [], 0
    for item in scheduled:
        end += item.num_tokens
        if item.seq.pending_row is not None:
            rows.append(end - 1)
            sources.append(item.seq.pending_row)
    if not rows:
        return None
    assert sampled is not None, "a pending token without the sampled ids it is in"
    return TokenFeed(rows, sources, sampled)


def feed_tokens(batch: StepBatch[Tensor], feed: TokenFeed | None) -> None:
    """Write the feed's ids into the batch's input_ids on the device (after the host's were copied there).
    In most steps the decode rows come first and sample in the same order as in the step before, so the
    rows and their sources are leading slices and nothing is copied from the host."""
    if feed is not None:
        write_rows(batch.input_ids, feed.rows, select_rows(feed.sampled, feed.sources))


def prompt_logit_positions(item: ScheduledSeq) -> range:
    """Positions of this step whose logits give prompt logprobs (position p predicts prompt token p + 1),
    for a sequence that asks for them; the prompt's last position is its sampled row instead."""
    seq = item.seq
    if seq.params.prompt_logprobs is None:
        return range(0)
    start = seq.num_computed_tokens
    return range(start, min(start + item.num_tokens, len(seq.prompt_token_ids) - 1))


def any_prompt_logprobs(scheduled: list[ScheduledSeq]) -> bool:
    return any(item.seq.params.prompt_logprobs is not None for item in scheduled)


def prompt_logits(scheduled: list[ScheduledSeq], logits: Tensor) -> Iterator[tuple[ScheduledSeq, range, Tensor]]:
    """The prompt-logprob rows of a step's logits (those after its sampled rows): each sequence that asked
    for them, its positions, and their logits `[positions, vocab]`, in step order."""
    if logits.shape[0] == 0:           # no item asked for them: nothing to look for
        return
    start = 0
    for item in scheduled:
        positions = prompt_logit_positions(item)
        if positions:
            yield item, positions, logits[start:start + len(positions)]
            start += len(positions)


def _prompt_logit_rows(scheduled: list[ScheduledSeq], starts: list[int]) -> list[int]:
    """Rows of the prompt-logprob positions, after the sampled rows: in step order, position by position."""
    rows: list[int] = []
    for item, first in zip(scheduled, starts):
        positions = prompt_logit_positions(item)
        rows += range(first, first + len(positions))
    return rows


class _AdapterTables(NamedTuple):
    ranks: np.ndarray          # [layers, modules, slots] int32
    a_offsets: np.ndarray      # int64
    b_offsets: np.ndarray      # int64
    scalings: np.ndarray       # float32
    max_rank: int
    active: list[list[bool]]


class LoraTables:
    """The per-step adapter tables `[layers, modules, slots]` of recent adapter mixes. Decode steps
    usually repeat the previous step's mix, and stacking every version's descriptor again each step
    costs more host time than the rest of the step's LoRA inputs."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self._tables: dict[tuple[str, ...], _AdapterTables] = {}

    def get(self, versions: tuple[str, ...], adapters: StepAdapters) -> _AdapterTables:
        """The tables of the versions in slot order, and what follows from them alone."""
        tables = self._tables.pop(versions, None) or self._stack(versions, adapters)
        self._tables[versions] = tables                      # most recent last
        if len(self._tables) > self.capacity:
            del self._tables[next(iter(self._tables))]
        return tables

    @staticmethod
    def _stack(versions: tuple[str, ...], adapters: StepAdapters) -> _AdapterTables:
        descriptors = [adapters[v][0] for v in versions]

        def stack(name: str) -> np.ndarray:
            return torch.stack([getattr(d, name) for d in descriptors], dim=-1).numpy()  # [layers, modules, slots]
        ranks = stack("ranks")
        return _AdapterTables(ranks, stack("a_offsets"), stack("b_offsets"), stack("scalings"),
                              step_max_rank(int(ranks.max())), (ranks.max(axis=-1) > 0).tolist())


def step_max_rank(highest_rank: int) -> int:
    """The LoRA kernels' max_rank for a step whose highest adapter rank is `highest_rank`: rounded up to a
    multiple of RANK_ALIGN. Triton specialises integer arguments on divisibility by 16, and max_rank sets
    several (h's width and strides), so rank 8 and rank 16 steps would otherwise compile different kernel
    variants, each in the middle of serving. Columns past an adapter's rank are never read."""
    return align_up(highest_rank, RANK_ALIGN)


def _step_lora(scheduled: list[ScheduledSeq], counts: np.ndarray, adapters: StepAdapters,
               tables: LoraTables) -> StepLora[np.ndarray] | None:
    versions = tuple(sorted(adapters))         # the step's adapter versions, one slot each
    if not versions:
        return None
    slot_of = {v: i for i, v in enumerate(versions)}
    seq_slots = [slot_of[item.seq.adapter.version] if item.seq.adapter else -1 for item in scheduled]
    token_slots = np.repeat(np.array(seq_slots, dtype=np.int32), counts)     # [tokens]
    page_tables, _ = padded_rows([adapters[v][1] for v in versions])
    return StepLora(token_slots=token_slots, page_tables=page_tables, **tables.get(versions, adapters)._asdict())
