"""Adapter management over HTTP: list / load / unload, recorded in the adapter store and restored at start.

Loading reads, validates and packs on a worker thread (`AdapterManager.prepare`), then registers
on the engine thread between two steps, so running requests keep streaming while an adapter loads. List
and unload are short commands on the engine thread.
"""
import asyncio
import functools
import logging
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from slora.adapters.errors import AdapterError
from slora.adapters.registry import AdapterEntry
from slora.api.adapter_files import (
    ADAPTER_NAME,
    MODULE,
    PATH,
    UPLOAD,
    Origin,
    UploadedFile,
    check_adapter_name,
    choose_upload_files,
    insufficient_storage,
    resolve_in_root,
    sanitize,
    stat_bytes,
    write_upload,
)
from slora.api.adapter_store import AdapterStore, StoredAdapter, utc_now
from slora.api.async_engine import AsyncEngine, EngineUnavailable, ServedEngine
from slora.api.errors import APIError, adapter_not_found, bad_request, over_byte_quota, unavailable
from slora.api.metrics import ServerMetrics
from slora.api.tenants import Tenant, TenantDirectory
from slora.execution.adapter_manager import PreparedAdapter, UnknownAdapterError

logger = logging.getLogger(__name__)
SERVER_OWNER = "slora"          # owned_by of the base model and of the adapters no tenant loaded
T = TypeVar("T")


class Loaded(NamedTuple):
    """How an adapter name was loaded through the server (AdapterService._loaded)."""

    at: str                 # loaded_at, kept across restarts by the adapter store
    by_tenant: bool         # an upload or a path load (restored ones too); not one of the --lora-modules


class Unrestorable(Exception):
    """A stored adapter that cannot be served again; the message says why."""


@dataclass(frozen=True)
class Registration:
    """What the engine thread returns of a registration: the answer, and the folder the version is read
    back from (an upload's own, or the one an identical upload left before)."""

    info: dict[str, Any]
    source: Path | None


class AdapterService:
    """The adapter routes' logic, with tenant rules: a tenant manages only its own namespace; an admin may
    name another tenant's (`owner`) and mark adapters public. A namespace holds at most `max_adapters` names
    and `max_adapter_bytes` of adapter files (AdapterManager.disk_bytes: uploads and path loads alike).

    Every adapter loaded through the API is recorded in the adapter store (api/adapter_store.py) and served
    again after a restart (`restore`). Registrations and unloads, with their store writes, run one at a time
    (`_commit_lock`), so that the store's registry follows the engine's names in the same order."""

    def __init__(self, engine: AsyncEngine, tenants: TenantDirectory, metrics: ServerMetrics,
                 adapter_root: Path | None, store: AdapterStore, default_byte_quota: int | None = None,
                 served_names: tuple[str, ...] = ()) -> None:
        self.engine = engine
        self.tenants = tenants
        self.metrics = metrics
        self.adapter_root = adapter_root
        self.store = store
        self.default_byte_quota = default_byte_quota
        self.served_names = served_names                 # ServerSettings.served_model_names
        self.started_at = utc_now()                      # loaded_at of the engine's built-in adapters
        self._loaded: dict[tuple[str | None, str], Loaded] = {}   # read and written on the engine thread only
        self._uploading: dict[str | None, int] = {}      # bytes of uploads being stored, by namespace
        self._receiving: dict[str | None, int] = {}      # declared bytes of upload bodies being received
        self._resolving: dict[tuple[str | None, str], asyncio.Future[bool]] = {}   # resolver loads under way
        self._commit_lock = asyncio.Lock()

    @property
    def base_names(self) -> tuple[str, ...]:
        """Every name of the base model, which no adapter may take: its served names and its own."""
        own = (self.engine.info.model_name,) if self.engine.info is not None else ()
        return self.served_names + own

    def namespace_for(self, tenant: Tenant, owner: str | None) -> str | None:
        """The namespace an operation acts on. A non-admin naming someone else's namespace gets 404, the
        same answer as for an adapter that does not exist."""
        if owner is None or owner == tenant.namespace:
            return tenant.namespace
        if not tenant.is_admin:
            raise APIError(404, "The adapter namespace does not exist or you do not have access to it.",
                           code="adapter_not_found", param="owner")
        if self.tenants.get(owner) is None:
            raise bad_request(f"no tenant {owner!r}", param="owner")
        return owner

    def byte_quota(self, namespace: str | None) -> int | None:
        """The namespace's max_adapter_bytes: its tenant's own, else the server's default (None: no limit)."""
        tenant = self.tenants.get(namespace) if namespace is not None else None
        own = tenant.max_adapter_bytes if tenant is not None else None
        return own if own is not None else self.default_byte_quota

    # ---- uploads being received -------------------------------------------------------------------------
    def reserve_upload(self, tenant: Tenant, declared: int | None) -> Callable[[], None]:
        """Before an upload's body is read: refuse it if it is larger than what the caller's byte quota
        leaves beside its other uploads being received, else count its declared length until the returned
        function is called (once the upload is stored or refused), so that concurrent uploads of one tenant
        together spool at most its quota to disk. An admin's upload may be for another namespace, named in
        the form: it is checked once the form is read."""
        quota = self.byte_quota(tenant.namespace)
        if quota is None or tenant.is_admin:
            return lambda: None
        if declared is None:      # else up to max_upload_bytes would be spooled to disk before the check
            raise APIError(411, "an adapter upload needs a Content-Length header: this tenant has a byte quota "
                           f"of {quota} bytes (max_adapter_bytes)", code="length_required")
        namespace = tenant.namespace
        if declared > quota:
            raise over_byte_quota(namespace, quota, f"this upload of {declared} bytes")
        pending = self._receiving.get(namespace, 0)
        if pending + declared > quota:
            raise over_byte_quota(namespace, quota, f"this upload of {declared} bytes, beside the {pending} bytes "
                                   "of its uploads being received,", retry="retry once they are stored")
        self._receiving[namespace] = pending + declared
        return functools.partial(self._release_upload, namespace, declared)

    def _release_upload(self, namespace: str | None, declared: int) -> None:
        self._receiving[namespace] -= declared
        if not self._receiving[namespace]:
            del self._receiving[namespace]

    # ---- list ---------------------------------------------------------------------------------------------
    async def list_adapters(self, tenant: Tenant) -> list[dict[str, Any]]:
        def command(engine: ServedEngine) -> list[dict[str, Any]]:
            if tenant.is_admin:
                return [self._describe(engine, e, tenant) for e in engine.adapters.all_entries()]
            described = [self._describe(engine, e, tenant) for e in engine.adapters.visible_to(tenant.namespace)]
            for info in described:            # other tenants' ids are not shown to a tenant
                if info["owner"] != tenant.namespace:
                    info["owner"] = None
            return described
        return await self._call(command)

    def _describe(self, engine: ServedEngine, entry: AdapterEntry, viewer: Tenant | None) -> dict[str, Any]:
        """One adapter as the routes show it (engine thread). A tenant sees the residency of a version it
        has not used as a fresh load's, not as others' use of the same weights made it (an admin sees all)."""
        isolated = viewer is not None and not viewer.is_admin
        info = engine.adapters.describe(entry, viewer.namespace if viewer is not None else None,
                                        isolated)._asdict()
        info["target_modules"] = list(info["target_modules"])
        loaded = self._loaded.get((entry.owner, entry.name))
        info["loaded_at"] = loaded.at if loaded is not None else self.started_at
        return info

    def model_owner(self, entry: AdapterEntry, viewer: Tenant) -> str:
        """The owned_by of an adapter's model card (engine thread): the viewer's id for an adapter loaded into its
        own namespace through the API (or restored from the adapter store); SERVER_OWNER for the adapters the
        server loaded itself (the model's built-in demo adapters, the --lora-modules) and for other tenants'
        public ones, whose owners a tenant is not shown. In single-user mode the demo adapters share the
        user's namespace: only how they were loaded tells them from the user's own."""
        loaded = self._loaded.get((entry.owner, entry.name))
        if entry.owner == viewer.namespace and loaded is not None and loaded.by_tenant:
            return viewer.id
        return SERVER_OWNER

    # ---- load ---------------------------------------------------------------------------------------------
    async def load_path(self, tenant: Tenant, name: str, user_path: str, public: bool = False,
                        owner: str | None = None, param: str = "path") -> dict[str, Any]:
        namespace = self.namespace_for(tenant, owner)
        self._check_load(tenant, name, public)
        folder = await asyncio.to_thread(resolve_in_root, self.adapter_root, user_path, param)
        # Refused before the server reads anything: at its names quota, or over its byte quota by the files'
        # sizes (checked again with what was read, at registration).
        size = await asyncio.to_thread(stat_bytes, folder)
        await self._call(lambda engine: self._check_room(engine, namespace, name, size))
        assert self.adapter_root is not None, "resolve_in_root refuses path loads without an adapter root"
        where = folder.relative_to(self.adapter_root.resolve()).as_posix()
        return await self._load(name, folder, namespace, public, Origin(PATH, where), tenant)

    async def load_module(self, name: str, folder: Path) -> dict[str, Any]:
        """Load a `--lora-modules` adapter at start: public, in no tenant's namespace, through the checks of
        a path load (its name and folder were checked by ServerSettings). Not recorded in the store: the
        command line loads it at every start."""
        check_adapter_name(name, self.base_names)
        return await self._load(name, folder, None, True, Origin(MODULE), None)

    async def resolve(self, tenant: Tenant, name: str) -> bool:
        """vLLM's filesystem LoRA resolver: load `<adapter root>/<name>` for a request that names an adapter
        the caller does not have, into the caller's namespace (a tenant's own, within its quotas), through
        `load_path`, the admin route's load. False, with nothing loaded, for anything the caller may not load
        (no such folder, a name that could not be one, invalid files, over a quota), so that its answer is the
        404 of any unknown model and the root's contents stay unknown to it: the reason goes to the log (and
        to an admin caller, as its error). Concurrent first requests for one name share one load."""
        if self.adapter_root is None or not ADAPTER_NAME.fullmatch(name) or name in self.base_names:
            return False
        key = (tenant.namespace, name)
        load = self._resolving.get(key)
        if load is None:
            # A task of its own, so that a first requester going away does not cancel the others' load.
            load = self._resolving[key] = asyncio.ensure_future(self._resolve_once(tenant, name))
            load.add_done_callback(lambda _: self._resolving.pop(key, None))
            load.add_done_callback(lambda task: task.cancelled() or task.exception())   # may be read by nobody
        return await asyncio.shield(load)

    async def _resolve_once(self, tenant: Tenant, name: str) -> bool:
        found = await self._call(lambda engine: engine.adapters.lookup(name, tenant.namespace))
        if found is not None:       # loaded meanwhile: by a request that came first, or through the routes
            return True
        try:
            await asyncio.to_thread(resolve_in_root, self.adapter_root, name, "model")
        except APIError:            # no such folder in the root, or not one inside it: the usual 404
            return False
        logger.info("resolver: loading adapter %s for %s from the adapter root", name, tenant.namespace or "local")
        try:
            await self.load_path(tenant, name, name, param="model")
        except APIError as error:
            if error.status >= 500:         # the server's state (the engine stopping), not the folder's
                raise
            logger.warning("resolver: adapter %s not loaded for %s: %s", name, tenant.namespace or "local",
                           error.message)
            if not tenant.is_admin:
                return False
            if error.param in ("adapter", "path", "files"):
                error.param = "model"       # the adapter the request's model names is what was refused
            raise
        return True

    async def load_upload(self, tenant: Tenant, name: str, files: list[UploadedFile], public: bool = False,
                          owner: str | None = None) -> dict[str, Any]:
        """Store an upload in a folder of its own in the adapter store, which the engine owns (and deletes)
        once registered."""
        namespace = self.namespace_for(tenant, owner)
        self._check_load(tenant, name, public)
        chosen = choose_upload_files(files)
        with self._reserving(namespace, sum(item.size for item in chosen.values())):
            pending = self._uploading[namespace]       # this upload's bytes and those of others being stored
            await self._call(lambda engine: self._check_room(engine, namespace, name, pending))
            target = self.store.new_upload_folder(namespace, name)
            folder = await asyncio.to_thread(write_upload, target, chosen)
            return await self._load(name, folder, namespace, public, Origin(UPLOAD), tenant)

    @contextmanager
    def _reserving(self, namespace: str | None, size: int) -> Iterator[None]:
        """Count an upload's bytes against its namespace while it is stored and registered, so that
        concurrent uploads cannot each pass the quota check and together fill the disk."""
        self._uploading[namespace] = self._uploading.get(namespace, 0) + size
        try:
            yield
        finally:
            self._uploading[namespace] -= size
            if not self._uploading[namespace]:
                del self._uploading[namespace]

    async def _load(self, name: str, folder: Path, namespace: str | None, public: bool, origin: Origin,
                    viewer: Tenant | None) -> dict[str, Any]:
        started = time.perf_counter()
        try:
            prepared = await self._prepare(folder, origin.owns_files)
            info = await self._commit(name, prepared, namespace, public, origin, utc_now(), viewer)
        except AdapterError as exc:
            raise bad_request(sanitize(str(exc), self._hidden()), param="adapter") from None
        elapsed = time.perf_counter() - started
        self.metrics.adapter_load.observe(elapsed)
        self.metrics.adapter_registrations.inc()
        logger.info("adapter %s loaded for %s as %s in %.3fs", name, namespace or "local", info["version"][:12],
                    elapsed)
        return info

    async def _prepare(self, folder: Path, owns_files: bool) -> PreparedAdapter:
        try:
            return await self.engine.prepare_adapter(folder)
        except BaseException:
            if owns_files:
                shutil.rmtree(folder, ignore_errors=True)
            raise

    async def _commit(self, name: str, prepared: PreparedAdapter, namespace: str | None, public: bool,
                      origin: Origin, loaded_at: str, viewer: Tenant | None, checked: bool = True) -> dict[str, Any]:
        """Register and record, one commit at a time. Shielded: once started, the commit decides what becomes
        of the folder and the store, even if this request is cancelled meanwhile; its outcome is then read by
        nobody, which the callback says is fine."""
        commit = asyncio.ensure_future(self._commit_now(name, prepared, namespace, public, origin, loaded_at,
                                                        viewer, checked))
        commit.add_done_callback(lambda task: task.cancelled() or task.exception())
        return await asyncio.shield(commit)

    async def _commit_now(self, name: str, prepared: PreparedAdapter, namespace: str | None, public: bool,
                          origin: Origin, loaded_at: str, viewer: Tenant | None, checked: bool) -> dict[str, Any]:
        async with self._commit_lock:
            registered = await self._register(name, prepared, namespace, public, origin, loaded_at, viewer,
                                              checked)
            if origin.kind != MODULE:
                await self._record(name, namespace, public, origin, loaded_at, registered)
            return registered.info

    async def _register(self, name: str, prepared: PreparedAdapter, namespace: str | None, public: bool,
                        origin: Origin, loaded_at: str, viewer: Tenant | None, checked: bool) -> Registration:
        try:
            return await self.engine.call(lambda engine: self._register_now(
                engine, name, prepared, namespace, public, origin, loaded_at, viewer, checked))
        except EngineUnavailable as exc:
            if origin.owns_files:             # the engine stopped before the command ran
                assert prepared.path is not None, "an owned folder is the one the adapter was prepared from"
                shutil.rmtree(prepared.path, ignore_errors=True)
            raise unavailable(f"the engine is {exc}; retry later") from None

    def _register_now(self, engine: ServedEngine, name: str, prepared: PreparedAdapter, namespace: str | None,
                      public: bool, origin: Origin, loaded_at: str, viewer: Tenant | None,
                      checked: bool) -> Registration:
        """On the engine thread, so that two concurrent loads cannot both take the last free name or bytes."""
        owns_files = origin.owns_files
        try:
            if checked:
                self._check_room(engine, namespace, name, prepared.disk_bytes)
        except APIError:
            if owns_files:
                assert prepared.path is not None, "an owned folder is the one the adapter was prepared from"
                shutil.rmtree(prepared.path, ignore_errors=True)
            raise
        # From here the engine owns an uploaded folder: it deletes it if it refuses the adapter, and once the
        # version is dropped (unloaded or replaced, after its last request).
        entry = engine.adapters.register(name, prepared, owner=namespace, public=public, owns_files=owns_files)
        self._loaded[(namespace, name)] = Loaded(loaded_at, by_tenant=origin.kind != MODULE)
        return Registration(self._describe(engine, entry, viewer), engine.adapters.source_folder(entry.version))

    async def _record(self, name: str, namespace: str | None, public: bool, origin: Origin, loaded_at: str,
                      registered: Registration) -> None:
        """Write the registration into the store (unless it holds it already, as at restore). An upload is
        recorded by the folder its version is read back from, which stays while any name points at it. If
        the store cannot be written, the name is unloaded again: what was answered 200 survives restarts."""
        where = origin.where
        if origin.kind == UPLOAD:
            assert registered.source is not None, "an upload's version is read back from an owned folder"
            where = self.store.relative(registered.source)
        stored = StoredAdapter(name, namespace, public, registered.info["version"], loaded_at,
                               where if origin.kind == UPLOAD else None, where if origin.kind == PATH else None)
        if self.store.entries.get(stored.key) == stored:
            return
        try:
            await asyncio.to_thread(self.store.record, stored)
        except OSError as exc:
            logger.error("adapter store: cannot record adapter %s of %s: %s", name, namespace or "local", exc)
            await self._call(lambda engine: self._unregister(engine, name, namespace))
            raise insufficient_storage("the adapter could not be recorded in the adapter store", exc) from None

    def _unregister(self, engine: ServedEngine, name: str, namespace: str | None) -> None:
        engine.adapters.unload(name, owner=namespace)
        self._loaded.pop((namespace, name), None)

    async def _call(self, command: Callable[[ServedEngine], T]) -> T:
        try:
            return await self.engine.call(command)
        except EngineUnavailable as exc:
            raise unavailable(f"the engine is {exc}; retry later") from None

    def _check_room(self, engine: ServedEngine, namespace: str | None, name: str, new_bytes: int) -> None:
        self._check_quota(engine, namespace, name)
        self._check_bytes(engine, namespace, name, new_bytes)

    def _check_quota(self, engine: ServedEngine, namespace: str | None, name: str) -> None:
        """The namespace's tenant may hold at most `max_adapters` names; replacing one of them is allowed."""
        owner = self.tenants.get(namespace) if namespace is not None else None
        if owner is None or owner.max_adapters is None:
            return
        held = engine.adapters.names_in(namespace)
        if engine.adapters.named(name, namespace) is None and held >= owner.max_adapters:
            raise APIError(403, f"tenant {namespace!r} may hold at most {owner.max_adapters} adapters and holds "
                           f"{held}: unload one before loading {name!r}", code="adapter_quota_exceeded",
                           param="name")

    def _check_bytes(self, engine: ServedEngine, namespace: str | None, name: str, new_bytes: int) -> None:
        """The namespace's adapter files, with `new_bytes` more under `name` (whose present version's files
        no longer count, unless another name keeps them), must fit its byte quota."""
        quota = self.byte_quota(namespace)
        if quota is None:
            return
        held = engine.adapters.disk_bytes(namespace) - engine.adapters.replaced_bytes(namespace, name)
        if held + new_bytes > quota:
            raise over_byte_quota(namespace, quota, f"{new_bytes} more bytes under {name!r}", held=held)

    def _check_load(self, tenant: Tenant, name: str, public: bool) -> None:
        if self.engine.info is not None:
            check_adapter_name(name, self.base_names)
        if public and not tenant.is_admin:
            raise APIError(403, "only admins may publish adapters", param="public")

    # ---- unload -------------------------------------------------------------------------------------------
    async def unload(self, tenant: Tenant, name: str, owner: str | None = None) -> dict[str, Any]:
        """Forget the name now (new requests get 404) and drop it from the store; in-flight requests finish,
        then pages are freed and an uploaded folder is deleted."""
        namespace = self.namespace_for(tenant, owner)

        def command(engine: ServedEngine) -> dict[str, Any]:
            target = namespace
            if tenant.is_admin and owner is None:
                # An admin may unload a public adapter (possibly the built-in demos) by its plain name.
                entry = engine.adapters.lookup(name, namespace)
                target = entry.owner if entry is not None else namespace
            self._unregister(engine, name, target)
            return {"name": name, "owner": target, "deleted": True}
        async with self._commit_lock:
            try:
                result = await self._call(command)
            except UnknownAdapterError:
                raise adapter_not_found(name) from None
            await self._forget(result["owner"], name)
        logger.info("adapter %s unloaded for %s", name, result["owner"] or "local")
        return result

    async def _forget(self, owner: str | None, name: str) -> None:
        """Drop the name from the store. Unloaded it is, whatever the disk says: a failed write is logged, and
        the next write of the registry leaves the name out."""
        try:
            await asyncio.to_thread(self.store.forget, owner, name)
        except OSError as exc:
            logger.error("adapter store: cannot drop adapter %s of %s from the registry: %s", name,
                         owner or "local", exc)

    # ---- restore ------------------------------------------------------------------------------------------
    async def restore(self, entries: list[StoredAdapter]) -> None:
        """Serve the store's adapters again, with their names, owners, versions and loaded_at. One that
        cannot be (files gone or changed, now invalid) is logged and dropped from the store; one whose
        tenant is no longer in the tenants file is kept, not loaded, until it is again."""
        dropped: list[StoredAdapter] = []
        prepared: dict[Path, PreparedAdapter] = {}       # one read of a folder that several entries name
        for entry in entries:
            who = f"adapter {entry.name!r} of {entry.owner or 'local'}"
            if entry.owner is not None and self.tenants.get(entry.owner) is None:
                logger.warning("adapter store: %s kept but not loaded: no such tenant in the tenants file", who)
                continue
            try:
                await self._restore_one(entry, prepared)
            except (Unrestorable, AdapterError, APIError) as exc:
                if isinstance(exc, APIError) and exc.status >= 500:
                    logger.error("adapter store: restore stopped at %s: %s", who, exc.message)
                    break
                reason = exc.message if isinstance(exc, APIError) else str(exc)
                logger.error("adapter store: %s dropped, it cannot be restored: %s", who, reason)
                dropped.append(entry)
        await self._drop(dropped)
        logger.info("adapter store: %d adapter(s) restored, %d dropped", len(entries) - len(dropped),
                    len(dropped))

    async def _restore_one(self, entry: StoredAdapter, prepared: dict[Path, PreparedAdapter]) -> None:
        check_adapter_name(entry.name, self.base_names)
        folder = await asyncio.to_thread(self._stored_folder, entry)
        if folder not in prepared:
            prepared[folder] = await self.engine.prepare_adapter(folder)
        if prepared[folder].version != entry.version:
            raise Unrestorable("its files changed since it was loaded")
        origin = Origin(UPLOAD, entry.upload) if entry.upload else Origin(PATH, entry.path)
        await self._commit(entry.name, prepared[folder], entry.owner, entry.public, origin, entry.loaded_at, None,
                           checked=False)

    def _stored_folder(self, entry: StoredAdapter) -> Path:
        """The folder a stored adapter is read from: its upload folder inside the store, or its folder inside
        the adapter root (the path load's checks)."""
        if entry.path is not None:
            if self.adapter_root is None:
                raise Unrestorable("it was loaded by path, and the server has no --adapter-root")
            try:
                return resolve_in_root(self.adapter_root, entry.path, "path")
            except APIError as exc:
                raise Unrestorable(exc.message) from None
        assert entry.upload is not None, "a stored adapter is an upload or a path load"
        folder = (self.store.folder / entry.upload).resolve()
        if not folder.is_relative_to(self.store.uploads.resolve()) or not folder.is_dir():
            raise Unrestorable("its uploaded files are gone")
        return folder

    async def _drop(self, entries: list[StoredAdapter]) -> None:
        if not entries:
            return
        try:
            await asyncio.to_thread(self.store.drop, entries)
        except OSError as exc:
            logger.error("adapter store: cannot write the registry: %s", exc)

    def _hidden(self) -> list[Path]:
        return [p for p in (self.adapter_root, self.store.folder) if p is not None]
