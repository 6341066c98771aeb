"""The one owner of adapters (DESIGN §5): names, versions and every version's way into the pool.

A version (the content hash of a PEFT folder) goes through one lifecycle:
named -> on disk -> on host (packed in the pool layout, LRU by bytes) -> resident in the pool (pages, pinned
while running sequences use it). One counter, `refs`, keeps a version known: each name that points at it
and each live request on it holds one. At zero the version is dropped: its host copy, its pool pages once
idle, and the folder the engine owns. A version whose host copy was dropped is read back from disk in
the background when a waiting request needs it. The scheduler receives the manager at construction as
its AdapterResidency; the API reaches adapters only through the engine's manager.
"""
import bisect
import dataclasses
import logging
import shutil
import time
from collections.abc import Iterable, Iterator
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from slora.adapters.config import AdapterConfig
from slora.adapters.errors import AdapterError
from slora.adapters.packing import AdapterDescriptor, PackedAdapter, pack_adapter
from slora.adapters.registry import AdapterEntry, AdapterRegistry
from slora.adapters.shapes import TargetShapes
from slora.adapters.sharding import AdapterSharding, shard_adapter
from slora.adapters.weights import WEIGHTS_FILE, LoadedAdapter, load_adapter
from slora.core.adapter_residency import AdapterResidency
from slora.core.outputs import ADAPTER_LOAD_BUCKETS, AdapterName, AdapterPlacement, DurationCounts
from slora.core.page_pool import PageAllocator
from slora.core.sequence import AdapterRef, Sequence

logger = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", WEIGHTS_FILE)


class UnknownAdapterError(ValueError):
    """The request names an adapter that does not exist or that the caller may not use."""


def folder_bytes(path: Path | None) -> int:
    """Bytes on disk of an adapter folder's two files (those present: a vanished file counts nothing)."""
    if path is None:
        return 0
    return sum(file.stat().st_size for file in (path / name for name in ADAPTER_FILES) if file.is_file())


@dataclass(frozen=True)
class AdapterFormat:
    """How this engine reads and packs adapters: its model's layout and its pool's page."""

    shapes: TargetShapes
    max_lora_rank: int
    page_elems: int
    dtype: torch.dtype
    pin_memory: bool = False          # CUDA: pinned host copies, so copies into the pool run asynchronously
    # Under tensor parallelism: how each rank's part is cut and laid out (`shapes` stays the whole model's,
    # which adapters are checked against).
    sharding: AdapterSharding | None = None


@dataclass(frozen=True)
class PreparedAdapter:
    """An adapter read, validated and packed, not yet registered (safe to make on any thread)."""

    loaded: LoadedAdapter
    packed: PackedAdapter
    path: Path | None
    disk_bytes: int = 0                    # its folder's files, measured when it was read
    seconds: float = 0.0                   # the time it took to read, validate, hash and pack

    @property
    def version(self) -> str:
        return self.loaded.version


@dataclass
class AdapterVersion:
    """What the engine knows of one version, on every tier."""

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
    used_by: set[str | None] = dataclasses.field(default_factory=set)   # namespaces that ran or first loaded it
    refs: int = 0                          # names pointing at it + live requests on it
    requests: int = 0                      # of refs, the live requests
    last_used: int = 0                     # host-cache clock, for LRU
    reload: Future | None = None           # a background read from disk in progress

    @property
    def max_rank(self) -> int:
        return int(self.descriptor.ranks.max())

    @property
    def tier(self) -> str:
        return "host" if self.packed is not None else "disk"


class AdapterInfo(NamedTuple):
    """One named adapter as the admin routes list it."""

    name: str
    version: str
    owner: str | None
    public: bool
    residency: str                         # "pool", "host" or "disk"
    rank: int
    target_modules: tuple[str, ...]
    pages: int
    bytes: int


@dataclass
class LoadTimes:
    """How long the versions brought into host memory took to read, validate, hash and pack, bucketed (engine
    thread only: a version is counted as it is stored)."""

    bounds: tuple[float, ...] = ADAPTER_LOAD_BUCKETS
    counts: list[int] = dataclasses.field(default_factory=lambda: [0] * (len(ADAPTER_LOAD_BUCKETS) + 1))
    total: float = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1    # bucket i holds those <= bounds[i]
        self.total += seconds

    def counted(self) -> DurationCounts:
        return DurationCounts(self.bounds, tuple(self.counts), self.total)


def sequence_adapters(seqs: Iterable[Sequence]) -> frozenset[tuple[str | None, str]]:
    """(tenant, adapter version) of the sequences that run on an adapter."""
    return frozenset((seq.tenant, seq.adapter.version) for seq in seqs if seq.adapter is not None)


class AdapterCounts(NamedTuple):
    names: int
    on_host: int
    in_pool: int
    pool_loads: int
    pool_evictions: int
    reloads: int


@contextmanager
def _removed_if_refused(folder: Path | None, owns_files: bool) -> Iterator[None]:
    """An owned folder whose adapter is refused is deleted: nothing would ever read it again."""
    try:
        yield
    except Exception:
        if owns_files:
            _remove_folder(folder)
        raise


def _remove_folder(folder: Path | None) -> None:
    """Delete an adapter folder the engine owns; one already gone is fine."""
    if folder is not None:
        shutil.rmtree(folder, ignore_errors=True)
        logger.info("adapter folder %s deleted", folder)


def _packed(loaded: LoadedAdapter, fmt: AdapterFormat) -> PackedAdapter:
    """The adapter in the pool's layout; under tensor parallelism every rank's part, in the same layout."""
    sharding = fmt.sharding
    if sharding is None:
        return pack_adapter(loaded, fmt.shapes, fmt.page_elems, fmt.dtype)
    first, *others = (pack_adapter(shard_adapter(loaded, rank, sharding), sharding.shapes, fmt.page_elems, fmt.dtype)
                      for rank in range(sharding.size))
    return dataclasses.replace(first, rank_pages=tuple(part.pages for part in others))


class AdapterManager(AdapterResidency):
    """Names per tenant namespace, versions, the host tier and (as the AdapterResidency the scheduler
    asks) pool residency of every adapter."""

    def __init__(self, allocator: PageAllocator, adapter_format: AdapterFormat, host_cache_bytes: int,
                 usable_pages: int) -> None:
        super().__init__(allocator)
        self.format, self.host_cache_bytes, self.usable_pages = adapter_format, host_cache_bytes, usable_pages
        self.names = AdapterRegistry()
        self.versions: dict[str, AdapterVersion] = {}
        self.num_reloads = 0
        self.load_times = LoadTimes()
        self._clock = 0
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="slora-adapter-reader")
        self._reloading: dict[str, AdapterVersion] = {}

    # ---- loading ------------------------------------------------------------------------------------
    def prepare(self, path: str | Path) -> PreparedAdapter:
        """Read, validate, hash and pack a PEFT folder. Reads only immutable settings, so it may run on any
        thread. Raises AdapterError naming the field, or the file that could not be read."""
        try:
            return self._prepare(Path(path))
        except OSError as exc:                # e.g. a file removed or unreadable while it was read
            raise AdapterError(f"the adapter files could not be read: {exc.strerror or exc}") from None

    def _prepare(self, path: Path) -> PreparedAdapter:
        fmt = self.format
        began = time.perf_counter()
        loaded = load_adapter(path, fmt.shapes, fmt.max_lora_rank)
        packed = _packed(loaded, fmt)
        if fmt.pin_memory:
            packed = dataclasses.replace(packed, pages=packed.pages.pin_memory(),
                                         rank_pages=tuple(pages.pin_memory() for pages in packed.rank_pages))
        return PreparedAdapter(loaded, packed, path, folder_bytes(path), time.perf_counter() - began)

    def load(self, name: str, path: str | Path, owner: str | None = None, public: bool = False,
             owns_files: bool = False) -> AdapterEntry:
        """Validate and pack a PEFT folder and register it under `name`. Raises AdapterError."""
        with _removed_if_refused(Path(path), owns_files):
            prepared = self.prepare(path)
        return self.register(name, prepared, owner, public, owns_files)

    def load_demos(self, adapters: dict[str, Path]) -> None:
        """A built-in model's public demo adapters, except those this configuration cannot take (logged)."""
        for name, path in adapters.items():
            try:
                self.load(name, path, public=True)
            except AdapterError as exc:
                logger.warning("demo adapter %s not loaded: %s", name, exc)

    def register(self, name: str, prepared: PreparedAdapter, owner: str | None = None, public: bool = False,
                 owns_files: bool = False) -> AdapterEntry:
        """Make a prepared adapter known under `name` (engine thread). Requests that resolved a version this
        name pointed at before keep it until they finish. owns_files: its folder (prepared.path) is the
        engine's from this call on, deleted once the version is dropped, or at once if it is refused."""
        with _removed_if_refused(prepared.path, owns_files):
            self._check_registrable(name, prepared)
        fresh = prepared.version not in self.versions
        stored = self._store(prepared)
        if fresh:       # loaded first by this namespace: what becomes of it is its own doing
            stored.used_by.add(owner)
        self._take_folder(stored, prepared.path, owns_files, owner)
        entry = AdapterEntry(name, prepared.version, owner, public)
        stored.refs += 1
        replaced = self.names.register(entry)
        if replaced is not None:
            self._unref(replaced.version)
        self._trim_host_cache()
        logger.info("adapter %s loaded as version %s (%d pages)", name, prepared.version[:12],
                    prepared.packed.num_pages)
        return entry

    def unload(self, name: str, owner: str | None = None) -> None:
        """Forget the name; running requests on it finish, then its pages are freed."""
        entry = self.names.unregister(name, owner)
        if entry is None:
            raise UnknownAdapterError(f"adapter {name!r} does not exist")
        self._unref(entry.version)

    def _check_registrable(self, name: str, prepared: PreparedAdapter) -> None:
        if not name or not isinstance(name, str):
            raise AdapterError("adapter name must be a non-empty string")
        if prepared.packed.num_pages >= self.usable_pages:
            raise AdapterError(f"adapter needs {prepared.packed.num_pages} pages but the pool has only "
                               f"{self.usable_pages} usable")

    def _store(self, prepared: PreparedAdapter) -> AdapterVersion:
        stored = self.versions.get(prepared.version)
        if stored is None:
            packed = prepared.packed
            weights = sum(w.lora_a.numel() + w.lora_b.numel() for w in prepared.loaded.weights.values())
            stored = AdapterVersion(prepared.version, prepared.loaded.config, packed.descriptor, packed.num_pages,
                                    packed.num_bytes, weights * packed.pages.element_size(), prepared.path, packed,
                                    prepared.disk_bytes)
            self.versions[prepared.version] = stored
            self.load_times.observe(prepared.seconds)
        elif stored.packed is None:
            stored.packed = prepared.packed
            self.load_times.observe(prepared.seconds)
        self._touch(stored)
        return stored

    def _take_folder(self, stored: AdapterVersion, folder: Path | None, owns_files: bool,
                     namespace: str | None) -> None:
        """Take over an owned folder, the upload of `namespace`. A version is read back from one owned folder
        once it has one: another folder of the same content (the same upload made twice) is never read and
        goes at once. A version known so far from a folder the engine does not own (a path load) is read back
        from the upload from now on, whose files cannot change under it."""
        if not owns_files or folder is None:
            return
        if stored.owns_files and stored.path is not None and stored.path.resolve() != folder.resolve():
            _remove_folder(folder)
        elif not stored.owns_files:
            stored.path, stored.owns_files, stored.files_namespace = folder, True, namespace

    def read_back_from(self, version: str, folder: Path) -> None:
        """Read the version back from `folder`, a folder of the same content, from now on: the one it was
        registered from may be gone (a cluster's replica, whose upload was unloaded and made again). A version
        read back from a folder of the engine's own keeps it; an unknown version is ignored."""
        stored = self.versions.get(version)
        if stored is not None and not stored.owns_files:
            stored.path = folder

    # ---- requests -----------------------------------------------------------------------------------
    def resolve(self, name: str, owner: str | None) -> AdapterRef:
        """The version a request on `name` runs: the caller's own adapter of that name, else a public one."""
        entry = self.names.resolve(name, owner)
        if entry is None:
            raise UnknownAdapterError(f"adapter {name!r} does not exist")
        stored = self.versions[entry.version]
        stored.used_by.add(owner)
        return AdapterRef(entry.version, stored.num_pages)

    def acquire(self, version: str) -> None:
        """A request on `version` starts: the version stays known until it is released."""
        stored = self.versions[version]
        stored.refs += 1
        stored.requests += 1
        self._touch(stored)

    def release(self, version: str) -> None:
        stored = self.versions[version]
        assert stored.requests > 0, "adapter released more often than acquired"
        stored.requests -= 1
        self._unref(version)

    def _unref(self, version: str) -> None:
        """Drop a version nothing holds: from the host cache, from the pool once idle, and the folder the
        engine owns, unless another known version is read back from the same folder."""
        stored = self.versions[version]
        stored.refs -= 1
        assert stored.refs >= 0, "adapter version unreferenced more often than referenced"
        if stored.refs:
            return
        del self.versions[version]
        self.retire(version)
        if stored.owns_files and all(s.path != stored.path for s in self.versions.values()):
            _remove_folder(stored.path)

    # ---- the host tier ------------------------------------------------------------------------------
    def ready(self, version: str) -> bool:
        """Whether the version can be scheduled now: in the pool, or packed in host memory."""
        return self.is_resident(version) or self.versions[version].packed is not None

    def refresh(self, waiting: Iterable[Sequence]) -> list[tuple[str, str]]:
        """Finish background reads from disk, and start those that these waiting sequences need. Returns
        (version, why) of the versions that could not be read back: their waiting requests must fail."""
        failed = []
        for version, stored in list(self._reloading.items()):
            if stored.reload is not None and stored.reload.done():
                del self._reloading[version]
                reason = self._finish_reload(stored)
                if reason is not None:
                    failed.append((version, reason))
        for seq in waiting:
            if seq.adapter is not None and not self.ready(seq.adapter.version):
                self._start_reload(self.versions[seq.adapter.version])
        return failed

    def wait_for_reads(self, timeout_s: float) -> None:
        """Until a background read from disk ends, for at most `timeout_s`; at once if none is in progress."""
        reads = [stored.reload for stored in self._reloading.values() if stored.reload is not None]
        if reads:
            futures.wait(reads, timeout=timeout_s, return_when=futures.FIRST_COMPLETED)

    def _start_reload(self, stored: AdapterVersion) -> None:
        if stored.reload is None:
            assert stored.path is not None, "_trim_host_cache drops only host copies that can be read back"
            logger.info("reading adapter %s back from disk", stored.version[:12])
            stored.reload = self._reader.submit(self.prepare, stored.path)
            self._reloading[stored.version] = stored

    def _finish_reload(self, stored: AdapterVersion) -> str | None:
        """Take a finished read; why it could not be used, or None."""
        future, stored.reload = stored.reload, None
        assert future is not None, "refresh finishes only reads in progress"
        if self.versions.get(stored.version) is not stored:
            return None     # dropped while it was read (its requests were aborted): kept, it would never leave
        prepared, reason = self._reloaded(stored.version, future)
        if prepared is not None:
            self._store(prepared)
            self.num_reloads += 1
            self._trim_host_cache()
        return reason

    @staticmethod
    def _reloaded(version: str, future: Future) -> tuple[PreparedAdapter | None, str | None]:
        """The version read back from disk, or why not. Any exception counts: the files are the tenant's,
        and whatever they hold must not stop the engine."""
        try:
            prepared = future.result()
        except AdapterError as exc:
            return None, f"its files on disk are no longer valid: {exc}"
        except Exception:
            logger.exception("adapter version %s could not be read back from disk", version[:12])
            return None, "its files on disk could not be read"
        if prepared.version != version:
            return None, "its files changed on disk since it was loaded"
        return prepared, None

    def _touch(self, stored: AdapterVersion) -> None:
        self._clock += 1
        stored.last_used = self._clock

    @property
    def host_bytes(self) -> int:
        return sum(s.num_bytes for s in self.versions.values() if s.packed is not None)

    def _trim_host_cache(self) -> None:
        """Drop host copies, least recently used first, until the cache fits its budget. A copy is kept
        while requests wait for it and the pool does not hold it, or when it cannot be read back."""
        excess = self.host_bytes - self.host_cache_bytes
        droppable = sorted((s for s in self.versions.values() if s.packed is not None and s.path is not None
                            and (s.requests == 0 or self.is_resident(s.version))), key=lambda s: s.last_used)
        for stored in droppable:
            if excess <= 0:
                return
            stored.packed = None
            excess -= stored.num_bytes

    # ---- what the step and the API read -------------------------------------------------------------
    def step_adapters(self, versions: Iterable[str]) -> dict[str, tuple[AdapterDescriptor, list[int]]]:
        """version -> (where its weights lie in its buffer, its pages in the pool), for a step's versions."""
        return {v: (self.versions[v].descriptor, self.resident[v].pages) for v in versions}

    def packed(self, versions: Iterable[str]) -> dict[str, PackedAdapter]:
        """The host copies of versions being copied into the pool (ready ones, so present)."""
        copies = {}
        for version in versions:
            packed = self.versions[version].packed
            assert packed is not None, "a version loaded into the pool from no host copy"
            copies[version] = packed
        return copies

    def weight_bytes(self, version: str) -> int:
        """Bytes of a version's A and B in the pool's dtype (padding not counted): what a decode step reads."""
        return self.versions[version].weight_bytes

    def lookup(self, name: str, namespace: str | None) -> AdapterEntry | None:
        """The entry a request of `namespace` on `name` gets: its own, else a public one."""
        return self.names.resolve(name, namespace)

    def named(self, name: str, namespace: str | None) -> AdapterEntry | None:
        """The entry of exactly this namespace and name."""
        return self.names.get(name, namespace)

    def visible_to(self, namespace: str | None) -> list[AdapterEntry]:
        """The namespace's own entries and the public ones."""
        return self.names.visible_to(namespace)

    def all_entries(self) -> list[AdapterEntry]:
        return list(self.names.entries.values())

    def names_in(self, namespace: str | None) -> int:
        return len(self.names.owned_by(namespace))

    def describe(self, entry: AdapterEntry, viewer: str | None = None, isolated: bool = False) -> AdapterInfo:
        """The entry as `viewer`'s namespace sees it. isolated: a version the viewer neither loaded first nor
        ran shows the residency a fresh load has, so that its true residency (another tenant's use of the same
        weights) is not told."""
        stored = self.versions[entry.version]
        if isolated and viewer not in stored.used_by:
            residency = "host" if stored.num_bytes <= self.host_cache_bytes else "disk"
        else:
            residency = "pool" if self.is_resident(entry.version) else stored.tier
        return AdapterInfo(entry.name, entry.version, entry.owner, entry.public, residency, stored.max_rank,
                           stored.config.target_modules, stored.num_pages, stored.num_bytes)

    def source_folder(self, version: str) -> Path | None:
        """The folder a version is read back from (an upload's owned folder once it has one)."""
        return self.versions[version].path

    def disk_bytes(self, namespace: str | None) -> int:
        """Bytes on disk of the adapter folders behind the names in `namespace`, and of its uploads whose
        folders are still on disk (a replaced or unloaded upload stays until its last request ends), each
        version counted once."""
        named = {entry.version for entry in self.names.owned_by(namespace)}
        uploaded = {version for version, stored in self.versions.items()
                    if stored.owns_files and stored.files_namespace == namespace}
        return sum(self.versions[version].disk_bytes for version in named | uploaded)

    def replaced_bytes(self, namespace: str | None, name: str) -> int:
        """Bytes the namespace stops holding when `name` points at another version: its version's files,
        unless another of its names points at the same version or a running request still uses it (an
        upload's folder then stays on disk, and counts, until that request ends)."""
        entry = self.names.get(name, namespace)
        if entry is None or any(other.version == entry.version and other.name != name
                                for other in self.names.owned_by(namespace)):
            return 0
        stored = self.versions[entry.version]
        return 0 if stored.requests else stored.disk_bytes

    def placements(self, in_use: Iterable[str]) -> dict[str, AdapterPlacement]:
        """Where each version in the pool, in host memory or in `in_use` (those of live sequences) is, with its
        names: what the router series of /metrics show. One pass over the names, so a scrape never lists
        registered names that nothing holds."""
        shown = {v for v, s in self.versions.items() if s.packed is not None} | set(self.resident) | set(in_use)
        names = self._names_of(shown) if shown else {}
        return {version: self._placement(version, tuple(names.get(version, ()))) for version in shown}

    def _names_of(self, versions: set[str]) -> dict[str, list[AdapterName]]:
        names: dict[str, list[AdapterName]] = {}
        for entry in self.names.entries.values():
            if entry.version in versions:
                names.setdefault(entry.version, []).append(AdapterName(entry.name, entry.owner, entry.public))
        return names

    def _placement(self, version: str, names: tuple[AdapterName, ...]) -> AdapterPlacement:
        # A version dropped while its last sequences run stays in the pool until they end, known to no name.
        stored = self.versions.get(version)
        on_host = stored is not None and stored.packed is not None
        used_by = frozenset(stored.used_by) if stored is not None else frozenset()
        return AdapterPlacement(self.is_resident(version), on_host, self.is_pinned(version), names, used_by)

    def counts(self) -> AdapterCounts:
        return AdapterCounts(len(self.names.entries), sum(1 for s in self.versions.values() if s.packed is not None),
                             len(self.resident), self.num_loads, self.num_evictions, self.num_reloads)
