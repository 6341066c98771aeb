"""Adapter versions known to the engine, and the host tier: packed copies in host memory, LRU by bytes.

Tiers (DESIGN §5): registered (on disk) -> host cache (packed in the pool layout) -> resident in the pool.
A version's metadata (descriptor, pages, ranks) stays known while its host copy is dropped; the engine
reads it back from disk in the background when a request needs it again.
"""
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

from slora.adapters.config import AdapterConfig
from slora.adapters.packing import AdapterDescriptor, PackedAdapter
from slora.adapters.weights import WEIGHTS_FILE, LoadedAdapter

ADAPTER_FILES = ("adapter_config.json", WEIGHTS_FILE)


def folder_bytes(path: Path | None) -> int:
    """Bytes on disk of an adapter folder's two files (those present: a vanished file counts nothing)."""
    if path is None:
        return 0
    return sum(file.stat().st_size for file in (path / name for name in ADAPTER_FILES) if file.is_file())


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, validated and packed, not yet registered (safe to make on any thread)."""

    loaded: LoadedAdapter
    packed: PackedAdapter
    path: Path | None
    disk_bytes: int = 0                    # its folder's files, measured when it was read

    @property
    def version(self) -> str:
        return self.loaded.version


@dataclass
class StoredAdapter:
    version: str
    config: AdapterConfig
    descriptor: AdapterDescriptor
    num_pages: int
    num_bytes: int
    weight_bytes: int                      # A and B in the pool's dtype, alignment padding not counted
    path: Path | None                      # where it is read back from after leaving the host cache
    packed: PackedAdapter | None           # None: on disk only
    disk_bytes: int = 0                    # the folder's two files (per-tenant byte quotas)
    owns_files: bool = False               # the engine deletes `path` once the version is dropped
    files_namespace: str | None = None     # with owns_files: whose upload the folder is (its byte quota)
    requests: int = 0                      # live requests on this version
    last_used: int = 0                     # store clock, for LRU
    reload: Future | None = None           # a background read from disk in progress

    @property
    def max_rank(self) -> int:
        return int(self.descriptor.ranks.max())

    @property
    def target_modules(self) -> tuple[str, ...]:
        return self.config.target_modules

    @property
    def tier(self) -> str:
        return "host" if self.packed is not None else "disk"


@dataclass
class AdapterStore:
    """version -> stored adapter. A version is dropped once no name points at it and no request uses it."""

    host_cache_bytes: int = 4 << 30
    versions: dict[str, StoredAdapter] = field(default_factory=dict)
    clock: int = 0
    num_reloads: int = 0

    def add(self, prepared: PreparedAdapter) -> StoredAdapter:
        stored = self.versions.get(prepared.version)
        if stored is None:
            packed = prepared.packed
            weights = sum(w.lora_a.numel() + w.lora_b.numel() for w in prepared.loaded.weights.values())
            stored = StoredAdapter(prepared.version, prepared.loaded.config, packed.descriptor, packed.num_pages,
                                   packed.num_bytes, weights * packed.pages.element_size(), prepared.path, packed,
                                   prepared.disk_bytes)
            self.versions[prepared.version] = stored
        elif stored.packed is None:
            stored.packed = prepared.packed
        self.touch(stored)
        return stored

    def touch(self, stored: StoredAdapter) -> None:
        self.clock += 1
        stored.last_used = self.clock

    def acquire(self, version: str) -> StoredAdapter:
        stored = self.versions[version]
        stored.requests += 1
        self.touch(stored)
        return stored

    def release(self, version: str) -> None:
        stored = self.versions[version]
        assert stored.requests > 0, "adapter released more often than acquired"
        stored.requests -= 1

    def forget_if_unused(self, version: str, named: bool) -> StoredAdapter | None:
        """Drop a version that no name and no request uses; the dropped version, None if it stays."""
        stored = self.versions.get(version)
        if stored is None or stored.requests or named:
            return None
        del self.versions[version]
        return stored

    @property
    def host_bytes(self) -> int:
        return sum(s.num_bytes for s in self.versions.values() if s.packed is not None)

    def trim(self, resident: set[str]) -> None:
        """Drop host copies, least recently used first, until the cache fits its budget. A copy is kept
        while requests wait for it and the pool does not hold it, or when it cannot be read back."""
        excess = self.host_bytes - self.host_cache_bytes
        if excess <= 0:
            return
        droppable = sorted((s for s in self.versions.values() if s.packed is not None and s.path is not None
                            and (s.requests == 0 or s.version in resident)), key=lambda s: s.last_used)
        for stored in droppable:
            if excess <= 0:
                return
            stored.packed = None
            excess -= stored.num_bytes
