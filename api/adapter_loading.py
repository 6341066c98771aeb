"""Adapter loading split in two, so that the slow part never stalls the engine loop:

- `prepare_adapter` reads, validates, hashes and packs the PEFT folder. It runs on a worker thread and
  reads only the engine's immutable configuration (target shapes, max rank, page layout, dtype).
- `register_prepared` makes it known to the engine: a few dictionary updates, run on the engine thread
  between two steps.

Together they do what `Engine.load_adapter` does in one call (that method stays the reference; the API
tests check that both give the same engine state). If the engine grows its own prepare/register pair,
this module should become two calls to it.
"""
from dataclasses import dataclass
from pathlib import Path

from slora.adapters.errors import AdapterError
from slora.adapters.packing import PackedAdapter, pack_adapter
from slora.adapters.registry import AdapterEntry
from slora.adapters.weights import LoadedAdapter, load_adapter
from slora.engine import Engine


@dataclass(frozen=True)
class PreparedAdapter:
    loaded: LoadedAdapter
    packed: PackedAdapter

    @property
    def version(self) -> str:
        return self.loaded.version


def prepare_adapter(engine: Engine, path: str | Path) -> PreparedAdapter:
    """Read, validate and pack (any thread). Raises AdapterError naming the field."""
    loaded = load_adapter(path, engine.shapes, engine.config.max_lora_rank)
    packed = pack_adapter(loaded, engine.shapes, engine.runner.shape.page_elems, engine.config.torch_dtype)
    return PreparedAdapter(loaded, packed)


def register_prepared(engine: Engine, name: str, prepared: PreparedAdapter, owner: str | None = None,
                      public: bool = False) -> AdapterEntry:
    """Register a prepared adapter under `name` (engine thread only). A version that a name pointed at
    before stays in use by the requests that resolved it, and is dropped once they are done."""
    if not name or not isinstance(name, str):
        raise AdapterError("adapter name must be a non-empty string")
    scheduler = engine.scheduler
    usable = scheduler.allocator.num_pages - scheduler.watermark_pages
    if prepared.packed.num_pages >= usable:
        raise AdapterError(f"adapter needs {prepared.packed.num_pages} pages but the pool has only {usable} usable")
    engine.store.add(prepared.loaded, prepared.packed)
    entry = AdapterEntry(name, prepared.version, owner, public)
    engine.registry.register(entry)
    # The replaced version (if any) is freed now when no request uses it, as Engine.load_adapter does.
    for version in engine.store.collect(engine.registry.versions_in_use()):
        scheduler.adapters.retire(version)
    return entry
