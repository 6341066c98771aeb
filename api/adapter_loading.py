"""Adapter loading split in two, so that the slow part never stalls the engine loop: the engine's
`prepare_adapter` (read, validate, hash, pack) runs on a worker thread, and its `register_adapter` (a few
dictionary updates) on the engine thread between two steps."""
from pathlib import Path

from slora.adapter_store import PreparedAdapter
from slora.adapters.registry import AdapterEntry
from slora.engine import Engine

__all__ = ["PreparedAdapter", "prepare_adapter", "register_prepared"]


def prepare_adapter(engine: Engine, path: str | Path) -> PreparedAdapter:
    """Read, validate and pack (any thread). Raises AdapterError naming the field."""
    return engine.prepare_adapter(path)


def register_prepared(engine: Engine, name: str, prepared: PreparedAdapter, owner: str | None = None,
                      public: bool = False) -> AdapterEntry:
    """Register a prepared adapter under `name` (engine thread only)."""
    return engine.register_adapter(name, prepared, owner, public)
