"""Names of adapters, per namespace (tenant), mapped to immutable content-hashed versions."""
from dataclasses import dataclass, field


@dataclass(frozen=True)
class AdapterEntry:
    name: str
    version: str
    owner: str | None = None        # tenant that loaded it; None in single-user mode
    public: bool = False


@dataclass
class AdapterRegistry:
    """`(namespace, name) -> entry`. Re-registering a name points it at a new version; requests that
    already resolved the old version keep it (they hold the version, not the name)."""

    entries: dict[tuple[str | None, str], AdapterEntry] = field(default_factory=dict)

    def register(self, entry: AdapterEntry) -> AdapterEntry | None:
        """Add or replace; returns the entry it replaced, if any."""
        key = (entry.owner, entry.name)
        previous = self.entries.get(key)
        self.entries[key] = entry
        return previous

    def unregister(self, name: str, owner: str | None = None) -> AdapterEntry | None:
        return self.entries.pop((owner, name), None)

    def resolve(self, name: str, owner: str | None = None) -> AdapterEntry | None:
        """The caller's own adapter of that name, else a public one; None if neither exists."""
        own = self.entries.get((owner, name))
        if own is not None:
            return own
        return next((e for (_, n), e in self.entries.items() if n == name and e.public), None)

    def versions_in_use(self) -> set[str]:
        return {e.version for e in self.entries.values()}

    def visible_to(self, owner: str | None) -> list[AdapterEntry]:
        return [e for (o, _), e in self.entries.items() if o == owner or e.public]
