"""Adapter management over HTTP: where adapter folders may come from (the adapter root, uploads) and the
list / load / unload operations.

Loading reads, validates and packs on a worker thread (`Engine.prepare_adapter`), then registers
on the engine thread between two steps, so running requests keep streaming while an adapter loads. List
and unload are short commands on the engine thread.
"""
import asyncio
import logging
import re
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, BinaryIO

from slora.adapters.errors import AdapterError
from slora.adapters.weights import PICKLE_SUFFIXES, WEIGHTS_FILE
from slora.api.async_engine import AsyncEngine
from slora.api.errors import APIError, adapter_not_found, bad_request
from slora.api.metrics import ServerMetrics
from slora.api.tenants import Tenant, TenantDirectory
from slora.engine import Engine, UnknownAdapterError

logger = logging.getLogger(__name__)
CONFIG_FILE = "adapter_config.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_adapter_name(name: str, base_model: str) -> None:
    if not _NAME.match(name):
        raise bad_request("adapter name must be 1-128 letters, digits, '.', '_' or '-', starting with a letter "
                          "or digit", param="name")
    if name == base_model:
        raise bad_request("adapter name must differ from the base model's name", param="name")


def resolve_in_root(root: Path | None, user_path: str, param: str) -> Path:
    """The adapter folder `user_path` names inside `root`. Refuses `..`, absolute paths and symlinks that
    lead outside the root; the folder and its two files must all resolve inside it."""
    if root is None:
        raise bad_request("loading adapters by path is disabled: the server has no adapter root "
                          "(start it with --adapter-root DIR, or upload the files)", param=param)
    if not user_path or "\x00" in user_path:
        raise bad_request("adapter path is empty or invalid", param=param)
    pure = PurePosixPath(user_path)
    if ".." in pure.parts or ".." in PureWindowsPath(user_path).parts:
        raise bad_request("adapter path must not contain '..'", param=param)
    real_root = root.resolve()
    candidate = Path(user_path) if pure.is_absolute() else real_root / pure
    folder = candidate.resolve()
    targets = [folder] + [(folder / name).resolve() for name in ADAPTER_FILES if (folder / name).exists()]
    if not all(t == real_root or t.is_relative_to(real_root) for t in targets) or folder == real_root:
        raise bad_request("adapter path must name a folder inside the adapter root", param=param)
    if not folder.is_dir():
        raise bad_request(f"no adapter folder at {user_path!r} in the adapter root", param=param)
    return folder


@dataclass(frozen=True)
class UploadedFile:
    field: str
    filename: str
    source: BinaryIO            # the spooled upload; copied to disk in chunks, never read whole into memory


def save_upload(upload_dir: Path, namespace: str, name: str, files: list[UploadedFile]) -> Path:
    """Write the two PEFT files of an upload into a fresh folder. Pickle files are refused unread."""
    by_name: dict[str, BinaryIO] = {}
    for item in files:
        filename = PurePosixPath(item.filename.replace("\\", "/")).name
        if filename.endswith(PICKLE_SUFFIXES) or item.field.endswith(PICKLE_SUFFIXES):
            raise bad_request(f"{filename}: pickle files are never loaded; upload {WEIGHTS_FILE}",
                              param=item.field)
        target = _upload_target(item.field, filename)
        if target is None:
            raise bad_request(f"unexpected file {filename!r}: upload exactly {CONFIG_FILE} and {WEIGHTS_FILE}",
                              param=item.field)
        by_name[target] = item.source
    missing = [f for f in ADAPTER_FILES if f not in by_name]
    if missing:
        raise bad_request(f"the upload lacks {', '.join(missing)}", param="files")
    folder = upload_dir / namespace / f"{name}-{uuid.uuid4().hex[:12]}"
    folder.mkdir(parents=True)
    for filename, source in by_name.items():
        source.seek(0)
        with open(folder / filename, "wb") as out:
            shutil.copyfileobj(source, out, length=2 ** 20)
    return folder


def _upload_target(field: str, filename: str) -> str | None:
    """Which PEFT file an upload part is: by its field name or by its file name."""
    for target in ADAPTER_FILES:
        if field in (target, target.split(".")[0]) or filename == target:
            return target
    return None


def _sanitize(message: str, hidden: list[Path]) -> str:
    """Drop server-side folder names from an engine message (they are internal paths)."""
    for path in hidden:
        message = message.replace(str(path.resolve()), "<adapter>").replace(str(path), "<adapter>")
    return message


def describe(engine: Engine, entry: Any) -> dict[str, Any]:
    """One adapter as the list route shows it (runs on the engine thread)."""
    stored = engine.store.versions.get(entry.version)
    resident = entry.version in engine.scheduler.adapters.resident
    tier = stored.tier if stored is not None else "disk"
    info: dict[str, Any] = {"name": entry.name, "version": entry.version, "owner": entry.owner,
                            "public": entry.public, "residency": "pool" if resident else tier}
    if stored is not None:
        info.update(rank=stored.max_rank, target_modules=list(stored.target_modules),
                    pages=stored.num_pages, bytes=stored.num_bytes)
    return info


class AdapterService:
    """The adapter routes' logic, with tenant rules: a tenant manages only its own namespace; an admin may
    name another tenant's (`owner`) and mark adapters public."""

    def __init__(self, engine: AsyncEngine, tenants: TenantDirectory, metrics: ServerMetrics,
                 adapter_root: Path | None, upload_dir: Path) -> None:
        self.engine = engine
        self.tenants = tenants
        self.metrics = metrics
        self.adapter_root = adapter_root
        self.upload_dir = upload_dir

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

    async def list_adapters(self, tenant: Tenant) -> list[dict[str, Any]]:
        def command(engine: Engine) -> list[dict[str, Any]]:
            if tenant.is_admin:
                return [describe(engine, e) for e in engine.registry.entries.values()]
            described = [describe(engine, e) for e in engine.registry.visible_to(tenant.namespace)]
            for info in described:            # other tenants' ids are not shown to a tenant
                if info["owner"] != tenant.namespace:
                    info["owner"] = None
            return described
        return await self.engine.call(command)

    async def load_path(self, tenant: Tenant, name: str, user_path: str, public: bool = False,
                        owner: str | None = None, param: str = "path") -> dict[str, Any]:
        namespace = self.namespace_for(tenant, owner)
        folder = resolve_in_root(self.adapter_root, user_path, param)
        return await self.load_folder(tenant, name, folder, namespace, public)

    async def load_upload(self, tenant: Tenant, name: str, files: list[UploadedFile], public: bool = False,
                          owner: str | None = None) -> dict[str, Any]:
        namespace = self.namespace_for(tenant, owner)
        self._check_load(tenant, name, public)
        folder = await asyncio.to_thread(save_upload, self.upload_dir, namespace or "_local", name, files)
        try:
            return await self.load_folder(tenant, name, folder, namespace, public)
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise

    async def load_folder(self, tenant: Tenant, name: str, folder: Path, namespace: str | None,
                          public: bool) -> dict[str, Any]:
        self._check_load(tenant, name, public)
        started = time.perf_counter()

        def command(engine: Engine) -> dict[str, Any]:
            # On the engine thread, so two concurrent loads cannot both take the last free name.
            self._check_quota(engine, namespace, name)
            return describe(engine, engine.register_adapter(name, prepared, owner=namespace, public=public))
        try:
            # A tenant at its quota is refused before the server reads and packs anything; the check is
            # made again, atomically, when registering.
            await self.engine.call(lambda engine: self._check_quota(engine, namespace, name))
            prepared = await self.engine.prepare_adapter(folder)
            info = await self.engine.call(command)
        except AdapterError as exc:
            raise bad_request(_sanitize(str(exc), self._hidden()), param="adapter") from None
        elapsed = time.perf_counter() - started
        self.metrics.adapter_load.observe(elapsed)
        self.metrics.adapter_registrations.inc()
        logger.info("adapter %s loaded for %s as %s in %.3fs", name, namespace or "local", info["version"][:12],
                    elapsed)
        return info

    def _check_quota(self, engine: Engine, namespace: str | None, name: str) -> None:
        """The namespace's tenant may hold at most `max_adapters` names; replacing one of them is allowed."""
        owner = self.tenants.get(namespace) if namespace is not None else None
        if owner is None or owner.max_adapters is None:
            return
        held = sum(1 for (o, _) in engine.registry.entries if o == namespace)
        if (namespace, name) not in engine.registry.entries and held >= owner.max_adapters:
            raise APIError(403, f"tenant {namespace!r} may hold at most {owner.max_adapters} adapters and holds "
                           f"{held}: unload one before loading {name!r}", code="adapter_quota_exceeded",
                           param="name")

    def _check_load(self, tenant: Tenant, name: str, public: bool) -> None:
        if self.engine.info is not None:
            check_adapter_name(name, self.engine.info.model_name)
        if public and not tenant.is_admin:
            raise APIError(403, "only admins may publish adapters", param="public")

    async def unload(self, tenant: Tenant, name: str, owner: str | None = None) -> dict[str, Any]:
        """Forget the name now (new requests get 404); in-flight requests finish, then pages are freed."""
        namespace = self.namespace_for(tenant, owner)

        def command(engine: Engine) -> dict[str, Any]:
            target = namespace
            if tenant.is_admin and owner is None:
                # An admin may unload a public adapter (possibly the built-in demos) by its plain name.
                entry = engine.registry.resolve(name, namespace)
                target = entry.owner if entry is not None else namespace
            engine.unload_adapter(name, owner=target)
            return {"name": name, "owner": target, "deleted": True}
        try:
            result = await self.engine.call(command)
        except UnknownAdapterError:
            raise adapter_not_found(name) from None
        logger.info("adapter %s unloaded for %s", name, result["owner"] or "local")
        return result

    def _hidden(self) -> list[Path]:
        return [p for p in (self.adapter_root, self.upload_dir) if p is not None]
