"""Batched LoRA behind the model (DESIGN §4): a long-lived backend per device, and the per-step object
it makes for each step's adapter tables.

The backend is the torch reference on the CPU and the Triton kernels on CUDA. Its `step(tables)`
returns a `LoraStep`, which the model asks for each projection's LoRA: added into the projection's
output, or returned as a delta for the op that reads the output to add (decode graphs, where the delta
runs on a side stream beside the GEMM). The Triton step groups the tokens by adapter once and
decides, from the step's size, how the kernels cut it (`LoraLaunchPolicy`).
"""
import dataclasses
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch
from torch import Tensor

from slora.execution.step_batch import StepLora
from slora.execution.tensor_parallel import TensorParallel
from slora.kernels import reference

if TYPE_CHECKING:
    from slora.kernels.lora import LoraSegments

# The launch thresholds, measured on the H200 (docs/decisions.md names the runs).
# Up to this many tokens, shrinking into one atomically summed h beat split partial sums.
ACCUMULATE_MAX_TOKENS = 64
# Steps with at most this many adapter slots (the few-adapter decode graphs) accumulate too...
ACCUMULATE_MAX_SLOTS = 4
# ...up to this many tokens, which bounds the float32 workspace (layers x modules x tokens x max_rank).
ACCUMULATE_FEW_MAX_TOKENS = 256
# Tokens go in blocks of 64 rather than 16 only from this many tokens per slot: 16 was slower in decode.
BLOCK_M_TOKENS_PER_SLOT = 64
# The one-token expand kernel wins from 128 tokens with a slot each; at 64 it lost to the tl.dot one.
GEMV_EXPAND_MIN_TOKENS = 128


@dataclass(frozen=True)
class LoraLaunchPolicy:
    """How the CUDA LoRA kernels cut a step, decided from its size (fixed per captured graph). The
    defaults are the constants above; tests and benchmarks move them to reach the other kernel paths.

    accumulate_max_tokens, accumulate_max_slots, accumulate_few_max_tokens: which steps shrink into one h.
    block_m_tokens_per_slot: tokens per slot from which tokens go in blocks of 64.
    gemv_expand_min_tokens: steps of at least this many tokens with a slot per token expand with the
        one-token kernel (and shrink into one h); None: never."""
    accumulate_max_tokens: int = ACCUMULATE_MAX_TOKENS
    accumulate_max_slots: int = ACCUMULATE_MAX_SLOTS
    accumulate_few_max_tokens: int = ACCUMULATE_FEW_MAX_TOKENS
    block_m_tokens_per_slot: int = BLOCK_M_TOKENS_PER_SLOT
    gemv_expand_min_tokens: int | None = GEMV_EXPAND_MIN_TOKENS

    def __post_init__(self) -> None:
        for name in ("accumulate_max_tokens", "accumulate_max_slots", "accumulate_few_max_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.block_m_tokens_per_slot < 1:
            raise ValueError(f"block_m_tokens_per_slot must be >= 1, got {self.block_m_tokens_per_slot}")
        if self.gemv_expand_min_tokens is not None and self.gemv_expand_min_tokens < 1:
            raise ValueError(f"gemv_expand_min_tokens must be >= 1 or None, got {self.gemv_expand_min_tokens}")

    def accumulates(self, num_tokens: int, num_slots: int) -> bool:
        few_slots = num_slots <= self.accumulate_max_slots and num_tokens <= self.accumulate_few_max_tokens
        return num_tokens <= self.accumulate_max_tokens or few_slots or self.expands_by_gemv(num_tokens, num_slots)

    def expands_by_gemv(self, num_tokens: int, num_slots: int) -> bool:
        """A step of at least gemv_expand_min_tokens tokens whose adapter tables have a slot per token."""
        min_tokens = self.gemv_expand_min_tokens
        return min_tokens is not None and num_slots >= num_tokens >= min_tokens

    def block_m(self, num_tokens: int, num_slots: int) -> int:
        return 64 if num_tokens >= self.block_m_tokens_per_slot * max(num_slots, 1) else 16


class LoraKernels(Protocol):
    """Shrink and expand over `[modules, slots]` tables, as `slora.kernels.reference` defines them."""

    def lora_shrink(self, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                    a_offsets: Tensor, max_rank: int) -> Tensor: ...

    def lora_expand(self, out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                    ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int],
                    add: bool = True) -> None: ...


class GroupTables(NamedTuple):
    """One layer's tables for a group of modules, each `[modules, slots]`."""
    ranks: Tensor
    gathered_ranks: Tensor      # the ranks of a gathered shrink (fully sharded tensor parallelism), else `ranks`
    a_offsets: Tensor
    b_offsets: Tensor
    scalings: Tensor


class LoraStep:
    """The LoRA of one step: its tables, the kernels to run them with, and whether the model gets deltas.

    deltas: each group's LoRA is computed apart as a delta, which the op reading the projection adds,
    instead of being added into the projection's output after its GEMM. side_stream (with deltas): the
    delta is computed on it while the GEMM runs on the current stream. tp (fully sharded tensor-parallel
    adapters only): the ranks the shrinks are exchanged with."""

    def __init__(self, tables: StepLora[Tensor], kernels: LoraKernels, backend: "LoraBackend", deltas: bool = False,
                 side_stream: torch.cuda.Stream | None = None, tp: TensorParallel | None = None) -> None:
        self.tables, self.kernels, self.deltas, self.side_stream = tables, kernels, deltas, side_stream
        self._backend, self._tp = backend, tp
        # The ranks a gathered shrink holds (fully sharded column-parallel A: each rank's times the ranks), once a
        # step rather than once a layer.
        self._gathered_ranks = tables.ranks if tp is None else tables.ranks * tp.size
        self._views: dict[tuple[int, int], list[GroupTables]] = {}

    @property
    def token_slots(self) -> Tensor:
        return self.tables.token_slots

    def rows(self, rows: Tensor) -> "LoraStep":
        """The LoRA of these rows of the step alone (`rows` `[n]` int64): the same adapter tables, the rows'
        token slots, and the kernels' grouping made anew for them."""
        tables = dataclasses.replace(self.tables, token_slots=self.tables.token_slots[rows])
        return self._backend.step(tables, self.deltas, self.side_stream)

    def apply(self, layer: int, modules: slice, x: Tensor, out: Tensor, pool: Tensor, out_sizes: list[int],
              row_parallel: bool = False) -> None:
        """out += LoRA(x) for the modules `modules` of layer `layer` (consecutive ones that read the same x,
        their outputs side by side in out, `out_sizes` columns each), each token through its own adapter.
        row_parallel: under tensor parallelism, x holds the rank's input features and out is its partial sum."""
        if any(self.tables.active[layer][modules]):
            self._shrink_expand(layer, modules, x, out, pool, out_sizes, add=True, row_parallel=row_parallel)

    def delta(self, layer: int, modules: slice, x: Tensor, pool: Tensor, out_sizes: list[int]) -> Tensor | None:
        """The LoRA of `modules` alone, `[tokens, sum(out_sizes)]` in x's dtype (the rows of tokens without
        adapter are not written), or None when no adapter of the step targets these modules."""
        if not any(self.tables.active[layer][modules]):
            return None
        delta = x.new_empty(x.shape[0], sum(out_sizes))
        self._shrink_expand(layer, modules, x, delta, pool, out_sizes, add=False)
        return delta

    def _shrink_expand(self, layer: int, modules: slice, x: Tensor, out: Tensor, pool: Tensor,
                       out_sizes: list[int], add: bool, row_parallel: bool = False) -> None:
        t = self.tables
        ranks, gathered_ranks, a_offsets, b_offsets, scalings = self._group_tables(modules)[layer]   # [modules, slots]
        h = self.kernels.lora_shrink(x, pool, t.token_slots, t.page_tables, ranks, a_offsets, t.max_rank)
        tp = self._tp
        if tp is not None and row_parallel:
            # A split by input: the ranks' shrinks are partial sums. B split by output: this rank's columns.
            h, out, out_sizes = tp.reduce_lora(h), tp.own_columns(out), [size // tp.size for size in out_sizes]
        elif tp is not None:
            # A split by rank: each rank shrank to every size-th rank of the whole; B holds all of them.
            h, ranks = tp.gather_rank_split(h, ranks.shape[0]), gathered_ranks
        self.kernels.lora_expand(out, h, pool, t.token_slots, t.page_tables, ranks, b_offsets, scalings,
                                 out_sizes, add=add)

    def _group_tables(self, modules: slice) -> list["GroupTables"]:
        """Per layer, the views of the tables for a group of modules, made once per step and group: in eager
        steps the host bounds the step, and indexing four tables per call was a share of it. The gathered
        ranks are the ranks' own views but under fully sharded tensor parallelism."""
        assert modules.step is None, "a group is consecutive modules"
        key = (modules.start, modules.stop)
        if key not in self._views:
            t = self.tables
            ranks, a_offsets, b_offsets, scalings = (table[:, modules].unbind(0)
                                                     for table in (t.ranks, t.a_offsets, t.b_offsets, t.scalings))
            gathered = ranks if self._tp is None else self._gathered_ranks[:, modules].unbind(0)
            self._views[key] = [GroupTables(*views) for views in zip(ranks, gathered, a_offsets, b_offsets, scalings)]
        return self._views[key]


class LoraBackend(Protocol):
    def step(self, tables: StepLora[Tensor], deltas: bool = False,
             side_stream: torch.cuda.Stream | None = None) -> LoraStep: ...


class _ReferenceKernels:
    lora_shrink = staticmethod(reference.lora_shrink)
    lora_expand = staticmethod(reference.lora_expand)


class ReferenceLora:
    """The torch reference kernels (CPU engines). tp: the ranks fully sharded adapters exchange shrinks with."""

    def __init__(self, tp: TensorParallel | None = None) -> None:
        self.tp = tp

    def step(self, tables: StepLora[Tensor], deltas: bool = False,
             side_stream: torch.cuda.Stream | None = None) -> LoraStep:
        return LoraStep(tables, _ReferenceKernels(), self, deltas, side_stream, self.tp)


class TritonLora:
    """The Triton kernels (CUDA engines, and CPU tests through the interpreter). Triton is imported only
    here, when such a backend is built. tp: the ranks fully sharded adapters exchange shrinks with."""

    def __init__(self, pdl: bool = False, policy: LoraLaunchPolicy = LoraLaunchPolicy(),
                 tp: TensorParallel | None = None) -> None:
        from slora.kernels import lora
        self._lora, self.pdl, self.policy, self.tp = lora, pdl, policy, tp

    def step(self, tables: StepLora[Tensor], deltas: bool = False,
             side_stream: torch.cuda.Stream | None = None) -> LoraStep:
        """The segments are computed here, once per step, so that the kernels may read them before the
        previous kernel ends (pdl)."""
        tokens, slots = tables.token_slots.shape[0], tables.page_tables.shape[0]
        segments = self._lora.lora_segments(tables.token_slots, slots, self.policy.block_m(tokens, slots))
        # Fully sharded adapters exchange whole shrinks, not the split partial sums expand adds up.
        accumulate = self.tp is not None or self.policy.accumulates(tokens, slots)
        kernels = _TritonStepKernels(self._lora, segments, self.pdl, accumulate,
                                     self.policy.expands_by_gemv(tokens, slots),
                                     tables.ranks.shape[0] * tables.ranks.shape[1])
        return LoraStep(tables, kernels, self, deltas, side_stream, self.tp)


class _TritonStepKernels:
    """One step's Triton launches. In small steps every shrink adds into a slice of one float32
    workspace that the step's first shrink zeroes (one memset per step, inside the captured graph for
    decode)."""

    def __init__(self, lora: ModuleType, segments: "LoraSegments", pdl: bool, accumulate: bool, gemv: bool,
                 num_modules: int) -> None:
        self._lora, self.segments, self.pdl = lora, segments, pdl
        self._accumulate, self._gemv, self._num_modules = accumulate, gemv, num_modules   # layers x modules
        self._workspace: Tensor | None = None
        self._used = 0

    def lora_shrink(self, x: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor, ranks: Tensor,
                    a_offsets: Tensor, max_rank: int) -> Tensor:
        if not self._accumulate:
            # The split partial sums go straight to expand, which adds them up as it reads them.
            return self._lora.lora_shrink(x, pool, token_slots, page_tables, ranks, a_offsets, max_rank,
                                          partials=True, segments=self.segments, pdl=self.pdl)
        modules = 1 if ranks.dim() == 1 else ranks.shape[0]
        h = self._zeroed(x.shape[0], modules * max_rank, max_rank, x.device)
        return self._lora.lora_shrink(x, pool, token_slots, page_tables, ranks, a_offsets, max_rank, out=h,
                                      segments=self.segments, pdl=self.pdl)

    def _zeroed(self, rows: int, width: int, max_rank: int, device: torch.device) -> Tensor:
        """A zeroed float32 `[rows, width]` slice of the step's workspace, sized at the first call for every
        module of every layer (max_rank columns for each)."""
        if self._workspace is None:
            capacity = self._num_modules * rows * max_rank
            self._workspace = torch.zeros(capacity, dtype=torch.float32, device=device)
        assert self._used + rows * width <= self._workspace.numel(), "more shrinks in a step than modules"
        chunk = self._workspace[self._used:self._used + rows * width].view(rows, width)
        self._used += rows * width
        return chunk

    def lora_expand(self, out: Tensor, h: Tensor, pool: Tensor, token_slots: Tensor, page_tables: Tensor,
                    ranks: Tensor, b_offsets: Tensor, scalings: Tensor, out_sizes: list[int],
                    add: bool = True) -> None:
        self._lora.lora_expand(out, h, pool, token_slots, page_tables, ranks, b_offsets, scalings,
                               out_sizes=out_sizes, segments=self.segments, pdl=self.pdl, gemv=self._gemv,
                               add=add)
