"""Adapter versions known to the engine: host-cache copies in pool layout and who still uses them."""
from dataclasses import dataclass, field

from slora.adapters.packing import PackedAdapter
from slora.adapters.weights import LoadedAdapter


@dataclass
class StoredAdapter:
    loaded: LoadedAdapter
    packed: PackedAdapter
    requests: int = 0           # live requests on this version


@dataclass
class AdapterStore:
    """version -> stored adapter. A version is dropped once no name points at it and no request uses it."""

    versions: dict[str, StoredAdapter] = field(default_factory=dict)

    def add(self, loaded: LoadedAdapter, packed: PackedAdapter) -> None:
        self.versions.setdefault(loaded.version, StoredAdapter(loaded, packed))

    def acquire(self, version: str) -> StoredAdapter:
        stored = self.versions[version]
        stored.requests += 1
        return stored

    def release(self, version: str) -> None:
        stored = self.versions[version]
        assert stored.requests > 0, "adapter released more often than acquired"
        stored.requests -= 1

    def collect(self, named_versions: set[str]) -> list[str]:
        """Forget versions no name and no request uses; returns them (their pool pages must go too)."""
        dead = [v for v, s in self.versions.items() if s.requests == 0 and v not in named_versions]
        for version in dead:
            del self.versions[version]
        return dead
