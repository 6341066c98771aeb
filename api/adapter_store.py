"""The adapter store: every adapter loaded through the API, kept on disk so that a restart serves it again.

    <store>/lock             held (fcntl.flock) by the one server using the store
    <store>/registry.json    name, owner, public flag, version and loaded_at of each adapter, and where its
                             files are: an upload's folder in the store, or a path load's folder inside the
                             adapter root (recorded, not copied)
    <store>/uploads/<namespace>/<name>-<hex>/   an upload's two PEFT files

Path loads are recorded by their path inside the adapter root, not copied: the engine reads them back from
that folder while it runs anyway, a copy would count their bytes twice on disk, and a folder that changed or
vanished meanwhile is then reported (and dropped) at restore, as it is reported while the server runs.

The registry is replaced atomically (a temporary file in the same folder, fsync, os.replace), so a crash
leaves the old registry or the new one. What no entry names at start (upload folders of a crash mid-upload,
temporary registry files, the per-run `slora-uploads-*` folders of earlier servers) is removed then.
"""
import contextlib
import fcntl
import json
import logging
import os
import shutil
import tempfile
import threading
import uuid
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

logger = logging.getLogger(__name__)

REGISTRY = "registry.json"
LOCK = "lock"
UPLOADS = "uploads"
LOCAL_NAMESPACE = "_local"          # the uploads of single-user mode; no tenant id starts with '_'
FORMAT = 1
OLD_UPLOAD_PREFIX = "slora-uploads-"  # the per-run upload folders of servers before the store
_TEMP_PREFIX = f".{REGISTRY}.tmp-"


class StoreError(ValueError):
    """The store cannot be used: held by another server, unreadable, or its registry is not valid."""


def utc_now() -> str:
    """Now, as loaded_at shows it: ISO 8601 in UTC, to the millisecond."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


@dataclass(frozen=True)
class StoredAdapter:
    """One registry entry. Exactly one of `upload` (its folder, relative to the store) and `path` (its folder,
    relative to the adapter root) is set."""

    name: str
    owner: str | None
    public: bool
    version: str
    loaded_at: str
    upload: str | None = None
    path: str | None = None

    @property
    def key(self) -> tuple[str | None, str]:
        return self.owner, self.name

    @classmethod
    def from_json(cls, item: Any) -> "StoredAdapter":  # noqa: ANN401 - a JSON value, checked here
        """An entry of registry.json; ValueError naming what is wrong with it."""
        if not isinstance(item, dict):
            raise ValueError("an entry is not an object")
        strings = {key: item.get(key) for key in ("name", "version", "loaded_at")}
        if not all(isinstance(value, str) and value for value in strings.values()):
            raise ValueError("name, version and loaded_at must be strings")
        name, version, loaded_at = (str(strings[key]) for key in ("name", "version", "loaded_at"))
        where = [item.get(key) for key in ("upload", "path")]
        if sum(isinstance(value, str) and bool(value) for value in where) != 1 or \
                not all(value is None or isinstance(value, str) for value in where):
            raise ValueError("exactly one of upload and path must be given")
        if not (item.get("owner") is None or isinstance(item.get("owner"), str)) or \
                not isinstance(item.get("public"), bool):
            raise ValueError("owner must be a string or null, public a boolean")
        return cls(name, item.get("owner"), item["public"], version, loaded_at, where[0], where[1])


class AdapterStore:
    """The registry and the upload folders of one store folder, used by one server at a time. Its methods
    that write are called one at a time (AdapterService serializes them); a lock guards them all the same."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.entries: dict[tuple[str | None, str], StoredAdapter] = {}
        self._lock_file: IO[str] | None = None
        self._guard = threading.Lock()

    @property
    def uploads(self) -> Path:
        return self.folder / UPLOADS

    @property
    def is_open(self) -> bool:
        return self._lock_file is not None

    # ---- start and stop ---------------------------------------------------------------------------------
    def open(self) -> list[StoredAdapter]:
        """Take the store (StoreError if another server holds it), read its registry, remove what no entry
        names; returns the entries, oldest first."""
        if self.is_open:
            return self.sorted_entries()
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._lock_file = self._take_lock()
            self.entries = {entry.key: entry for entry in self._read_registry()}
            self.remove_orphans()
        except OSError as exc:
            self.close()
            raise StoreError(f"cannot use the adapter store {self.folder}: {exc.strerror or exc}") from None
        except StoreError:
            self.close()
            raise
        return self.sorted_entries()

    def _take_lock(self) -> IO[str]:
        handle = open(self.folder / LOCK, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            handle.close()
            raise StoreError(f"the adapter store {self.folder} is in use by another slora server (pid {holder}); "
                             "give each server its own --adapter-store DIR") from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        return handle

    def close(self) -> None:
        """Release the store (the files stay: the next start restores them)."""
        if self._lock_file is not None:
            self._lock_file.close()       # closing the descriptor releases the flock
            self._lock_file = None

    def _read_registry(self) -> list[StoredAdapter]:
        """The registry's valid entries; a malformed entry is logged and left out. A registry that is not
        JSON stops the start: taking it for empty would delete every upload as an orphan."""
        path = self.folder / REGISTRY
        if not path.exists():
            return []
        try:
            document = json.loads(path.read_text())
        except (ValueError, UnicodeDecodeError) as exc:
            raise StoreError(f"the adapter store's registry {path} is not valid JSON ({exc}); repair or remove "
                             "it") from None
        items = document.get("adapters") if isinstance(document, dict) else None
        if not isinstance(items, list):
            raise StoreError(f"the adapter store's registry {path} has no \"adapters\" list; repair or remove it")
        entries = []
        for index, item in enumerate(items):
            try:
                entries.append(StoredAdapter.from_json(item))
            except ValueError as exc:
                logger.error("adapter store: entry %d of %s left out: %s", index, path, exc)
        return entries

    def remove_orphans(self) -> list[Path]:
        """Delete upload folders no entry names, temporary registry files, and the per-run upload folders
        of earlier servers in the temporary folder; returns what was removed."""
        named = {(self.folder / entry.upload).resolve() for entry in self.entries.values() if entry.upload}
        removed = [path for path in self.folder.glob(f"{_TEMP_PREFIX}*")]
        for namespace in _children(self.uploads):
            removed += [folder for folder in _children(namespace) if folder.resolve() not in named]
        removed += _old_upload_folders(Path(tempfile.gettempdir()))
        for path in removed:
            _remove(path)
        for namespace in _children(self.uploads):
            with contextlib.suppress(OSError):
                namespace.rmdir()          # only if empty
        if removed:
            logger.info("adapter store: removed %d orphaned folder(s) or file(s): %s", len(removed),
                        ", ".join(p.name for p in removed))
        return removed

    # ---- entries ----------------------------------------------------------------------------------------
    def sorted_entries(self) -> list[StoredAdapter]:
        return sorted(self.entries.values(), key=lambda entry: entry.loaded_at)

    def new_upload_folder(self, namespace: str | None, name: str) -> Path:
        """A fresh folder path (not made yet) for an upload of `namespace` under `name`."""
        return self.uploads / (namespace or LOCAL_NAMESPACE) / f"{name}-{uuid.uuid4().hex[:12]}"

    def relative(self, folder: Path) -> str:
        """An upload folder as the registry names it: relative to the store."""
        return folder.resolve().relative_to(self.folder.resolve()).as_posix()

    def record(self, entry: StoredAdapter) -> None:
        """Add or replace the entry of (owner, name) and write the registry. OSError if it cannot be
        written: the entry is then not in the store."""
        with self._guard:
            previous = self.entries.get(entry.key)
            self.entries[entry.key] = entry
            try:
                self._write()
            except OSError:
                self._undo(entry.key, previous)
                raise

    def forget(self, owner: str | None, name: str) -> None:
        """Drop the entry of (owner, name), if any, and write the registry (OSError if it cannot be written;
        the entry is gone from memory all the same, so the next write leaves it out)."""
        with self._guard:
            if self.entries.pop((owner, name), None) is not None:
                self._write()

    def drop(self, entries: list[StoredAdapter]) -> None:
        """Drop entries that could not be restored, with their upload folders (unless another entry names
        the same folder), and write the registry once."""
        with self._guard:
            for entry in entries:
                self.entries.pop(entry.key, None)
            named = {other.upload for other in self.entries.values()}
            for entry in entries:
                if entry.upload and entry.upload not in named:
                    _remove(self.folder / entry.upload)
            self._write()

    def _undo(self, key: tuple[str | None, str], previous: StoredAdapter | None) -> None:
        if previous is None:
            self.entries.pop(key, None)
        else:
            self.entries[key] = previous

    def _write(self) -> None:
        """Replace registry.json atomically: a crash leaves either the old file or the new one."""
        document = {"format": FORMAT, "adapters": [asdict(entry) for entry in self.sorted_entries()]}
        handle, temporary = tempfile.mkstemp(prefix=_TEMP_PREFIX, dir=self.folder)
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(document, out, indent=1)
                out.flush()
                os.fsync(out.fileno())
            os.replace(temporary, self.folder / REGISTRY)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temporary)
            raise
        _fsync_folder(self.folder)        # the rename itself survives a power cut


def _children(folder: Path) -> list[Path]:
    try:
        return sorted(folder.iterdir())
    except OSError:
        return []


def _old_upload_folders(temp: Path) -> list[Path]:
    """The per-run upload folders that servers before the store made in the temporary folder and deleted only
    at a graceful shutdown: this user's own (others' cannot be removed anyway)."""
    uid = os.getuid()
    found = []
    for path in temp.glob(f"{OLD_UPLOAD_PREFIX}*"):
        with contextlib.suppress(OSError):
            if path.is_dir() and not path.is_symlink() and path.stat().st_uid == uid:
                found.append(path)
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _fsync_folder(folder: Path) -> None:
    with contextlib.suppress(OSError):
        handle = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(handle)
        finally:
            os.close(handle)
