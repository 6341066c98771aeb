"""Content hashes of full KV pages, for prefix sharing (DESIGN §5).

A page's hash chains its parent page's hash, its token ids, the adapter *version* (a content hash, never
the display name) and a per-tenant salt, so pages are shared only by requests of the same adapter
version and the same tenant. SHA-256 with every field length-prefixed, never Python's `hash()`.
"""
import hashlib
import struct

import numpy as np

DIGEST_LENGTH = struct.pack("<Q", hashlib.sha256().digest_size)


def _field(data: bytes) -> bytes:
    return struct.pack("<Q", len(data)) + data


def extend_hashes(hashes: list[bytes], token_ids: list[int] | np.ndarray, page_size: int,
                  adapter_version: str | None, salt: bytes) -> list[bytes]:
    """The chain `hashes` continued by every full page of `token_ids`, the tokens that follow its pages. A
    page's hash is the SHA-256 of its fields, each length-prefixed (`_field`): the parent page's hash (empty
    for the first), its token ids as little-endian int64, the adapter version (empty: none) and the salt.
    The tokens are packed once (from an int array faster than from a list), and the fields every page
    shares are packed once."""
    full = len(token_ids) // page_size
    packed = np.asarray(token_ids[:full * page_size], dtype="<i8").tobytes()     # [full * page_size] int64
    page_bytes = page_size * 8
    tokens_length, shared = struct.pack("<Q", page_bytes), _field((adapter_version or "").encode()) + _field(salt)
    chain = list(hashes)
    parent = _field(chain[-1] if chain else b"")
    for first in range(0, len(packed), page_bytes):
        digest = hashlib.sha256(parent + tokens_length + packed[first:first + page_bytes] + shared).digest()
        chain.append(digest)
        parent = DIGEST_LENGTH + digest          # _field(digest), without packing the same length each page
    return chain
