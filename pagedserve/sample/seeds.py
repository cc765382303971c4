"""Per-stream random seeds derived from a request's seed.

Stream ``index`` of a request seeded with ``seed`` draws from a generator seeded with a hash of
both. Adding them instead (``seed + index``) made choice 1 of seed s replay seed s+1, so two
requests' streams were correlated; and torch's CPU generator keeps only the low 32 bits of its
seed, so seed 5 and seed 2**32 + 5 gave the same text. The hash spreads every bit of the seed
over every bit of the result, low bits included.
"""

from __future__ import annotations

import hashlib


def stream_seed(seed: int, index: int) -> int:
    """A 63-bit seed (``torch.Generator.manual_seed`` takes it on every device) for stream
    ``index`` of a request seeded with ``seed``; any Python int is a valid ``seed``."""
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8,
                             person=b"pagedserve-seed").digest()
    return int.from_bytes(digest, "little") >> 1
