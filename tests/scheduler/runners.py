"""Runners for the scheduler tests.

`TokenPoolRunner` is a test double of the model, not a model: it stores each token id in a host
array laid out like the KV pool (block, slot) through the block tables the scheduler hands it,
and computes the next token from what it reads back through the table (a hash of the whole
context, the seed and the position). A wrong table, a block freed while still in use, or a
preemption that loses or reorders a token changes the stream, so the scheduler's invariants are
checked exactly without the cost of a model. The sim-backend tests run the real paged decoder.
"""
from __future__ import annotations

import hashlib

import numpy as np

from gpu_worker.engines.scheduler.kv_pool import KVGeometry
from gpu_worker.engines.scheduler.runner import DecodeRow
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams

VOCAB = 1000


class TokenPoolRunner:
    def __init__(self, geometry: KVGeometry, capacity_blocks: int, prefill_chunk: int) -> None:
        self.geometry, self.prefill_chunk = geometry, prefill_chunk
        self.pool = np.full((capacity_blocks, geometry.block_tokens), -1, np.int64)
        self.prefill_calls: list[int] = []     # chunk lengths, in order
        self.decode_batches: list[int] = []

    def _write(self, table: list[int], position: int, token: int) -> None:
        bt = self.geometry.block_tokens
        self.pool[table[position // bt], position % bt] = token

    def _next(self, table: list[int], upto: int, sampling: SamplingParams) -> int:
        bt = self.geometry.block_tokens
        context = [int(self.pool[table[p // bt], p % bt]) for p in range(upto + 1)]
        assert -1 not in context, "read a position that was never written"
        key = repr((context, sampling.seed if not sampling.greedy else None, upto)).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % VOCAB

    def prefill(self, tokens, start, table, sampling, sample):
        self.prefill_calls.append(len(tokens))
        for i, tok in enumerate(tokens):
            self._write(table, start + i, tok)
        return self._next(table, start + len(tokens) - 1, sampling) if sample else None

    def decode(self, rows: list[DecodeRow]) -> list[int]:
        self.decode_batches.append(len(rows))
        for r in rows:
            self._write(r.table, r.position, r.token)
        return [self._next(r.table, r.position, r.sampling) for r in rows]


def solo(prompt: list[int], max_new: int, sampling: SamplingParams = GREEDY) -> list[int]:
    """The stream a sequence gets alone: the same function, no pool."""
    context, out = list(prompt), []
    for _ in range(max_new):
        key = repr((context, sampling.seed if not sampling.greedy else None,
                    len(context) - 1)).encode()
        tok = int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % VOCAB
        out.append(tok)
        context.append(tok)
    return out


class DeviceTokenRunner(TokenPoolRunner):
    """The token-pool runner with its tokens in the KV pool's own (sim) device memory: token p
    of a sequence is the int64 at the start of slot p % block_tokens of block table[p // bt],
    read and written through the sim backend's view of the pool's mapped pages (after the
    stream drained, so queued swap copies have run). A block swapped to host and back carries
    its tokens only if the copies really moved its bytes; an unmapped block faults."""

    def __init__(self, device, kv, geometry: KVGeometry, capacity_blocks: int,
                 prefill_chunk: int) -> None:
        super().__init__(geometry, capacity_blocks, prefill_chunk)
        self.device, self.kv = device, kv

    def _at(self, block: int, slot: int) -> np.ndarray:
        ptr = self.kv.base + block * self.kv.block_bytes + slot * 8
        return self.device.backend.view(ptr, 8).view(np.int64)

    def prefill(self, tokens, start, table, sampling, sample):
        self.device.synchronize()
        return super().prefill(tokens, start, table, sampling, sample)

    def decode(self, rows):
        self.device.synchronize()
        return super().decode(rows)

    def _write(self, table, position, token) -> None:
        bt = self.geometry.block_tokens
        self._at(int(table[position // bt]), position % bt)[0] = token

    def _next(self, table, upto, sampling) -> int:
        bt = self.geometry.block_tokens
        context = [int(self._at(int(table[p // bt]), p % bt)[0]) for p in range(upto + 1)]
        key = repr((context, sampling.seed if not sampling.greedy else None, upto)).encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=4).digest(), "little") % VOCAB
