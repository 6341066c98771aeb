"""Content hashes of full KV pages, for prefix sharing (DESIGN §5).

A page's hash chains its parent page's hash, its token ids, the adapter *version* (a content hash, never
the display name) and a per-tenant salt, so pages are shared only by requests of the same adapter
version and the same tenant. SHA-256 with every field length-prefixed, never Python's `hash()`.
"""
import hashlib
import struct


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def page_hash(parent: bytes | None, token_ids: list[int], adapter_version: str | None, salt: bytes) -> bytes:
    """The hash of one full page of tokens that follows the page hashed `parent` (None: the first)."""
    tokens = struct.pack(f"<{len(token_ids)}q", *token_ids)
    fields = (parent or b"", tokens, (adapter_version or "").encode(), salt)
    return hashlib.sha256(b"".join(map(_field, fields))).digest()       # one call: a prompt hashes many pages


def prefix_hashes(token_ids: list[int], page_size: int, adapter_version: str | None, salt: bytes,
                  start: list[bytes] | None = None) -> list[bytes]:
    """Hashes of every full page of `token_ids`, continuing the chain `start` (hashes already known)."""
    hashes = list(start or [])
    for first in range(len(hashes) * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hashes[-1] if hashes else None
        hashes.append(page_hash(parent, token_ids[first:first + page_size], adapter_version, salt))
    return hashes
