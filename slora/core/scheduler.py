"""Iteration-level (continuous) batching over the unified pool (DESIGN §2, §3).

Each step: running sequences first (decode, or the next chunk of a long prefill), growing their block
tables one page at a time; when no page is free, cached KV is evicted (LRU), then idle adapters (LRU),
then a running sequence is preempted (recomputed later as one prefill, or swapped to host memory): the
newest, or under `vtc` the newest of the tenant with the largest counter. Then waiting requests are admitted
in the policy's order (slora.core.waiting: arrival, priority, or each tenant's fair share) while the batch
bounds and the pool allow, reusing the longest run of cached pages that matches their prompt. Each tenant is
charged for the tokens its sequences get (slora.core.fair_share). Forked samples share pages; the
first write into a shared partial page copies it. No torch and no model here: the engine runs the
model on the output, the simulator a step-cost function.
"""
import itertools
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple

from slora.core.adapter_residency import AdapterResidency
from slora.core.fair_share import FairShare, TenantShare
from slora.core.page_pool import PageAllocator
from slora.core.prefix_cache import extend_hashes
from slora.core.sequence import AdapterRef, BlockTable, Sequence, SequenceStatus
from slora.core.swap_space import SwapSpace
from slora.core.waiting import SCHEDULING_POLICIES, WaitingQueue, waiting_queue

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    page_size: int = 16
    watermark: float = 0.01          # share of all pages kept free when admitting new requests
    enable_prefix_caching: bool = True
    preemption_mode: str = "recompute"
    swap_pages: int = 0              # host swap space, in pages (swap mode)
    prefetch_depth: int = 4          # waiting requests whose adapters are made resident ahead of time
    max_loras: int | None = None     # distinct adapter versions among running sequences (None: no limit)
    # Steps a request may be passed over for max_loras before newer requests queue behind it (the running
    # adapters then drain and it gets a place): requests of busy adapters cannot starve it.
    max_loras_patience: int = 16
    max_model_len: int | None = None  # a sequence ends at this many tokens
    scheduling_policy: str = "fcfs"  # the waiting queue's order (slora.core.waiting)
    prompt_cost: float = 1.0         # a tenant's charge per prompt token computed for it
    output_cost: float = 2.0         # ...and per token generated for it

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_loras is not None and self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1 (or None for no limit), got {self.max_loras}")
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if self.swap_pages < 0 or self.prefetch_depth < 0:
            raise ValueError("swap_pages and prefetch_depth must be >= 0")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")
        FairShare(self.prompt_cost, self.output_cost)          # the costs, checked by their owner

    def watermark_pages(self, num_pages: int) -> int:
        """Pages of a pool of `num_pages` kept free when admitting new requests."""
        return int(self.watermark * num_pages)

    def usable_pages(self, num_pages: int) -> int:
        """Pages one request (or adapter) may ever get in a pool of `num_pages`: all but the watermark."""
        return num_pages - self.watermark_pages(num_pages)


class ScheduledSeq(NamedTuple):
    seq: Sequence
    num_tokens: int                  # tokens computed for it in this step, from seq.num_computed_tokens

    @property
    def prompt_tokens(self) -> int:
        """Of the tokens computed in this step, those of the prompt."""
        start = self.seq.num_computed_tokens
        return max(0, min(len(self.seq.prompt_token_ids), start + self.num_tokens) - start)

    @property
    def completes(self) -> bool:
        """Whether this step computes the sequence's last known token, so a new token is sampled."""
        return self.seq.num_computed_tokens + self.num_tokens == self.seq.num_tokens


def decodes_first(scheduled: list[ScheduledSeq], num_tokens: int) -> None:
    """Order a step's `num_tokens` tokens of rows one-token rows first, stably. Rows arrive mostly in that order
    already: decodes, then the prompts admitted last. The longer rows at the end are walked back from it, and
    when they hold every token past one per row, nothing is sorted; a decode step is not walked at all."""
    extra = num_tokens - len(scheduled)            # tokens past one per row: the longer rows' share
    index = len(scheduled) - 1
    while extra > 0 and index >= 0 and scheduled[index].num_tokens > 1:
        extra -= scheduled[index].num_tokens - 1
        index -= 1
    if extra > 0:
        scheduled.sort(key=lambda item: item.num_tokens > 1)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    adapters_to_load: list[tuple[str, list[int]]] = field(default_factory=list)  # (version, pages) to fill
    adapters_freed: list[str] = field(default_factory=list)   # versions whose pages were freed since last step
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)     # can never fit; finished by the caller
    copies: list[tuple[int, int]] = field(default_factory=list)          # copy-on-write (src, dst) pages
    swap_out: list[tuple[list[int], list[int]]] = field(default_factory=list)  # (pool pages, host swap pages)
    swap_in: list[tuple[list[int], list[int]]] = field(default_factory=list)   # (host swap pages, pool pages)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)


def check_fits(config: SchedulerConfig, num_pages: int, prompt_len: int, adapter_pages: int) -> None:
    """A prompt (and its adapter's pages) that a pool of `num_pages` could ever hold: ValueError if not."""
    pages = -(-(prompt_len + 1) // config.page_size) + adapter_pages
    usable = config.usable_pages(num_pages)
    if pages > usable:
        raise ValueError(f"the request needs {pages} pages but the pool has only {usable} usable")


@dataclass
class Scheduler:
    config: SchedulerConfig
    allocator: PageAllocator
    running: list[Sequence] = field(default_factory=list)
    step_count: int = 0
    num_preemptions: int = 0
    num_swaps: int = 0
    # Pool residency of adapters: the engine's AdapterManager, or a bare one (simulations) when none is
    # given. A request whose adapter is not ready (not in host memory: read back in the background) waits
    # without blocking others.
    adapter_pool: InitVar[AdapterResidency | None] = None

    def __post_init__(self, adapter_pool: AdapterResidency | None) -> None:
        self.adapters = adapter_pool if adapter_pool is not None else AdapterResidency(self.allocator)
        assert self.adapters.allocator is self.allocator, "adapters and KV share one pool"
        self.swap = SwapSpace(self.config.swap_pages)
        config = self.config
        self.share = FairShare(config.prompt_cost, config.output_cost, config.page_size)
        self.waiting: WaitingQueue = waiting_queue(config.scheduling_policy, self.share)
        self._arrivals = itertools.count()

    @property
    def watermark_pages(self) -> int:
        return self.config.watermark_pages(self.allocator.num_pages)

    @property
    def usable_pages(self) -> int:
        """Pages one request (or adapter) may ever get: all but the admission watermark."""
        return self.config.usable_pages(self.allocator.num_pages)

    def check_fits(self, prompt_len: int, adapter: AdapterRef | None) -> None:
        """A prompt (and its adapter) that the pool could ever hold: ValueError if not."""
        check_fits(self.config, self.allocator.num_pages, prompt_len, adapter.num_pages if adapter else 0)

    def check_beams_fit(self, prompt_len: int, width: int, max_tokens: int, adapter: AdapterRef | None) -> None:
        """A beam search whose beams the pool could hold at once, each with its own pages past the prompt's
        (its most): ValueError if not. One that could not would start over whenever it ran out, forever."""
        own_pages = width * (-(-max_tokens // self.config.page_size) + 1)
        check_fits(self.config, self.allocator.num_pages, prompt_len + own_pages * self.config.page_size,
                   adapter.num_pages if adapter else 0)

    def check_priority(self, priority: int) -> None:
        """A priority the policy can honour: ValueError if not."""
        if priority and self.config.scheduling_policy == "fcfs":
            raise ValueError("a request's priority needs the priority or vtc scheduling policy; this engine "
                             "schedules first come, first served")

    def set_weight(self, tenant: str | None, weight: float) -> None:
        """The tenant's share under the vtc policy (ValueError unless positive)."""
        self.share.set_weight(tenant, weight)

    def shares(self) -> dict[str | None, TenantShare]:
        """Each tenant's service so far: what `/metrics` publishes."""
        return self.share.shares()

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue a new sequence. Its prompt's full pages are hashed now, on arrival, and not in the step that
        admits it: a long prompt's hundred hashes would cost that step more host time than its decode rows."""
        if self.config.enable_prefix_caching:
            self._extend_hashes(seq, len(seq.prompt_token_ids))
        seq.status = SequenceStatus.WAITING
        seq.arrival = next(self._arrivals)
        self.waiting.add(seq)

    def restart(self, seq: Sequence, arrival: int) -> None:
        """Queue a sequence at the front in the place of an earlier one that arrived at `arrival` (a beam
        search starting over after a preemption), its prompt already charged to its tenant."""
        if self.config.enable_prefix_caching:
            self._extend_hashes(seq, len(seq.prompt_token_ids))
        seq.status, seq.arrival, seq.num_charged_tokens = SequenceStatus.WAITING, arrival, len(seq.prompt_token_ids)
        self.waiting.requeue(seq)

    # ---- one step -----------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._admit_waiting(out, budget)
        self._prefetch_adapters(out)
        # One-token rows (decodes) first: a mixed step's attention runs them through the decode kernel.
        decodes_first(out.scheduled, self.config.max_num_batched_tokens - budget)
        out.adapters_freed = self.adapters.take_freed()
        # A load whose pages were taken back within this very step would copy into pages others own.
        assert all(v in self.adapters.resident and self.adapters.resident[v].pages == pages
                   for v, pages in out.adapters_to_load), "an adapter was loaded and evicted in one step"
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        generated: dict[str | None, int] = {}        # tokens generated per tenant: charged once per step
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.ends_with_pending(self.config.max_model_len) or seq.num_uncomputed == 0:
                # Its token in flight ends it (a step after it would be wasted), or it is a beam waiting for
                # its group's selection, which gives it its next token.
                index += 1
                continue
            num_tokens = min(seq.num_uncomputed, budget)
            if not self._grow(seq, seq.num_computed_tokens + num_tokens, out):
                continue                    # seq preempted itself: the next one is at `index` now
            if self._charge_prompt(seq, num_tokens):
                generated[seq.tenant] = generated.get(seq.tenant, 0) + 1
            out.scheduled.append(ScheduledSeq(seq, num_tokens))
            budget -= num_tokens
            index += 1
        for tenant, count in generated.items():
            self.share.charge(tenant, 0, count)
        return budget

    def _charge_prompt(self, seq: Sequence, num_tokens: int) -> bool:
        """Charge `seq`'s tenant for the prompt tokens this step computes that were never computed before (a
        recomputation after a preemption is charged to nobody); whether the step generates a token for it, which
        the caller charges. A decode row, most rows of most steps, charges nothing here."""
        end = seq.num_computed_tokens + num_tokens
        charged = seq.num_charged_tokens
        if end > charged:
            seq.num_charged_tokens = end
            prompt_len = len(seq.prompt_token_ids)
            if charged < prompt_len:
                self.share.charge(seq.tenant, min(end, prompt_len) - max(seq.num_computed_tokens, charged), 0)
        return end == seq.num_tokens

    def _reclaim(self, seq: Sequence, out: SchedulerOutput, count: int = 1) -> bool:
        """Make `count` pages available for `seq`; False if `seq` itself had to be preempted."""
        while self.allocator.num_available < count:
            if self.adapters.evict_one_idle():
                continue
            # Only sequences not yet scheduled in this step: `seq` and those after it.
            victim = self.waiting.victim(self.running[self.running.index(seq):])
            self.preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _grow(self, seq: Sequence, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `seq` private pages for `num_tokens` tokens; False if `seq` itself had to be preempted."""
        if not self._copy_shared_tail(seq, out):
            return False
        needed = seq.pages_needed(num_tokens, self.config.page_size)
        if needed == 0:                   # most decode steps of most sequences
            return True
        if not self._reclaim(seq, out, needed):
            return False
        seq.block_table.extend(self.allocator.allocate_kv_pages(needed))      # a chunk takes many at once
        return True

    def _copy_shared_tail(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Copy-on-write: the next token goes into a partial page that forked samples still share."""
        index, offset = divmod(seq.num_computed_tokens, self.config.page_size)
        if offset == 0 or self.allocator.refcount(seq.block_table[index]) == 1:
            return True
        if not self._reclaim(seq, out):
            return False
        shared = seq.block_table[index]
        if self.allocator.refcount(shared) == 1:       # the other holders were preempted meanwhile
            return True
        seq.block_table[index] = self.allocator.allocate_kv()
        out.copies.append((shared, seq.block_table[index]))
        self.allocator.release_kv(shared)
        return True

    # ---- admission ----------------------------------------------------------------------------------
    def _admit_waiting(self, out: SchedulerOutput, budget: int) -> int:
        """Admit waiting requests within `budget` tokens; the budget left."""
        # Full by count alone (a saturated server's every step): no need to walk the running set for seats.
        if budget <= 0 or not self.waiting or len(self.running) >= self.config.max_num_seqs:
            return budget
        skipped: list[Sequence] = []           # taken and not admitted: they go back, keeping their places
        seats = self._seats_taken()
        while self.waiting and budget > 0 and seats < self.config.max_num_seqs:
            seq = self.waiting.pop()
            if seq.adapter is not None and not self.adapters.ready(seq.adapter.version):
                skipped.append(seq)           # its adapter is still loading: others go ahead
                continue
            if not self._within_max_loras(seq):
                skipped.append(seq)           # a new adapter past max_loras: requests of running ones go ahead
                seq.max_loras_waits += 1
                if seq.max_loras_waits > self.config.max_loras_patience:
                    break                     # ...but not forever: everything newer waits behind it now
                continue
            if seats + self._seats(seq) > self.config.max_num_seqs:
                skipped.append(seq)
                break
            matched = self._prefix_match(seq)
            if not self._can_admit(seq, matched):
                if not self.running and not out.scheduled and not skipped:
                    out.rejected.append(seq)   # would wait forever
                    continue
                skipped.append(seq)
                break
            seats += self._seats(seq)
            budget -= self._admit(seq, matched, budget, out)       # pins its adapter: max_loras counts it
        self.waiting.put_back(skipped)
        return budget

    def running_versions(self) -> set[str]:
        """The distinct adapter versions of the running sequences."""
        return {s.adapter.version for s in self.running if s.adapter is not None}

    def _within_max_loras(self, seq: Sequence) -> bool:
        """Whether admitting `seq` keeps max_loras: the running sequences' versions are the pinned ones."""
        limit, adapter = self.config.max_loras, seq.adapter
        if adapter is None or limit is None:
            return True
        return self.adapters.is_pinned(adapter.version) or self.adapters.num_pinned < limit

    def _seats_taken(self) -> int:
        """Places in the running set that its sequences hold, counting the samples or beams of a request still
        in its prompt: they fork once its first token is out, and max_num_seqs bounds them from the start."""
        return sum(map(self._seats, self.running))

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Places in the running set a sequence takes once admitted: all its samples if they are yet to fork."""
        return seq.params.num_samples if seq.sample_index == 0 and not seq.output_token_ids else 1

    def _prefix_match(self, seq: Sequence) -> list[int]:
        """Pages of the prefix cache holding the longest run of this sequence's leading full pages,
        leaving at least one token to compute (its logits are needed)."""
        # A request for prompt logprobs computes its whole prompt: the cache holds no logits.
        if not self.config.enable_prefix_caching or seq.num_computed_tokens or seq.swapped_pages is not None \
                or seq.params.prompt_logprobs is not None:
            return []
        self._extend_hashes(seq, seq.num_tokens - 1)
        matched = []
        for page_hash in seq.page_hashes[:(seq.num_tokens - 1) // self.config.page_size]:
            page = self.allocator.lookup(page_hash)
            if page is None:
                break
            matched.append(page)
        return matched

    def _extend_hashes(self, seq: Sequence, num_tokens: int) -> None:
        page_size, known = self.config.page_size, len(seq.page_hashes)
        if known < num_tokens // page_size:
            version = seq.adapter.version if seq.adapter else None
            new_tokens = seq.token_array(known * page_size, num_tokens)      # the prompt's array, not a list
            seq.page_hashes = extend_hashes(seq.page_hashes, new_tokens, page_size, version, seq.cache_salt)

    def pages_to_admit(self, seq: Sequence, matched: list[int] | None = None) -> int:
        """Pages a waiting sequence needs to be admitted: its tokens not served by the cache, plus its
        adapter if not resident, plus, for a beam search about to fork, a page for each beam's next step:
        admitted without them, groups that all fork at once would take each other's pages and all start over."""
        adapter = seq.adapter
        adapter_pages = adapter.num_pages if adapter and not self.adapters.is_resident(adapter.version) else 0
        beams = self._seats(seq) if seq.params.use_beam_search else 0
        return seq.pages_needed(seq.num_tokens, self.config.page_size) - len(matched or []) + adapter_pages + beams

    def _can_admit(self, seq: Sequence, matched: list[int]) -> bool:
        own = seq.adapter.version if seq.adapter else None
        reused_cached = sum(1 for page in matched if self.allocator.is_cached(page))
        available = self.allocator.num_available - reused_cached + self.adapters.idle_pages(exclude=own)
        return self.pages_to_admit(seq, matched) + self.watermark_pages <= available

    def _admit(self, seq: Sequence, matched: list[int], budget: int, out: SchedulerOutput) -> int:
        # The matched pages leave the cache first: the adapter's pages may evict cached ones.
        if seq.swapped_pages is None:
            self._reuse_prefix(seq, matched)
        if seq.adapter is not None:
            self._make_resident(seq, out)
            self.adapters.pin(seq.adapter.version, self.step_count)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        if seq.swapped_pages is not None:
            self._swap_in(seq, out)
        num_tokens = min(seq.num_uncomputed, budget)
        grown = self._grow(seq, seq.num_computed_tokens + num_tokens, out)
        assert grown, "admission checked that the pages were available"
        self.share.charge(seq.tenant, 0, int(self._charge_prompt(seq, num_tokens)))
        out.scheduled.append(ScheduledSeq(seq, num_tokens))
        return num_tokens

    def _make_resident(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Bring `seq`'s adapter into the pool if it is not there, charged to `seq`'s tenant."""
        assert seq.adapter is not None, "only a sequence with an adapter needs one resident"
        pages = self.adapters.make_resident(seq.adapter, self.step_count)
        if pages is not None:
            out.adapters_to_load.append((seq.adapter.version, pages))
            self.share.charge_adapter(seq.tenant, len(pages))

    def _reuse_prefix(self, seq: Sequence, matched: list[int]) -> None:
        for page in matched:
            self.allocator.reuse(page)
        seq.block_table = BlockTable(matched)
        seq.num_hashed_pages = len(matched)
        seq.num_computed_tokens = len(matched) * self.config.page_size
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _prefetch_adapters(self, out: SchedulerOutput) -> None:
        """Copy the adapters of the next waiting requests into free pages before they are scheduled,
        without evicting anything and without touching the admission watermark."""
        for seq in list(itertools.islice(self.waiting, self.config.prefetch_depth)):   # not the whole queue
            ref = seq.adapter
            if ref is None or self.adapters.is_resident(ref.version) or not self.adapters.ready(ref.version):
                continue
            # The adapters' own allocator: the pool's here, an adapter region of its own in the partitioned
            # pool that benchmarks/memsim.py compares with.
            if self.adapters.allocator.num_free - ref.num_pages < self.watermark_pages + 1:
                break
            self._make_resident(seq, out)

    # ---- after the forward --------------------------------------------------------------------------
    def on_computed(self, seq: Sequence, num_tokens: int) -> None:
        """The forward wrote `num_tokens` more tokens of `seq` into its pages: full pages join the cache."""
        seq.num_computed_tokens += num_tokens
        if not self.config.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.config.page_size
        if full <= seq.num_hashed_pages:
            return
        self._extend_hashes(seq, full * self.config.page_size)
        self.allocator.register_hashes(itertools.islice(seq.block_table, seq.num_hashed_pages, full),
                                       seq.page_hashes[seq.num_hashed_pages:full])
        seq.num_hashed_pages = full

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """`child` starts as a copy of running `parent`, sharing all its pages (copy-on-write)."""
        for page in parent.block_table:
            self.allocator.share_kv(page)
        child.block_table = BlockTable(parent.block_table)
        child.num_computed_tokens, child.num_hashed_pages = parent.num_computed_tokens, parent.num_hashed_pages
        child.page_hashes = list(parent.page_hashes)
        child.arrival, child.num_charged_tokens = parent.arrival, parent.num_charged_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)
        if child.adapter is not None:
            self.adapters.pin(child.adapter.version, self.step_count)

    # ---- preemption and the end of a sequence -------------------------------------------------------
    def preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running sequence's pages (swapping its KV to host memory in swap mode); it goes back
        to the front of the queue."""
        slots = None
        if self.config.preemption_mode == "swap":
            slots = self.swap.allocate(len(seq.block_table))
        if slots is not None:
            out.swap_out.append((seq.block_table.tolist(), slots))
            self.num_swaps += 1
        self._release(seq)
        seq.swapped_pages = slots
        if slots is None:
            seq.num_computed_tokens = 0
        seq.num_hashed_pages = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.requeue(seq)
        self.num_preemptions += 1
        out.preempted.append(seq)

    def _swap_in(self, seq: Sequence, out: SchedulerOutput) -> None:
        slots, seq.swapped_pages = seq.swapped_pages, None
        assert slots is not None, "only a swapped-out sequence is swapped in"
        reclaimed = self._reclaim(seq, out, len(slots))
        assert reclaimed, "admission checked that the pages were available"
        seq.block_table.extend(self.allocator.allocate_kv_pages(len(slots)))
        out.swap_in.append((slots, seq.block_table.tolist()))
        self.swap.release(slots)

    def finish(self, seq: Sequence, reason: str) -> None:
        """End a sequence (running or waiting) and free what it holds."""
        if seq.status is SequenceStatus.RUNNING:
            self._release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.swapped_pages is not None:
            self.swap.release(seq.swapped_pages)
            seq.swapped_pages = None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _release(self, seq: Sequence) -> None:
        self.allocator.release_kv_pages(seq.block_table)
        seq.block_table = BlockTable()
        self.running.remove(seq)
        if seq.adapter is not None:
            self.adapters.unpin(seq.adapter.version, self.step_count)

    def check(self) -> None:
        """The pool's invariants against the block tables and adapters held here."""
        self.allocator.check([s.block_table for s in self.running], self.adapters.page_tables())
        self.adapters.check()
        assert self.adapters.pinned_versions() == self.running_versions(), "pins disagree with the running sequences"
        if self.config.max_loras is not None:
            assert len(self.running_versions()) <= self.config.max_loras, "more adapters running than max_loras"
        assert sum(1 for _ in self.waiting) == len(self.waiting), "the waiting queue miscounts its sequences"
        swapped = sum(len(s.swapped_pages) for s in self.waiting if s.swapped_pages is not None)
        assert swapped + self.swap.num_free == self.swap.num_pages, "swap slots leaked"
