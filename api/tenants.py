"""Tenants: API keys (stored as SHA-256 hashes) mapped to a tenant, its role and its limits.

The tenants file is TOML, one table per tenant:

    [tenants.acme]
    role = "tenant"                 # or "admin"
    key_sha256 = ["<64 hex chars>"] # sha256 of each API key; a single string is accepted too
    max_concurrent = 4              # sequences in the engine at once: prompts × n of its requests
                                    # (default: unlimited)
    max_queued = 8                  # sequences waiting for those seats (default: 0)
    weight = 2.0                    # its share of the engine under fair scheduling: twice the service of a
                                    # weight-1 tenant when both wait (default: 1.0)
    max_adapters = 50               # adapter names in its namespace (default: unlimited)
    max_adapter_bytes = 2147483648  # bytes of the adapter files its names point at, uploaded or loaded
                                    # by path (default: the server's --max-adapter-bytes)
    max_tokens_per_minute = 100000  # prompt tokens + max_tokens of its requests (default: unlimited)
"""
import hashlib
import hmac
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import tomllib

ROLES = ("admin", "tenant")
LOCAL_TENANT_ID = "local"
_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_HEX64 = re.compile(r"^[0-9a-f]{64}$")


def hash_key(key: str) -> str:
    """The hex SHA-256 of an API key, as the tenants file stores it."""
    return hashlib.sha256(key.encode()).hexdigest()


def _positive_number(value: object) -> bool:
    # bool is an int to Python, but `weight = true` in a tenants file is a mistake, not 1.0
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


@dataclass(frozen=True)
class Tenant:
    id: str
    role: str = "tenant"
    key_hashes: tuple[bytes, ...] = ()
    max_concurrent: int | None = None
    max_queued: int = 0
    max_adapters: int | None = None  # adapter names its namespace may hold
    max_adapter_bytes: int | None = None   # bytes of its adapters' files; None: the server's default
    max_tokens_per_minute: int | None = None   # prompt + max_tokens of admitted requests, per minute
    weight: float = 1.0              # share of the engine under fair scheduling
    local: bool = False              # the single user of a server without a tenants file

    def __post_init__(self) -> None:
        if not _ID.match(self.id):
            raise ValueError(f"tenant id {self.id!r}: use 1-64 letters, digits, '_', '.' or '-'")
        if self.role not in ROLES:
            raise ValueError(f"tenant {self.id}: role must be one of {ROLES}, got {self.role!r}")
        if self.max_concurrent is not None and self.max_concurrent < 1:
            raise ValueError(f"tenant {self.id}: max_concurrent must be >= 1, got {self.max_concurrent}")
        if self.max_queued < 0:
            raise ValueError(f"tenant {self.id}: max_queued must be >= 0, got {self.max_queued}")
        if self.max_adapters is not None and self.max_adapters < 1:
            raise ValueError(f"tenant {self.id}: max_adapters must be >= 1, got {self.max_adapters}")
        if self.max_tokens_per_minute is not None and self.max_tokens_per_minute < 1:
            raise ValueError(f"tenant {self.id}: max_tokens_per_minute must be >= 1, got {self.max_tokens_per_minute}")
        if self.max_adapter_bytes is not None and self.max_adapter_bytes < 1:
            raise ValueError(f"tenant {self.id}: max_adapter_bytes must be >= 1, got {self.max_adapter_bytes}")
        if not _positive_number(self.weight):
            raise ValueError(f"tenant {self.id}: weight must be a finite number > 0, got {self.weight!r}")

    @property
    def is_admin(self) -> bool:
        return self.role == "admin"

    @property
    def namespace(self) -> str | None:
        """The adapter namespace (engine `owner`) of this tenant; None in single-user mode."""
        return None if self.local else self.id


LOCAL_TENANT = Tenant(LOCAL_TENANT_ID, role="admin", local=True)


class TenantDirectory:
    """Who a key belongs to. Without tenants (single-user mode) every caller is the local admin."""

    def __init__(self, tenants: list[Tenant] | None = None) -> None:
        self.tenants = {t.id: t for t in tenants or []}
        self.single_user = tenants is None
        self._keys = [(digest, tenant) for tenant in tenants or [] for digest in tenant.key_hashes]

    def authenticate(self, key: str | None) -> Tenant | None:
        """The tenant of `key`, or None. Every stored hash is compared, in constant time, so the time
        taken says nothing about which key (or how much of one) matched."""
        if self.single_user:
            return LOCAL_TENANT
        if not key:
            return None
        digest = hashlib.sha256(key.encode()).digest()
        found = None
        for stored, tenant in self._keys:
            if hmac.compare_digest(stored, digest):
                found = tenant
        return found

    def get(self, tenant_id: str) -> Tenant | None:
        return self.tenants.get(tenant_id)


def load_tenants(path: str | Path) -> TenantDirectory:
    """Read and validate a tenants TOML file. Raises ValueError naming the bad field."""
    try:
        raw = tomllib.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"tenants file {path}: {exc}") from None
    tables = raw.get("tenants")
    if not isinstance(tables, dict) or not tables:
        raise ValueError(f"tenants file {path}: needs at least one [tenants.<id>] table")
    tenants = [_parse_tenant(tenant_id, fields) for tenant_id, fields in tables.items()]
    _check_unique_keys(tenants)
    return TenantDirectory(tenants)


def _parse_tenant(tenant_id: str, fields: Any) -> Tenant:
    if not isinstance(fields, dict):
        raise ValueError(f"tenants.{tenant_id} must be a table")
    unknown = set(fields) - {"role", "key_sha256", "max_concurrent", "max_queued", "max_adapters",
                             "max_tokens_per_minute", "max_adapter_bytes", "weight"}
    if unknown:
        raise ValueError(f"tenants.{tenant_id}: unknown field(s) {', '.join(sorted(unknown))}")
    hashes = fields.get("key_sha256", [])
    hashes = [hashes] if isinstance(hashes, str) else hashes
    if not isinstance(hashes, list) or not hashes:
        raise ValueError(f"tenants.{tenant_id}.key_sha256: give at least one key hash")
    for value in hashes:
        if not isinstance(value, str) or not _HEX64.match(value.lower()):
            raise ValueError(f"tenants.{tenant_id}.key_sha256: each entry must be 64 hex characters "
                             "(the SHA-256 of the key, never the key itself)")
    max_concurrent = fields.get("max_concurrent")
    max_queued = fields.get("max_queued", 0)
    max_adapters = fields.get("max_adapters")
    max_tpm = fields.get("max_tokens_per_minute")
    max_bytes = fields.get("max_adapter_bytes")
    for name, value in (("max_concurrent", max_concurrent), ("max_queued", max_queued),
                        ("max_adapters", max_adapters), ("max_tokens_per_minute", max_tpm),
                        ("max_adapter_bytes", max_bytes)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise ValueError(f"tenants.{tenant_id}.{name} must be an integer")
    return Tenant(tenant_id, role=fields.get("role", "tenant"),
                  key_hashes=tuple(bytes.fromhex(h.lower()) for h in hashes),
                  max_concurrent=max_concurrent, max_queued=max_queued, max_adapters=max_adapters,
                  max_tokens_per_minute=max_tpm, max_adapter_bytes=max_bytes, weight=_weight(tenant_id, fields))


def _weight(tenant_id: str, fields: dict[str, Any]) -> float:
    value = fields.get("weight", 1.0)
    if not _positive_number(value):
        raise ValueError(f"tenants.{tenant_id}.weight must be a finite number > 0 (the tenant's share of the engine), "
                         f"got {value!r}")
    return float(value)


def _check_unique_keys(tenants: list[Tenant]) -> None:
    seen: dict[bytes, str] = {}
    for tenant in tenants:
        for digest in tenant.key_hashes:
            if digest in seen and seen[digest] != tenant.id:
                raise ValueError(f"tenants.{tenant.id}.key_sha256: the same key also belongs to {seen[digest]}")
            seen[digest] = tenant.id
