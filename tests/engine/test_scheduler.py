"""The scheduler and page pool on their own, driven by a step-cost function (no model)."""
import pytest

from slora.core.page_pool import OutOfPages, PageAllocator, PageOwner
from slora.core.scheduler import ScheduledSeq, Scheduler, SchedulerConfig, decodes_first
from slora.core.sequence import AdapterRef, Sequence
from slora.core.simulator import SimRequest, simulate
from slora.sampling.params import SamplingParams


def make_scheduler(num_pages: int, **config) -> Scheduler:
    cfg = SchedulerConfig(**{"page_size": 4, "watermark": 0.0, **config})
    return Scheduler(cfg, PageAllocator(num_pages, cfg.page_size))


def checked_cost(out, scheduler) -> float:
    scheduler.check()
    return 1.0


def seq(seq_id: int, prompt_len: int, max_tokens: int = 4, adapter: AdapterRef | None = None) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens), adapter)


def test_requests_join_and_leave_the_batch_every_step():
    scheduler = make_scheduler(64, max_num_seqs=8)
    requests = [SimRequest(5, out_len, arrival=float(i)) for i, out_len in enumerate([1, 6, 3, 8])]
    result = simulate(scheduler, requests, checked_cost)
    assert result.output_tokens == 18
    # the second request was admitted while the first was running, and the batch shrank as they ended
    assert max(result.batch_sizes) >= 2 and result.batch_sizes[-1] == 1
    stats = scheduler.allocator.stats()
    assert stats.kv_pages == 0 and stats.free_pages + stats.cached_pages == 64


def test_bounds_on_sequences_and_batched_tokens():
    scheduler = make_scheduler(256, max_num_seqs=3, max_num_batched_tokens=10)
    for i in range(6):
        scheduler.add(seq(i, 7))
    out = scheduler.schedule()
    assert len(out.scheduled) <= 3 and out.num_batched_tokens <= 10
    # the first prompt takes 7 tokens, the second is chunked into the remaining 3
    assert [s.num_tokens for s in out.scheduled] == [7, 3]
    assert not out.scheduled[1].completes


def test_one_token_rows_come_first_in_the_step():
    """A running sequence's next prompt chunk, then two newly admitted prompts, of one token and of three:
    the one-token row is put first (a mixed step's attention runs its leading one-token rows through the
    decode kernel), the others keep their order."""
    scheduler = make_scheduler(256, max_num_batched_tokens=8)
    scheduler.add(seq(0, 12))
    assert [item.num_tokens for item in scheduler.schedule().scheduled] == [8]
    scheduler.running[0].num_computed_tokens = 8             # as the engine records a computed step
    scheduler.add(seq(1, 1))
    scheduler.add(seq(2, 3))
    out = scheduler.schedule()
    assert [(item.seq.seq_id, item.num_tokens) for item in out.scheduled] == [(1, 1), (0, 4), (2, 3)]


@pytest.mark.parametrize("counts, expected", [
    ([1, 1, 1], [1, 1, 1]),                       # a decode step
    ([1, 1, 7, 3], [1, 1, 7, 3]),                 # prompts admitted last: already in order
    ([7, 1, 1], [1, 1, 7]),                       # a chunk ahead of decodes
    ([1, 3, 1, 4], [1, 1, 3, 4]),                 # a decode between longer rows
    ([2, 1, 2, 2], [1, 2, 2, 2]),                 # the longer rows at the end hold all but one extra token
    ([5], [5]),
    ([], []),
])
def test_decodes_first_orders_rows_stably(counts: list[int], expected: list[int]):
    scheduled = [ScheduledSeq(seq(i, 8), count) for i, count in enumerate(counts)]
    order = {id(item): i for i, item in enumerate(scheduled)}
    decodes_first(scheduled, sum(counts))
    assert [item.num_tokens for item in scheduled] == expected
    longer = [order[id(item)] for item in scheduled if item.num_tokens > 1]
    assert longer == sorted(longer), "the longer rows changed their order"


def test_admission_counts_adapter_pages_and_watermark():
    scheduler = make_scheduler(20, watermark=0.1)        # 2 watermark pages
    adapter = AdapterRef("v1", 10)
    scheduler.add(seq(0, 4 * 8, adapter=adapter))          # 8 KV pages + 10 adapter pages + 2 = 20: fits
    assert len(scheduler.schedule().scheduled) == 1
    scheduler2 = make_scheduler(20, watermark=0.1)
    scheduler2.add(seq(0, 4 * 8 + 1, adapter=adapter))     # 9 KV pages: does not fit, and nothing runs
    out = scheduler2.schedule()
    assert out.scheduled == [] and len(out.rejected) == 1


def test_pages_grow_one_at_a_time():
    scheduler = make_scheduler(64)
    s = seq(0, 4, max_tokens=10)
    scheduler.add(s)
    scheduler.schedule()
    assert len(s.block_table) == 1
    s.num_computed_tokens = 4
    s.output_token_ids.append(0)
    scheduler.schedule()                                    # token 5 needs a second page
    assert len(s.block_table) == 2


def test_idle_adapters_are_evicted_lru_before_preemption():
    scheduler = make_scheduler(30)
    old, new = AdapterRef("old", 8), AdapterRef("new", 8)
    for version in (old, new):
        scheduler.adapters.make_resident(version, step=0 if version is old else 1)
    scheduler.add(seq(0, 4 * 18))                           # needs 18 pages, 14 free: evict "old" only
    out = scheduler.schedule()
    assert out.scheduled and not out.preempted
    assert set(scheduler.adapters.resident) == {"new"}
    assert scheduler.adapters.num_evictions == 1
    # The runner is told, so a copy into "old"'s pages still in flight ends before they are reused.
    assert out.adapters_freed == ["old"]
    assert scheduler.schedule().adapters_freed == []
    scheduler.check()


def test_newest_sequence_is_preempted_and_recomputed():
    scheduler = make_scheduler(6, max_num_seqs=4)
    result = simulate(scheduler, [SimRequest(8, 8), SimRequest(8, 8)], checked_cost)
    assert scheduler.num_preemptions > 0
    assert result.recomputed_tokens > 0
    assert result.output_tokens == 16
    assert scheduler.allocator.stats().kv_pages == 0


def test_step_cost_function_drives_the_clock():
    scheduler = make_scheduler(128)
    result = simulate(scheduler, [SimRequest(4, 3)] * 2, lambda out, s: 0.5 + 0.1 * out.num_batched_tokens)
    assert result.steps == 3
    assert result.elapsed == pytest.approx(3 * 0.5 + 0.1 * (8 + 2 + 2))


def test_pool_check_catches_a_leaked_page():
    scheduler = make_scheduler(8)
    scheduler.allocator.allocate_kv()                       # held by no block table
    with pytest.raises(AssertionError, match="refcount"):
        scheduler.check()


def test_allocator_owner_kinds():
    allocator = PageAllocator(4, 16)
    kv = allocator.allocate_kv()
    pages = allocator.allocate_adapter("v", 2)
    assert allocator.owner(kv) is PageOwner.KV and allocator.owner(pages[0]) is PageOwner.ADAPTER
    stats = allocator.stats()
    assert (stats.free_pages, stats.kv_pages, stats.adapter_pages) == (1, 1, 2)
    allocator.release_adapter(pages)
    allocator.release_kv(kv)
    assert allocator.stats().free_pages == 4


def test_kv_pages_released_in_bulk_free_cache_or_keep_each_page_by_its_references():
    """One release of a table: a page still shared stays live KV with one reference less, a hashed page
    becomes cached KV, the rest go back to the free list; the counts and invariants follow."""
    allocator = PageAllocator(8, 16)
    shared, hashed, plain, plain2 = allocator.allocate_kv_pages(4)
    allocator.share_kv(shared)
    allocator.register_hashes([hashed], [b"h"])
    allocator.release_kv_pages([shared, hashed, plain, plain2])
    assert allocator.owner(shared) is PageOwner.KV and allocator.refcount(shared) == 1
    assert allocator.is_cached(hashed) and allocator.lookup(b"h") == hashed
    assert allocator.owner(plain) is PageOwner.FREE and allocator.owner(plain2) is PageOwner.FREE
    stats = allocator.stats()
    assert (stats.free_pages, stats.kv_pages, stats.cached_pages) == (6, 1, 1)
    allocator.check([[shared]], {})
    with pytest.raises(AssertionError, match="not live KV"):
        allocator.release_kv_pages([plain])


def test_kv_pages_in_bulk_take_free_pages_then_evict_cached_ones_all_or_nothing():
    allocator = PageAllocator(7, 16)
    cached = allocator.allocate_kv_pages(3)
    for page, digest in zip(cached, (b"a", b"b", b"c")):
        allocator.register_hashes([page], [digest])
        allocator.release_kv(page)                           # refcount 0, hashed: kept as cached KV
    allocator.reuse(cached[0])                               # "a" is used again: now the newest cached page
    allocator.release_kv(cached[0])
    assert allocator.stats().cached_pages == 3 and allocator.num_free == 4
    with pytest.raises(OutOfPages, match="8 KV pages asked for, 7 are available"):
        allocator.allocate_kv_pages(8)
    assert allocator.stats().free_pages == 4 and allocator.lookup(b"b") == cached[1]   # nothing taken
    pages = allocator.allocate_kv_pages(6)                   # 4 free, then the two least recently used cached
    assert len(set(pages)) == 6 and {cached[1], cached[2]} <= set(pages)
    assert (allocator.lookup(b"a"), allocator.lookup(b"b"), allocator.lookup(b"c")) == (cached[0], None, None)
    assert allocator.num_cache_evictions == 2
    assert all(allocator.owner(p) is PageOwner.KV and allocator.refcount(p) == 1 for p in pages)
    stats = allocator.stats()
    assert (stats.free_pages, stats.kv_pages, stats.cached_pages) == (0, 6, 1)
    allocator.check([pages], {})


def test_adapter_pages_taken_from_the_cache_go_to_the_adapter_unhashed():
    allocator = PageAllocator(3, 16)
    kv = allocator.allocate_kv_pages(2)
    allocator.register_hashes(kv, [b"a", b"b"])
    allocator.release_kv_pages(kv)                           # both cached, one page free
    pages = allocator.allocate_adapter("v", 2)               # the free page, then the older cached one
    assert pages == [2, kv[0]] and all(allocator.owner(p) is PageOwner.ADAPTER for p in pages)
    assert allocator.num_cache_evictions == 1
    assert (allocator.lookup(b"a"), allocator.lookup(b"b")) == (None, kv[1])
    stats = allocator.stats()
    assert (stats.free_pages, stats.cached_pages, stats.adapter_pages) == (0, 1, 2)
    allocator.check([], {"v": pages})
    allocator.release_adapter(pages)
    assert allocator.stats().free_pages == 2


def test_a_request_of_n_samples_takes_n_running_slots():
    scheduler = make_scheduler(256, max_num_seqs=4)
    scheduler.add(seq(0, 4))
    parent = Sequence(1, "r1", [1] * 4, SamplingParams(max_tokens=4, n=4), None)
    scheduler.add(parent)
    out = scheduler.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0]       # 1 + 4 samples would exceed 4 slots
    assert next(iter(scheduler.waiting)) is parent


def test_requests_still_in_their_prompts_hold_every_seat_of_their_samples():
    """Two requests of n=4 in their prompts hold 8 seats, not 2: a third waits, so that once all fork the
    running set stays within max_num_seqs."""
    scheduler = make_scheduler(256, max_num_seqs=8)
    parents = [Sequence(i, f"r{i}", [1] * 4, SamplingParams(max_tokens=4, n=4), None) for i in range(3)]
    for parent in parents:
        scheduler.add(parent)
    out = scheduler.schedule()
    assert [s.seq.seq_id for s in out.scheduled] == [0, 1]
    assert next(iter(scheduler.waiting)) is parents[2]


@pytest.mark.parametrize("start,end", [(0, 3), (2, 6), (4, 7), (5, 6), (0, 7), (6, 6)])
def test_tokens_between_equals_a_slice_of_all_tokens(start, end):
    s = Sequence(0, "r", [10, 11, 12, 13, 14], SamplingParams(max_tokens=4))
    s.output_token_ids += [20, 21]
    assert s.tokens_between(start, end) == s.token_ids[start:end]


@pytest.mark.parametrize("max_batch", [1, 3, 5, 8, 16, 20, 64, 100])
def test_every_batch_size_has_a_cuda_graph_bucket(max_batch):
    from slora.execution.cuda_graphs import batch_buckets

    buckets = batch_buckets(max_batch)
    assert buckets == sorted(set(buckets)) and buckets[-1] == max_batch
    assert all(any(b >= size for b in buckets) for size in range(1, max_batch + 1))
    # ...and a batch is never padded to more than twice its size (nor past 16 more rows).
    assert all(min(b for b in buckets if b >= size) <= min(2 * size, size + 15) for size in range(1, max_batch + 1))


def test_max_loras_caps_distinct_adapters_in_the_batch_and_others_go_ahead():
    scheduler = make_scheduler(200, max_num_seqs=8, max_loras=2)
    v0, v1, v2 = (AdapterRef(f"v{i}", 2) for i in range(3))
    # v0, v1, v2, then v0 again: the v2 request waits, the later v0 request is admitted before it.
    requests = [SimRequest(4, 3, adapter) for adapter in (v0, v1, v2, v0, None)]
    scheduled: list[list[int]] = []

    def cost(out, scheduler) -> float:
        scheduled.append([item.seq.seq_id for item in out.scheduled])
        assert len(scheduler.running_versions()) <= 2
        return checked_cost(out, scheduler)

    result = simulate(scheduler, requests, cost, max_steps=50)
    assert scheduled[0] == [0, 1, 3, 4]
    assert result.output_tokens == 15 and not scheduler.has_unfinished()   # v2's request ran once a place freed
    assert scheduler.adapters.num_loads == 3


def test_max_loras_does_not_starve_a_request_of_another_adapter():
    """Requests of the running adapter keep arriving; the one request of another adapter still runs."""
    scheduler = make_scheduler(2000, max_num_seqs=4, max_loras=1, max_loras_patience=4)
    busy, other = AdapterRef("busy", 2), AdapterRef("other", 2)
    # "busy" first, "other" just after it, then a new "busy" request every step (one step costs 1).
    requests = [SimRequest(4, 3, busy), SimRequest(4, 3, other, arrival=0.5)]
    requests += [SimRequest(4, 3, busy, arrival=float(step)) for step in range(1, 200)]
    first_step_of_other: list[int] = []

    def cost(out, scheduler) -> float:
        if not first_step_of_other and any(item.seq.seq_id == 1 for item in out.scheduled):
            first_step_of_other.append(scheduler.step_count)
        return checked_cost(out, scheduler)

    simulate(scheduler, requests, cost, max_steps=5000)
    assert first_step_of_other, "the request of the other adapter never ran"
    assert first_step_of_other[0] < 20


def test_idle_adapter_pages_are_counted_through_pins_and_frees():
    scheduler = make_scheduler(100)
    adapters = scheduler.adapters
    for version, pages in (("a", 3), ("b", 5)):
        adapters.make_resident(AdapterRef(version, pages), step=0)
    assert adapters.idle_pages() == 8 and adapters.idle_pages(exclude="b") == 3
    adapters.pin("b", 1)
    assert adapters.idle_pages() == 3 and adapters.idle_pages(exclude="b") == 3
    adapters.retire("b")                                    # in use: freed when its last user ends
    adapters.unpin("b", 2)
    assert "b" not in adapters.resident and adapters.idle_pages() == 3
    assert adapters.evict_one_idle() and adapters.idle_pages() == 0
    adapters.check()


def test_pinned_adapters_are_counted_through_pins_unpins_and_frees():
    """max_loras asks the residency how many versions running sequences use: a count kept by pin and unpin."""
    adapters = make_scheduler(100).adapters
    for version in ("a", "b", "c"):
        adapters.make_resident(AdapterRef(version, 2), step=0)
    adapters.pin("a", 1)
    adapters.pin("a", 1)                                    # a second sequence of "a": still one version
    adapters.pin("b", 1)
    assert adapters.num_pinned == 2 and adapters.pinned_versions() == {"a", "b"}
    assert adapters.is_pinned("a") and not adapters.is_pinned("c") and not adapters.is_pinned("unknown")
    adapters.unpin("a", 2)
    assert adapters.num_pinned == 2                         # "a" keeps one user
    adapters.retire("b")
    adapters.unpin("b", 2)                                  # its last user ends: freed, no longer counted
    adapters.unpin("a", 3)
    assert adapters.num_pinned == 0 and not adapters.is_pinned("b") and "b" not in adapters.resident
    adapters.check()


def run_prompt_to_its_end(scheduler: Scheduler, sequence: Sequence) -> None:
    """Admit `sequence`, compute its whole prompt in one step (its full pages join the cache), and end it."""
    scheduler.add(sequence)
    item = next(item for item in scheduler.schedule().scheduled if item.seq is sequence)
    scheduler.on_computed(sequence, item.num_tokens)
    scheduler.finish(sequence, "length")


def test_an_adapter_loaded_at_admission_keeps_off_the_cached_pages_the_prompt_matched():
    """A prompt whose first two pages are cached, on an adapter evicted since: with one free page and an idle
    adapter beside, the adapter's two pages must come from the idle adapter, not from the cached pages the
    prompt reuses (an adapter page reused as KV: the engine failed on an assertion, or without asserts
    wrote KV over the adapter's weights)."""
    scheduler = make_scheduler(11)
    x, z = AdapterRef("x", 2), AdapterRef("z", 4)
    run_prompt_to_its_end(scheduler, seq(0, 9, adapter=x))     # its two full pages cached, x idle
    run_prompt_to_its_end(scheduler, seq(1, 3, adapter=z))     # z idle, used after x
    assert scheduler.adapters.evict_one_idle() and not scheduler.adapters.is_resident("x")
    scheduler.add(seq(2, 16))                                  # 4 pages: one page is left free
    scheduler.schedule()
    assert scheduler.allocator.num_free == 1 and scheduler.allocator.stats().cached_pages == 2
    again = seq(3, 9, adapter=x)
    scheduler.add(again)
    out = scheduler.schedule()
    assert [item.num_tokens for item in out.scheduled if item.seq is again] == [1]   # 8 tokens from the cache
    prefix = again.block_table.pages[:2]
    assert not set(prefix) & set(scheduler.adapters.resident["x"].pages)
    assert not scheduler.adapters.is_resident("z")             # evicted for x instead
    assert [scheduler.allocator.owner(page) for page in prefix] == [PageOwner.KV] * 2
    scheduler.check()


def test_a_prompt_is_hashed_when_added_and_its_admission_hashes_nothing(monkeypatch):
    """The prompt's full pages are hashed on arrival (10 tokens: two pages of 4); the step that admits it
    and matches them against the cache hashes no page, nor does registering the computed pages."""
    import slora.core.scheduler as scheduler_module

    scheduler = make_scheduler(64)
    first, second = seq(0, 10), seq(1, 10)
    scheduler.add(first)
    assert len(first.page_hashes) == 2
    scheduler.on_computed(scheduler.schedule().scheduled[0].seq, 10)
    hashed = []
    real = scheduler_module.extend_hashes
    monkeypatch.setattr(scheduler_module, "extend_hashes", lambda *a: hashed.append(len(a[1])) or real(*a))
    scheduler.add(second)
    assert hashed == [10] and second.page_hashes == first.page_hashes
    out = scheduler.schedule()
    assert hashed == [10]                                    # admission matched the pages hashed on arrival
    item = next(item for item in out.scheduled if item.seq is second)
    assert second.num_computed_tokens == 8 and item.num_tokens == 2              # both pages from the cache
    scheduler.on_computed(second, item.num_tokens)
    assert hashed == [10]
