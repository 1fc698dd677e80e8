"""The prefix cache's index: which full KV block holds which token prefix, and which cached
blocks nobody references (LRU), for the paged pool (kv_pool.py) of one decoder model.

Hazard: a block is shared by every sequence whose prompt starts with the same tokens, so its
identity must name everything its K/V depend on: every token before it and in it, their
positions (implied: block i of a chain holds positions [i * B, (i + 1) * B)) and the model.
A block named by its own tokens alone would hand one prompt another prompt's keys.
Contract:
- `chain_hashes`: block i's key is H(key of block i - 1, tokens of block i), the chain rooted
  at H(model identity, block size). Only full blocks have keys; a partial block is never shared.
- `PrefixIndex` maps key <-> block for blocks whose K/V are written (or launched ahead on the
  model's one stream, so every later reader is queued behind the write). A key maps to one
  block: a second block computed for the same key stays unnamed and goes back free.
- Unreferenced named blocks are "parked" in LRU order; `evict_lru` forgets the least recently
  parked. Referenced blocks are never in the LRU (the pool keeps the reference counts).
- Keys are 16-byte BLAKE2b digests: a collision (2^-64 at a billion blocks) is the only way two
  prefixes could share a block.
Cost: one BLAKE2b of B tokens (8 bytes each) per full block, with Python's overhead ~1.2 us (a
2,000-token prompt at 16 tokens per block: 150 us, once per sequence: Sequence keeps its keys);
a lookup is one dict probe per block (the same prompt's 125 keys: ~6 us, per step it waits).
Not thread-safe: the pool's owner (the model's engine thread) calls it under the pool's lock.
"""
from __future__ import annotations

import collections
import hashlib
from collections.abc import Sequence

import numpy as np

DIGEST_BYTES = 16


def root_key(model_identity: str, block_tokens: int) -> bytes:
    """The chain's root: what every block's K/V depend on besides the tokens."""
    return hashlib.blake2b(f"{model_identity}\x00{block_tokens}".encode(),
                           digest_size=DIGEST_BYTES, person=b"gpuplane-kv").digest()


def chain_hashes(parent: bytes, tokens: Sequence[int], block_tokens: int) -> list[bytes]:
    """Keys of the full blocks of `tokens` (a whole number of blocks counted from a block
    boundary), chained from `parent` (the root, or the key of the block before tokens[0])."""
    raw = np.asarray(tokens, dtype="<i8").tobytes()
    step = block_tokens * 8
    keys: list[bytes] = []
    for off in range(0, len(raw) - step + 1, step):
        parent = hashlib.blake2b(parent + raw[off:off + step], digest_size=DIGEST_BYTES).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    """key <-> block for named blocks, and the LRU of the unreferenced ones."""

    def __init__(self) -> None:
        self._block_of: dict[bytes, int] = {}
        self._key_of: dict[int, bytes] = {}
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._key_of)

    def parked(self) -> int:
        """Named blocks that no sequence references: the cached blocks."""
        return len(self._lru)

    def is_named(self, block: int) -> bool:
        return block in self._key_of

    def is_parked(self, block: int) -> bool:
        return block in self._lru

    def key_of(self, block: int) -> bytes:
        """The key a named block holds (the pool hands it to the host tier on eviction)."""
        return self._key_of[block]

    def has(self, key: bytes) -> bool:
        return key in self._block_of

    def lookup(self, keys: Sequence[bytes]) -> list[int]:
        """The blocks of the longest leading run of `keys` that are named."""
        out: list[int] = []
        for key in keys:
            block = self._block_of.get(key)
            if block is None:
                break
            out.append(block)
        return out

    def name(self, block: int, key: bytes) -> bool:
        """`block` (referenced, written) now holds `key`; False when the key is taken already
        or the block has a name (it stays as it was)."""
        if key in self._block_of or block in self._key_of:
            return False
        self._block_of[key] = block
        self._key_of[block] = key
        return True

    def park(self, block: int) -> None:
        """A named block lost its last reference: it is cached, most recently used."""
        assert block in self._key_of, f"KV block {block} parked without a name"
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A cached block is referenced again (a prefix hit)."""
        del self._lru[block]

    def evict_lru(self) -> tuple[int, bytes]:
        """Forget the least recently parked block; returns it (free now) and the key it held."""
        block, _ = self._lru.popitem(last=False)
        key = self._key_of[block]
        self._forget(block)
        return block, key

    def evict(self, block: int) -> None:
        """Forget one parked block (the pool's shrink takes the top ones, whatever their age)."""
        del self._lru[block]
        self._forget(block)

    def clear_parked(self) -> list[tuple[int, bytes]]:
        """Forget every parked block; returns them (free now) with their keys, least recently
        parked first. Referenced names stay."""
        parked = [(block, self._key_of[block]) for block in self._lru]
        for block, _ in parked:
            self.evict(block)
        return parked

    def parked_blocks(self) -> list[int]:
        return list(self._lru)

    def clear(self) -> list[int]:
        """Forget every name (a failed step may have left garbage in launched blocks); returns
        the parked blocks, free now. Referenced blocks stay with their sequences, unnamed."""
        parked = list(self._lru)
        self._lru.clear()
        self._block_of.clear()
        self._key_of.clear()
        return parked

    def _forget(self, block: int) -> None:
        key = self._key_of.pop(block)
        del self._block_of[key]
