"""Content hashes of full KV blocks, chained so equal hashes mean equal whole prefixes.

A cryptographic digest rather than Python's ``hash``: a collision would silently hand one
user's cached keys to another request, and tuple hashes can be collided on purpose.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
_ROOT_HASH: BlockHash = b"pagedserve-prefix-root"


def hash_block(
    parent_hash: BlockHash | None, token_ids: Sequence[int], extra_key: str | None = None
) -> BlockHash:
    """A block's identity: its parent's hash, its tokens and an optional key (e.g. an adapter
    id), so two blocks match only if everything before them matched too."""
    digest = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    digest.update(array("q", token_ids).tobytes())
    if extra_key is not None:
        digest.update(extra_key.encode())
    return digest.digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, start_block: int = 0,
    parent_hash: BlockHash | None = None, extra_key: str | None = None,
) -> list[BlockHash]:
    """Hashes of full blocks ``start_block, start_block+1, ...`` of ``token_ids``."""
    hashes = []
    for first in range(start_block * block_size, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block(parent_hash, token_ids[first:first + block_size], extra_key)
        hashes.append(parent_hash)
    return hashes
