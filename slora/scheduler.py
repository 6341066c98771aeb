"""Iteration-level (continuous) batching over the unified pool (DESIGN §2, §3).

Each step: running sequences first (decode, or the next chunk of a long prefill), growing their block
tables one page at a time; when no page is free, idle adapters are evicted (LRU) and then the newest
running sequence is preempted (its pages freed; it is recomputed later as one prefill). Then waiting
requests are admitted in arrival order while the batch bounds and the pool allow. No torch and no model
here: the engine runs the model on the output, the simulator a step-cost function.
"""
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

from slora.adapter_residency import AdapterResidency
from slora.page_pool import PageAllocator
from slora.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    watermark: float = 0.01          # share of all pages kept free when admitting new requests

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int                  # tokens computed for it in this step, from seq.num_computed_tokens

    @property
    def completes(self) -> bool:
        """Whether this step computes the sequence's last known token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    adapters_to_load: list[tuple[str, list[int]]]     # (version, pages) to fill before the forward
    preempted: list[Sequence]
    rejected: list[Sequence]                          # can never fit in the pool; finished by the caller

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


@dataclass
class Scheduler:
    config: SchedulerConfig
    allocator: PageAllocator
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    step_count: int = 0
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        self.adapters = AdapterResidency(self.allocator)

    @property
    def watermark_pages(self) -> int:
        return int(self.config.watermark * self.allocator.num_pages)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def pages_to_admit(self, seq: Sequence) -> int:
        """Pages a waiting sequence needs to be admitted: its tokens, plus its adapter if not resident."""
        adapter = seq.adapter
        adapter_pages = adapter.num_pages if adapter and not self.adapters.is_resident(adapter.version) else 0
        return seq.pages_needed(seq.num_tokens, self.config.page_size) + adapter_pages

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput([], [], [], [])
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._admit_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_tokens = min(seq.num_uncomputed, budget)
            if not self._grow(seq, seq.num_computed_tokens + num_tokens, out):
                break                       # seq preempted itself: everything after it is gone too
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
            index += 1
        return budget

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `seq` slots for `num_tokens` tokens; False if `seq` itself had to be preempted."""
        for _ in range(seq.pages_needed(num_tokens, self.config.page_size)):
            while self.allocator.num_free == 0:
                if self.adapters.evict_one_idle():
                    continue
                victim = self.running[-1]      # newest first
                self.preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    return False
            seq.block_table.append(self.allocator.allocate_kv())
        return True

    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if not self._can_admit(seq):
                if not self.running and not out.scheduled:
                    out.rejected.append(self.waiting.popleft())   # would wait forever
                    continue
                break
            self.waiting.popleft()
            budget -= self._admit(seq, budget, out)

    def _can_admit(self, seq: Sequence) -> bool:
        own = seq.adapter.version if seq.adapter else None
        available = self.allocator.num_free + self.adapters.idle_pages(exclude=own)
        return self.pages_to_admit(seq) + self.watermark_pages <= available

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput) -> int:
        if seq.adapter is not None:
            pages = self.adapters.make_resident(seq.adapter, self.step_count)
            if pages is not None:
                out.adapters_to_load.append((seq.adapter.version, pages))
            self.adapters.pin(seq.adapter.version, self.step_count)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        num_tokens = min(seq.num_uncomputed, budget)
        grown = self._grow(seq, seq.num_computed_tokens + num_tokens, out)
        assert grown, "admission checked that the pages were available"
        out.scheduled.append(ScheduledSeq(seq, num_tokens))
        return num_tokens

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it goes back to the front of the queue for recompute."""
        self._release(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (running or waiting) and free what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        for page in seq.block_table:
            self.allocator.release_kv(page)
        seq.block_table.clear()
        self.running.remove(seq)
        if seq.adapter is not None:
            self.adapters.unpin(seq.adapter.version, self.step_count)

    def check(self) -> None:
        """The pool's invariants against the block tables and adapters held here."""
        self.allocator.check([s.block_table for s in self.running], self.adapters.page_tables())
