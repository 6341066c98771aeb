"""A sequence: one sample of one request, as the scheduler and the model runner see it."""
import enum
import operator
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import numpy as np

from slora.sampling.params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class AdapterRef:
    """The adapter version a sequence runs on, and how many pool pages its weights take."""

    version: str
    num_pages: int


class BlockTable:
    """A sequence's KV pages in order, read and written like a list. The pages are also kept in a growable
    int32 array: a step copies its sequences' tables into one matrix row by row, where a list of ints
    would be converted int by int. The list serves single reads (every step reads each sequence's
    current page), at a list's speed."""

    __slots__ = ("_list", "_array")

    def __init__(self, pages: Iterable[int] = ()) -> None:
        self._list = list(pages)
        self._array = np.array(self._list, dtype=np.int32)

    def __len__(self) -> int:
        return len(self._list)

    def __getitem__(self, index: int) -> int:
        return self._list[index]

    def __setitem__(self, index: int, page: int) -> None:
        index = operator.index(index)                 # one page: a slice would reach the list alone
        self._list[index] = page                      # raises IndexError as a list does, before the array
        self._array[index % len(self._list)] = page

    def __eq__(self, other: object) -> bool:
        """Equal to a table or list of the same pages, as a list is."""
        return self._list == (other._list if isinstance(other, BlockTable) else other)

    __hash__ = None                                   # type: ignore[assignment]  # mutable, as a list

    def __iter__(self) -> Iterator[int]:
        return iter(self._list)

    def __repr__(self) -> str:
        return f"BlockTable({self._list})"

    def extend(self, pages: list[int]) -> None:
        """Append pages (ints, as the allocator gives them), growing the array to twice its size when full."""
        start, end = len(self._list), len(self._list) + len(pages)
        if end > len(self._array):
            grown = np.empty(max(end, 2 * len(self._array)), dtype=np.int32)
            grown[:start] = self._array[:start]
            self._array = grown
        self._array[start:end] = pages
        self._list += pages

    @property
    def pages(self) -> np.ndarray:
        """The pages `[len]` int32, a view: it sees later writes to the table, until the table next grows."""
        return self._array[:len(self._list)]

    def tolist(self) -> list[int]:
        """A copy of the pages as a list."""
        return list(self._list)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    adapter: AdapterRef | None = None
    sample_index: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    block_table: BlockTable = field(default_factory=BlockTable)
    num_computed_tokens: int = 0          # tokens whose K/V are in the cache
    num_preemptions: int = 0
    finish_reason: str | None = None
    cache_salt: bytes = b""               # per-tenant salt of the prefix-cache hashes
    tenant: str | None = None             # whose share it is served from (slora.core.fair_share)
    priority: int = 0                     # within its tenant, lower is admitted first (not under fcfs)
    arrival: int = 0                      # order of its request's arrival, set by the scheduler
    num_charged_tokens: int = 0           # tokens charged to its tenant: beyond them a computed token is new
    page_hashes: list[bytes] = field(default_factory=list)   # hashes of the full pages of token_ids
    num_hashed_pages: int = 0             # block_table pages registered in the prefix cache
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache when first admitted
    swapped_pages: list[int] | None = None   # host swap pages holding its KV while swapped out
    max_loras_waits: int = 0              # steps it was passed over because max_loras adapters were running
    # Overlapped scheduling: its newest token is sampled but still on the device, in this row of the step's
    # sampled ids; the next step takes it from there as input, and it is appended when it reaches the host.
    pending_row: int | None = None
    # prompt_token_ids as an array (the prompt never changes): a step copies a chunk of it in one slice.
    prompt_array: np.ndarray = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_array = np.array(self.prompt_token_ids, dtype=np.int32)
        self.prompt_array.flags.writeable = False     # token_array hands out views of it

    @property
    def num_tokens(self) -> int:
        """Its tokens, a pending one (`pending_row`) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + (self.pending_row is not None)

    def ends_with_pending(self, max_model_len: int | None) -> bool:
        """Whether the pending token will end it by length, whatever it is (nothing to schedule after it)."""
        if self.pending_row is None:
            return False
        full = max_model_len is not None and self.num_tokens >= max_model_len
        return full or len(self.output_token_ids) + 1 >= self.params.max_tokens

    @property
    def token_ids(self) -> list[int]:
        """Its tokens known on the host (a pending one is not)."""
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """token_ids[position] without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        if position < prompt_len:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - prompt_len]

    def tokens_between(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step reads one token)."""
        prompt_len = len(self.prompt_token_ids)
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:end] + self.output_token_ids[:max(0, end - prompt_len)]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """tokens_between as an int array: a read-only int32 view of the prompt's array where the tokens are all
        prompt, an int64 copy otherwise."""
        if end <= len(self.prompt_array):
            return self.prompt_array[start:end]
        return np.array(self.tokens_between(start, end), dtype=np.int64)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def seed(self) -> int | None:
        return self.params.sample_seed(self.sample_index)

    def pages_needed(self, num_tokens: int, page_size: int) -> int:
        """Pages to add to the block table so that `num_tokens` tokens have slots."""
        return max(0, -(-num_tokens // page_size) - len(self.block_table))
