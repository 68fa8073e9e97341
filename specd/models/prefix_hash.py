"""The key of a full KV block for prefix caching: a hash chained over every token before it.

Block i's key hashes block i-1's key with block i's tokens, so equal keys mean equal prefixes up to
the block's end (the block's K/V depend on all of them). blake2b, 16 bytes: a prompt crafted to
collide with another user's prefix, and so read its cached K/V, is out of reach, as it is not with
Python's 64-bit hash.
"""

from __future__ import annotations

import hashlib

import numpy as np


def chain_block_hashes(token_ids: list[int], block_size: int, known: list[bytes]) -> list[bytes]:
    """Keys of every full block of token_ids: `known` (the first len(known) keys, computed before)
    extended with the rest. Returns a new list."""
    keys = list(known)
    tokens = np.asarray(token_ids[len(keys) * block_size:(len(token_ids) // block_size) * block_size],
                        dtype=np.int64)
    for block in tokens.reshape(-1, block_size) if tokens.size else ():
        parent = keys[-1] if keys else b""
        keys.append(hashlib.blake2b(parent + block.tobytes(), digest_size=16).digest())
    return keys
