"""Embed batching: requests for one encoder that arrive together run as one padded batch.

Hazard: an encoder serves one request at a time under its model lock, so N concurrent callers
with one short sequence each pay N launches of a mostly idle GPU, one after another; batching
them naively breaks the other way: a lone request held for company, one caller's bad token
failing everyone's batch, a cancelled caller's rows still holding the queue.
Contract:
- callers validate before they submit: only runnable sequences ever join a batch;
- a batch starts when the queue holds `max_batch` sequences (or as many as `max_tokens` padded
  tokens allow), or when the oldest queued sequence has waited `wait_s`, whichever is first: a
  lone request waits at most `wait_s` plus the batch already running;
- sequences are taken first come, first served; a request larger than one batch spans several;
- each caller gets its own rows in order; an error raised running a batch goes to every caller
  with rows in that batch and to no other;
- a caller that cancels leaves at once: its rows not yet taken leave the queue, the results of
  rows already running are dropped;
- no thread of its own: a caller that finds nobody leading leads (gathers and runs batches, its
  own and others') until its own rows are done or it cancels, then hands the lead to the oldest
  waiting caller. Only the leader wakes on an arrival; a waiter wakes when its rows are done, the
  lead is handed to it, or every `poll_s` to see whether its caller cancelled (no thundering herd
  of handler threads on every arrival, which the GIL would serialize).
Cost: at most `wait_s` of added latency for a lone request; the leading caller's thread runs
others' batches before it returns (never beyond its own last batch).
"""
from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from services.common.errors import GpuplaneError

# Upper bounds of the batch-size histogram (sequences per batch); the last bucket is +Inf.
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Cancelled(GpuplaneError):
    """The caller went away (disconnect, cancel, deadline) before its rows were done."""

    code = "CANCELLED"


@dataclass
class EmbedBatchStats:
    """Counters over every batcher of a worker (GetStats `embed_batch`, worker.proto)."""
    batches: int = 0
    requests: int = 0
    sequences: int = 0
    peak_batch_sequences: int = 0
    cancelled_requests: int = 0
    tokens: int = 0           # real tokens embedded
    padded_tokens: int = 0    # tokens the padded plans ran (>= tokens)
    size_counts: dict[int, int] = field(default_factory=dict)   # sequences per batch -> batches
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record_batch(self, lengths: list[int], padded: int) -> None:
        with self._lock:
            self.batches += 1
            self.sequences += len(lengths)
            self.tokens += sum(lengths)
            self.padded_tokens += padded
            self.peak_batch_sequences = max(self.peak_batch_sequences, len(lengths))
            self.size_counts[len(lengths)] = self.size_counts.get(len(lengths), 0) + 1

    def count(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def snapshot(self) -> dict[str, int]:
        """worker.proto EmbedBatchStats field names."""
        with self._lock:
            return {"batches": self.batches, "requests": self.requests,
                    "sequences": self.sequences, "peak_batch_sequences": self.peak_batch_sequences,
                    "cancelled_requests": self.cancelled_requests, "tokens": self.tokens,
                    "padded_tokens": self.padded_tokens}

    def histogram(self) -> tuple[list[tuple[str, int]], int]:
        """Cumulative (upper bound, batches) buckets of sequences per batch, and their sum."""
        with self._lock:
            counts = dict(self.size_counts)
        buckets = [(str(float(b)), sum(n for s, n in counts.items() if s <= b))
                   for b in SIZE_BUCKETS]
        buckets.append(("+Inf", sum(counts.values())))
        return buckets, sum(s * n for s, n in counts.items())


@dataclass(eq=False)
class _Request:
    sequences: list[list[int]]
    arrived: float
    cancelled: Callable[[], bool]
    out: np.ndarray | None = None
    taken: int = 0        # rows [0, taken) are in a batch (running or done)
    done: int = 0         # rows with results
    error: BaseException | None = None
    left: bool = False    # cancelled: its results are dropped
    promoted: bool = False   # the lead was handed to this request's caller
    wake: threading.Event = field(default_factory=threading.Event)

    def pending(self) -> int:
        return len(self.sequences) - self.taken


class EmbedBatcher:
    """Batches `submit` calls for one encoder; `run` embeds one batch of sequences (any lengths)
    and `padded_tokens(count, longest)` says how many tokens its plan for them runs."""

    def __init__(self, run: Callable[[list[list[int]]], np.ndarray],
                 padded_tokens: Callable[[int, int], int], stats: EmbedBatchStats,
                 wait_s: float, max_batch: int, max_tokens: int,
                 clock: Callable[[], float] = time.monotonic, poll_s: float = 0.05) -> None:
        if wait_s < 0 or max_batch < 1 or max_tokens < 1:
            raise ValueError(f"wait_s={wait_s} must be >= 0, max_batch={max_batch} and "
                             f"max_tokens={max_tokens} >= 1")
        self._run, self._padded = run, padded_tokens
        self.stats, self.wait_s, self.max_batch, self.max_tokens = stats, wait_s, max_batch, max_tokens
        self._clock, self._poll_s = clock, poll_s
        self._lock = threading.Lock()
        self._arrival = threading.Condition(self._lock)   # only the leader waits on it
        self._queue: deque[_Request] = deque()
        self._leading = False

    def submit(self, sequences: list[list[int]],
               cancelled: Callable[[], bool] = lambda: False) -> np.ndarray:
        """(len(sequences), hidden) embeddings, once every row has run; raises the error of a
        batch holding one of its rows, or Cancelled when `cancelled()` turns true first."""
        req = _Request(sequences, self._clock(), cancelled)
        self.stats.count("requests")
        with self._lock:
            self._queue.append(req)
            lead = not self._leading
            self._leading = True
            self._arrival.notify()
        while not lead:
            req.wake.wait(self._poll_s)
            with self._lock:
                req.wake.clear()
                if req.promoted:          # before a cancel check: the lead must not be lost
                    req.promoted, lead = False, True
                elif self._finished(req):
                    return self._result(req)
        try:
            return self._lead(req)
        finally:
            with self._lock:
                self._hand_over()

    # -- under self._lock -------------------------------------------------------------------
    def _hand_over(self) -> None:
        """The leader is done: the oldest queued caller leads next (queued = still waiting)."""
        if self._queue:
            nxt = self._queue[0]
            nxt.promoted = True
            nxt.wake.set()
        else:
            self._leading = False

    def _finished(self, req: _Request) -> bool:
        """True when the caller can return (result, error or cancel); drops a cancelled one."""
        if req.error is not None or req.done == len(req.sequences):
            return True
        if not req.left and req.cancelled():
            req.left = True
            self.stats.count("cancelled_requests")
            if req in self._queue:
                self._queue.remove(req)
            req.error = Cancelled("the caller cancelled before its embeddings were done")
        return req.left

    @staticmethod
    def _result(req: _Request) -> np.ndarray:
        if req.error is not None:
            raise req.error
        assert req.out is not None
        return req.out

    def _fit(self) -> list[tuple[_Request, int]]:
        """The next batch, first come first served: (request, rows) slices, without taking."""
        count = longest = 0
        plan: list[tuple[_Request, int]] = []
        for req in self._queue:
            rows = 0
            for seq in req.sequences[req.taken:]:
                wider = max(longest, len(seq))
                if count == self.max_batch or (
                        count and self._padded(count + 1, wider) > self.max_tokens):
                    break
                count, longest, rows = count + 1, wider, rows + 1
            if rows:
                plan.append((req, rows))
            if rows < req.pending():
                break
        return plan

    def _gather(self) -> list[tuple[_Request, int, int]]:
        """Wait for a full batch or the oldest row's deadline; take it: (request, lo, hi)."""
        while True:
            for req in list(self._queue):
                self._finished(req)   # a cancelled request leaves the queue here
            if not self._queue:
                return []
            plan = self._fit()
            rows = sum(n for _, n in plan)
            full = rows == self.max_batch or rows < sum(r.pending() for r in self._queue)
            remaining = self._queue[0].arrived + self.wait_s - self._clock()
            if full or remaining <= 0:
                break
            self._arrival.wait(min(remaining, self._poll_s))
        batch = []
        for req, n in plan:
            batch.append((req, req.taken, req.taken + n))
            req.taken += n
            if not req.pending():
                self._queue.remove(req)
        return batch

    # -- the leader -------------------------------------------------------------------------
    def _lead(self, own: _Request) -> np.ndarray:
        while True:
            with self._lock:
                if self._finished(own):
                    return self._result(own)
                batch = self._gather()
                if not batch:   # own rows all taken: they finish in this thread, so unreachable
                    self._arrival.wait(self._poll_s)
                    continue
            sequences = [s for req, lo, hi in batch for s in req.sequences[lo:hi]]
            try:
                vectors = self._run(sequences)
            except BaseException as exc:  # handed to every caller of this batch, none left waiting
                with self._lock:
                    for req, _, _ in batch:
                        if req.error is None:
                            req.error = exc
                        if req in self._queue:   # its other rows have no caller left
                            self._queue.remove(req)
                        req.wake.set()
                if not isinstance(exc, Exception):   # KeyboardInterrupt, SystemExit: go on up
                    raise
                continue
            lengths = [len(s) for s in sequences]
            self.stats.record_batch(lengths, self._padded(len(lengths), max(lengths)))
            with self._lock:
                row = 0
                for req, lo, hi in batch:
                    if req.out is None:
                        req.out = np.empty((len(req.sequences), vectors.shape[1]), np.float32)
                    req.out[lo:hi] = vectors[row:row + hi - lo]
                    req.done += hi - lo
                    row += hi - lo
                    if req.done == len(req.sequences):
                        req.wake.set()
