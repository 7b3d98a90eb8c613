"""The prefix cache's key: a hash chain over full KV blocks (host only, no jax).

A block's KV depends on every token before it, not only its own, so its key chains in the
parent block's hash; the adapter id is in the key because a LoRA changes K and V. The digest
is blake2b over a fixed-width byte encoding, so it is the same on every host and every Python
run (Python's `hash()` is salted per process) and long enough that collisions do not happen
in practice. The pool still stores each block's full key (parent hash, tokens, adapter) and
compares it on a hit, so two blocks whose digests collide cost a miss, never wrong KV; a wrong
hit would take two different prefixes whose chain digests agree, a blake2b-256 collision.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

BlockHash = bytes

DIGEST_SIZE = 32
ROOT_HASH: BlockHash = bytes(DIGEST_SIZE)  # the parent of a prompt's first block


def hash_block(parent: BlockHash, tokens: Sequence[int], adapter_id: int) -> BlockHash:
    """The chain hash of one block: H(parent, tokens, adapter_id)."""
    # The parent is fixed-width and the token count is encoded, so no two keys share bytes.
    payload = struct.pack(f"<qI{len(tokens)}q", adapter_id, len(tokens), *tokens)
    return hashlib.blake2b(parent + payload, digest_size=DIGEST_SIZE).digest()


def hash_blocks(tokens: Sequence[int], block_size: int, adapter_id: int,
                parent: BlockHash = ROOT_HASH) -> list[BlockHash]:
    """Chain hashes of the full blocks of `tokens` (a partial last block has none yet)."""
    hashes = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hash_block(parent, tokens[start:start + block_size], adapter_id)
        hashes.append(parent)
    return hashes
