"""Host-side bookkeeping of the unified page pool (DESIGN §2). No torch here: the same allocator runs in
the engine and in the simulator. The pool tensor itself lives in the model runner.

Every page is exactly one of: free; KV of live sequences (refcounted); cached KV (refcount 0, kept for
prefix reuse, evictable); adapter weights (owned by one resident adapter version).
"""
import enum
import itertools
from collections import OrderedDict, deque
from collections.abc import Iterable
from dataclasses import dataclass


class PageOwner(enum.Enum):
    FREE = "free"
    KV = "kv"
    CACHED = "cached"
    ADAPTER = "adapter"


class OutOfPages(RuntimeError):
    """Raised when a page is requested and none is free; callers reclaim or preempt first."""


@dataclass(frozen=True)
class PoolStats:
    total_pages: int
    free_pages: int
    kv_pages: int
    cached_pages: int
    adapter_pages: int
    page_size: int

    @property
    def kv_token_capacity(self) -> int:
        """Tokens the pages not holding adapter weights can hold: free, live KV and cached KV."""
        return (self.free_pages + self.kv_pages + self.cached_pages) * self.page_size

    def as_dict(self) -> dict[str, int]:
        return {**self.__dict__, "kv_token_capacity": self.kv_token_capacity}


class PageAllocator:
    """One free list and an owner and refcount per page, shared by KV and adapter weights."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages <= 0:
            raise ValueError(f"the pool needs at least one page, got num_pages={num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free: deque[int] = deque(range(num_pages))
        self._owner = [PageOwner.FREE] * num_pages
        self._counts = {owner: 0 for owner in PageOwner} | {PageOwner.FREE: num_pages}   # kept in step
        self._refcount = [0] * num_pages
        self._adapter_of_page: dict[int, str] = {}
        # Cached KV pages (refcount 0, kept for prefix reuse) in least-recently-used order, oldest first.
        self._cached: OrderedDict[int, None] = OrderedDict()
        # Per page, the hash of the tokens it holds once registered (None: unhashed). A list, not a dict: every
        # page of a prefill chunk is looked up in it when registered, evicted and released.
        self._hash_of_page: list[bytes | None] = [None] * num_pages
        self._page_of_hash: dict[bytes, int] = {}
        self.num_cache_evictions = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_available(self) -> int:
        """Pages that can be handed out now: free ones and cached KV (evicted on demand)."""
        return len(self._free) + len(self._cached)

    def owner(self, page: int) -> PageOwner:
        return self._owner[page]

    def _move(self, pages: list[int], source: PageOwner, target: PageOwner) -> None:
        """Pages that `source` owns go to `target`, and the counts with them."""
        for page in pages:
            self._owner[page] = target
        self._counts[source] -= len(pages)
        self._counts[target] += len(pages)

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def _take_free(self, owner: PageOwner, count: int, what: str) -> list[int]:
        """`count` pages for `owner`: free ones first, then the oldest cached KV, evicted; all or nothing. In
        bulk: a prefill chunk takes dozens of pages in one step."""
        if count > self.num_available:
            raise OutOfPages(f"{count} {what} pages asked for, {self.num_available} are available")
        free = self._free
        pages = [free.popleft() for _ in range(min(count, len(free)))]
        self._move(pages, PageOwner.FREE, owner)
        if len(pages) < count:
            pages += self._evict_cached(count - len(pages), owner)
        return pages

    def _give_back(self, pages: list[int], source: PageOwner) -> None:
        """Unreferenced pages that `source` owns go back to the free list."""
        assert all(self._hash_of_page[page] is None for page in pages), "hashed page freed"
        self._move(pages, source, PageOwner.FREE)
        self._free.extend(pages)

    def allocate_kv(self) -> int:
        """One page for the KV of a live sequence, with refcount 1."""
        return self.allocate_kv_pages(1)[0]

    def allocate_kv_pages(self, count: int) -> list[int]:
        """`count` pages for the KV of a live sequence, each with refcount 1; all or nothing."""
        pages = self._take_free(PageOwner.KV, count, "KV")
        for page in pages:
            self._refcount[page] = 1
        return pages

    def share_kv(self, page: int) -> None:
        """One more block table references `page` (a fork or a prefix hit)."""
        assert self._owner[page] is PageOwner.KV and self._refcount[page] >= 0, f"page {page} is not live KV"
        self._refcount[page] += 1

    def release_kv(self, page: int) -> None:
        """A block table drops `page` (release_kv_pages)."""
        self.release_kv_pages((page,))

    def release_kv_pages(self, pages: Iterable[int]) -> None:
        """A block table drops each of `pages`; the last reference frees a page, or keeps it as cached KV if
        hashed. In bulk: a sequence that ends gives back its whole table, a page per 16 tokens."""
        owner, refcount, hash_of_page = self._owner, self._refcount, self._hash_of_page
        hashed: list[int] = []                        # the pages this release leaves unreferenced, by kind
        unhashed: list[int] = []
        for page in pages:
            assert owner[page] is PageOwner.KV and refcount[page] > 0, f"page {page} is not live KV"
            refcount[page] -= 1
            if refcount[page] == 0:
                (unhashed if hash_of_page[page] is None else hashed).append(page)
        self._move(hashed, PageOwner.KV, PageOwner.CACHED)
        self._cached.update(dict.fromkeys(hashed))
        self._give_back(unhashed, PageOwner.KV)

    # ---- prefix cache -------------------------------------------------------------------------------
    def register_hashes(self, pages: Iterable[int], page_hashes: Iterable[bytes]) -> None:
        """Each page now holds the full page of tokens its hash names; the first page for a hash wins. In
        bulk: a prefill chunk fills dozens of pages."""
        hash_of_page, page_of_hash = self._hash_of_page, self._page_of_hash
        for page, page_hash in zip(pages, page_hashes):
            if hash_of_page[page] is None and page_hash not in page_of_hash:
                hash_of_page[page] = page_hash
                page_of_hash[page_hash] = page

    def lookup(self, page_hash: bytes) -> int | None:
        return self._page_of_hash.get(page_hash)

    def reuse(self, page: int) -> None:
        """Take a hashed page into one more block table: cached pages come back to live KV."""
        if self._owner[page] is PageOwner.CACHED:
            del self._cached[page]
            self._move([page], PageOwner.CACHED, PageOwner.KV)
        self.share_kv(page)

    def is_cached(self, page: int) -> bool:
        return self._owner[page] is PageOwner.CACHED

    def _evict_cached(self, count: int, owner: PageOwner) -> list[int]:
        """The `count` least recently used cached pages, their hashes dropped, handed to `owner` (not through
        the free list). In bulk: once the cache fills the pool, each prefill chunk evicts dozens."""
        cached, hash_of_page, page_of_hash = self._cached, self._hash_of_page, self._page_of_hash
        pages = list(itertools.islice(cached, count))
        for page in pages:
            del cached[page]
            page_hash = hash_of_page[page]
            assert page_hash is not None, f"cached page {page} has no hash"
            del page_of_hash[page_hash]
            hash_of_page[page] = None
        self.num_cache_evictions += count
        self._move(pages, PageOwner.CACHED, owner)
        return pages

    def allocate_adapter(self, version: str, count: int) -> list[int]:
        """`count` pages for the weights of adapter `version`; all or nothing."""
        pages = self._take_free(PageOwner.ADAPTER, count, "adapter")
        for page in pages:
            self._adapter_of_page[page] = version
        return pages

    def release_adapter(self, pages: list[int]) -> None:
        for page in pages:
            assert self._owner[page] is PageOwner.ADAPTER, f"page {page} holds no adapter"
            del self._adapter_of_page[page]
        self._give_back(pages, PageOwner.ADAPTER)

    def stats(self) -> PoolStats:
        """Pages per owner kind, O(1)."""
        counts = self._counts
        return PoolStats(self.num_pages, counts[PageOwner.FREE], counts[PageOwner.KV],
                         counts[PageOwner.CACHED], counts[PageOwner.ADAPTER], self.page_size)

    def check(self, block_tables: Iterable[Iterable[int]], adapter_page_tables: dict[str, list[int]]) -> None:
        """Verify every invariant of the pool against the holders' view; raises AssertionError."""
        expected_refs = [0] * self.num_pages
        for table in block_tables:
            for page in table:
                expected_refs[page] += 1
        adapter_of_page = {p: v for v, pages in adapter_page_tables.items() for p in pages}
        free = set(self._free)
        assert len(free) == len(self._free), "a page is on the free list twice"
        for page in range(self.num_pages):
            self._check_page(page, expected_refs[page], adapter_of_page.get(page), page in free)
        assert all(self._owner[p] is PageOwner.CACHED for p in self._cached), "cached list has a non-cached page"
        hashed = {p: h for p, h in enumerate(self._hash_of_page) if h is not None}
        assert all(self._page_of_hash.get(h) == p for p, h in hashed.items()), "hash maps disagree"
        assert len(self._page_of_hash) == len(hashed), "hash maps disagree"
        assert all(self._owner[p] in (PageOwner.KV, PageOwner.CACHED) for p in hashed), \
            "a hashed page is neither live nor cached KV"
        stats = self.stats()
        recount = {owner: self._owner.count(owner) for owner in PageOwner}
        assert recount == self._counts, f"owner counts drifted: {self._counts} but pages say {recount}"
        assert stats.free_pages == len(self._free), "free list and owners disagree"
        assert stats.free_pages + stats.kv_pages + stats.cached_pages + stats.adapter_pages == self.num_pages

    def _check_page(self, page: int, expected_refs: int, adapter_version: str | None, on_free_list: bool) -> None:
        owner = self._owner[page]
        assert self._refcount[page] == expected_refs, \
            f"page {page}: refcount {self._refcount[page]} but {expected_refs} block tables hold it"
        assert (owner is PageOwner.KV) == (expected_refs > 0), f"page {page} is {owner.value} with {expected_refs} refs"
        assert (owner is PageOwner.ADAPTER) == (adapter_version is not None), \
            f"page {page} is {owner.value} but adapter holder is {adapter_version}"
        if adapter_version is not None:
            assert self._adapter_of_page.get(page) == adapter_version, f"page {page} owned by the wrong adapter"
        assert (owner is PageOwner.FREE) == on_free_list, f"page {page} is {owner.value}, free-list disagrees"
