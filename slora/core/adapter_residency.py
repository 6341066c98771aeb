"""Which adapter versions are resident in the pool, which are pinned, and LRU eviction of idle ones.

The scheduler asks this for residency; the engine's AdapterManager is one, with names and a host tier.
"""
from dataclasses import dataclass, field

from slora.core.page_pool import OutOfPages, PageAllocator
from slora.core.sequence import AdapterRef


@dataclass
class ResidentAdapter:
    version: str
    pages: list[int]
    pins: int = 0                  # running sequences that use it; pinned while > 0
    last_used: int = 0             # scheduler step of the last pin or unpin, for LRU
    retired: bool = False          # unloaded by the user: freed as soon as it is idle


@dataclass
class AdapterResidency:
    allocator: PageAllocator
    resident: dict[str, ResidentAdapter] = field(default_factory=dict)
    num_loads: int = 0
    num_evictions: int = 0
    # Versions whose pages went back to the pool since the last `take_freed`: a copy into those pages
    # may still be in flight on the GPU's side stream, and the next forward may reuse them.
    freed: list[str] = field(default_factory=list)
    _idle_pages: int = 0              # pages of resident adapters with no pin (see idle_pages)
    _num_pinned: int = 0              # resident adapters with a pin (see num_pinned)

    def is_resident(self, version: str) -> bool:
        return version in self.resident

    def ready(self, version: str) -> bool:
        """Whether the version's weights are at hand to be copied into the pool. Here (simulations, no
        host tier) always; the engine's AdapterManager says whether they are in host memory."""
        return True

    def idle_pages(self, exclude: str | None = None) -> int:
        """Pages of resident adapters that no running sequence uses: reclaimable. Asked for every admission
        candidate, so it is a running count (kept by pin, unpin, make_resident and _free), not a scan."""
        excluded = self.resident.get(exclude) if exclude is not None else None
        return self._idle_pages - (len(excluded.pages) if excluded is not None and excluded.pins == 0 else 0)

    def is_pinned(self, version: str) -> bool:
        """Whether a running sequence uses this version."""
        adapter = self.resident.get(version)
        return adapter is not None and adapter.pins > 0

    @property
    def num_pinned(self) -> int:
        """Distinct versions that running sequences use (max_loras counts them at every admission): a running
        count kept by pin and unpin, not a scan."""
        return self._num_pinned

    def pinned_versions(self) -> set[str]:
        return {v for v, a in self.resident.items() if a.pins > 0}

    def check(self) -> None:
        """The running counts of idle pages and of pinned adapters equal the sums over the adapters."""
        idle = sum(len(a.pages) for a in self.resident.values() if a.pins == 0)
        assert self._idle_pages == idle, f"idle adapter pages counted {self._idle_pages}, actually {idle}"
        pinned = len(self.pinned_versions())
        assert self._num_pinned == pinned, f"pinned adapters counted {self._num_pinned}, actually {pinned}"

    def page_tables(self) -> dict[str, list[int]]:
        return {v: a.pages for v, a in self.resident.items()}

    def make_resident(self, ref: AdapterRef, step: int) -> list[int] | None:
        """Allocate pages for `ref` if it is not resident (evicting idle adapters, LRU first).
        Returns the new pages that must be filled with its weights, or None if already resident."""
        if ref.version in self.resident:
            return None
        while self.allocator.num_available < ref.num_pages:
            if not self.evict_one_idle(exclude=ref.version):
                raise OutOfPages(f"adapter {ref.version[:12]} needs {ref.num_pages} pages")
        pages = self.allocator.allocate_adapter(ref.version, ref.num_pages)
        self.resident[ref.version] = ResidentAdapter(ref.version, pages, last_used=step)
        self._idle_pages += len(pages)
        self.num_loads += 1
        return pages

    def evict_one_idle(self, exclude: str | None = None) -> bool:
        """Free the least recently used idle adapter; False if there is none."""
        idle = [a for v, a in self.resident.items() if a.pins == 0 and v != exclude]
        if not idle:
            return False
        self._free(min(idle, key=lambda a: a.last_used))
        self.num_evictions += 1
        return True

    def pin(self, version: str, step: int) -> None:
        adapter = self.resident[version]
        if adapter.pins == 0:
            self._idle_pages -= len(adapter.pages)
            self._num_pinned += 1
        adapter.pins += 1
        adapter.last_used = step

    def unpin(self, version: str, step: int) -> None:
        adapter = self.resident[version]
        assert adapter.pins > 0, f"adapter {version[:12]} unpinned more often than pinned"
        adapter.pins -= 1
        adapter.last_used = step
        if adapter.pins == 0:
            self._idle_pages += len(adapter.pages)
            self._num_pinned -= 1
        if adapter.pins == 0 and adapter.retired:
            self._free(adapter)

    def retire(self, version: str) -> None:
        """The user unloaded this version: free its pages now if idle, else when the last user ends."""
        adapter = self.resident.get(version)
        if adapter is None:
            return
        adapter.retired = True
        if adapter.pins == 0:
            self._free(adapter)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def _free(self, adapter: ResidentAdapter) -> None:
        assert adapter.pins == 0, f"adapter {adapter.version[:12]} freed while in use"
        self._idle_pages -= len(adapter.pages)
        del self.resident[adapter.version]
        self.allocator.release_adapter(adapter.pages)
        self.freed.append(adapter.version)
