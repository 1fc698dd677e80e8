"""What the scheduler needs of a model, and the adapter for runners that compute tokens on the
host.

`StepRunner` is the contract gpu_worker/models/paged.py implements on the device: a running
sequence holds a decode slot whose next input token and block table live with the runner, and a
step is begin_step, [move_slot...], decode, prefill..., end_step. `HostStepRunner` keeps that
state on the host for runners whose `decode(rows)` returns tokens (the scheduler tests'
TokenPoolRunner, bench/scheduler_host_bench.py), with the same rules, so a scheduler that breaks
the protocol breaks those streams too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from gpu_worker.engines.scheduler.kv_pool import KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams


@dataclass(frozen=True)
class DecodeRow:
    """One row of a host-token decode (HostStepRunner's inner runners)."""
    token: int           # the sequence's last token, whose KV this step appends
    position: int        # its position
    table: np.ndarray    # the sequence's block table row (max_blocks int32), valid for the call
    sampling: SamplingParams


class StepHandle(Protocol):
    device_s: float

    def tokens(self) -> np.ndarray:
        """Every slot's token after the step (waits for the step on the device)."""


class StepRunner(Protocol):
    """What the scheduler needs of a model (gpu_worker/models/paged.py on the device).

    A running sequence holds a decode slot (< `slots`); the slot's next input token lives with
    the runner (on the device), written by the sampling of its last prefill chunk or decode."""

    geometry: KVGeometry
    prefill_chunk: int
    slots: int

    def assign(self, slot: int, sampling: SamplingParams) -> None: ...

    def write_table(self, slot: int, row: np.ndarray, lo: int, hi: int) -> None:
        """Entries [lo, hi) of the slot's block table are now row[lo:hi]."""

    def set_token(self, slot: int, token: int) -> None:
        """The slot's next input token is known on the host (a recomputed sequence)."""

    def move_slot(self, src: int, dst: int) -> None:
        """The sequence of slot `src` now holds the free slot `dst`: its next input token, its
        table row (pending entries too) and its sampling knobs go with it. Inside a step,
        before its decode; queued behind the steps before (their tokens reach `dst`)."""

    def begin_step(self) -> None: ...

    def decode(self, rows: list[tuple[int, int]]) -> int:
        """Enqueue one decode of (slot, position) rows; before any prefill of the step.
        Returns the graph rows it runs (real rows and the rungs' padding rows)."""

    def prefill(self, slot: int, tokens: list[int], start: int, table: np.ndarray,
                sampling: SamplingParams, sample: bool) -> int:
        """Enqueue the KV of `tokens` at positions start..; when `sample`, the token after the
        last one becomes the slot's next input. Returns the graph rows it runs (the tokens and
        their bucket's padding rows)."""

    def end_step(self) -> StepHandle: ...


class _HostHandle:
    def __init__(self, tokens: np.ndarray) -> None:
        self._tokens, self.device_s = tokens, 0.0

    def tokens(self) -> np.ndarray:
        return self._tokens


class HostStepRunner:
    """The StepRunner protocol over a runner whose `prefill` and `decode(rows)` return tokens on
    the host (the scheduler tests' TokenPoolRunner, bench/scheduler_host_bench.py's host-only
    runner). It keeps what the device keeps for PagedDecoderModel, with the same rules: table
    entries applied only at the step's flush, padding slots' tokens overwritten with -1 by a
    decode, so a scheduler that breaks the protocol breaks these streams too."""

    def __init__(self, inner, slots: int) -> None:
        self.inner, self.slots = inner, slots
        self.geometry, self.prefill_chunk = inner.geometry, inner.prefill_chunk
        self._tables = np.zeros((slots, self.geometry.max_blocks), np.int32)
        self._tokens = np.zeros(slots, np.int64)
        self._sampling: list[SamplingParams] = [GREEDY] * slots
        self._dirty: dict[int, tuple[np.ndarray, int, int]] = {}
        self._host: dict[int, int] = {}

    def assign(self, slot: int, sampling: SamplingParams) -> None:
        self._sampling[slot] = sampling

    def write_table(self, slot: int, row: np.ndarray, lo: int, hi: int) -> None:
        prev = self._dirty.get(slot)
        if prev is not None:
            lo, hi = min(lo, prev[1]), max(hi, prev[2])
        if hi > lo:
            self._dirty[slot] = (row, lo, hi)

    def set_token(self, slot: int, token: int) -> None:
        self._host[slot] = token

    def move_slot(self, src: int, dst: int) -> None:
        self._tokens[dst], self._tables[dst] = self._tokens[src], self._tables[src]
        self._sampling[dst] = self._sampling[src]
        for pending in (self._dirty, self._host):
            if src in pending:
                pending[dst] = pending.pop(src)

    def _flush(self) -> None:
        for slot, (row, lo, hi) in self._dirty.items():
            self._tables[slot, lo:hi] = row[lo:hi]
        self._dirty.clear()

    def begin_step(self) -> None:
        pass

    def decode(self, rows: list[tuple[int, int]]) -> int:
        self._flush()
        out = self.inner.decode([DecodeRow(int(self._tokens[s]), p, self._tables[s], self._sampling[s])
                                 for s, p in rows])
        top = max(s for s, _ in rows)
        self._tokens[:top + 1] = -1          # padding rows of the rung
        for (s, _), token in zip(rows, out, strict=True):
            self._tokens[s] = token
        return top + 1

    def prefill(self, slot, tokens, start, table, sampling, sample) -> int:
        token = self.inner.prefill(tokens, start, table, sampling, sample)
        if sample:
            self._tokens[slot] = token
        return len(tokens)

    def end_step(self) -> _HostHandle:
        self._flush()
        for slot, token in self._host.items():
            self._tokens[slot] = token
        self._host.clear()
        return _HostHandle(self._tokens.copy())
