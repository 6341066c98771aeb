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
    already resolved the old version keep it (they hold the version, not the name). Lookups on the
    request path are O(1), public entries by name included. The AdapterManager, which holds it, counts
    the names that point at each version."""

    entries: dict[tuple[str | None, str], AdapterEntry] = field(default_factory=dict)
    _public: dict[str, AdapterEntry] = field(default_factory=dict, repr=False)

    def register(self, entry: AdapterEntry) -> AdapterEntry | None:
        """Add or replace; returns the entry it replaced, if any."""
        previous = self.unregister(entry.name, entry.owner)
        self.entries[(entry.owner, entry.name)] = entry
        if entry.public:
            self._public[entry.name] = entry
        return previous

    def unregister(self, name: str, owner: str | None = None) -> AdapterEntry | None:
        entry = self.entries.pop((owner, name), None)
        if entry is None:
            return None
        if self._public.get(name) is entry:
            del self._public[name]
            other = next((e for (_, n), e in self.entries.items() if n == name and e.public), None)
            if other is not None:                 # another namespace publishes the same name
                self._public[name] = other
        return entry

    def resolve(self, name: str, owner: str | None = None) -> AdapterEntry | None:
        """The caller's own adapter of that name, else a public one; None if neither exists."""
        return self.entries.get((owner, name)) or self._public.get(name)

    def get(self, name: str, owner: str | None = None) -> AdapterEntry | None:
        """The entry of exactly this namespace and name."""
        return self.entries.get((owner, name))

    def owned_by(self, owner: str | None) -> list[AdapterEntry]:
        return [e for (o, _), e in self.entries.items() if o == owner]

    def visible_to(self, owner: str | None) -> list[AdapterEntry]:
        return [e for (o, _), e in self.entries.items() if o == owner or e.public]
