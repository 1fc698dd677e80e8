"""Iteration-level (continuous) batching for one decoder model: FCFS, chunked prefill, recompute
preemption. Backend-independent (no grpc, no device calls: the runner and the pool make those).

Hazard: one model, many streams. A stream must never stall behind another's long prompt, a
cancelled or finished stream must give its KV back at once, and running out of KV blocks must
never be an OOM. Contract, per step (`step()`), under the model's request lock:
1. reap: cancelled sequences (client gone, deadline passed) leave and free their blocks;
2. the running batch, oldest first, reserves what this step needs: a decoding sequence one
   position, a prefilling one its next chunk (at most `prefill_chunk` tokens, all chunks within
   `max_step_tokens` less the decode rows). A reservation that finds no block preempts the newest
   running sequence (its blocks freed, to the front of the waiting queue; it recomputes its prompt
   and generated tokens by prefill later, and its stream continues with the tokens it would have
   produced: greedy, or sampling keyed by (seed, position));
3. waiting sequences are admitted, FCFS, while the batch bound, the token budget and free blocks
   allow (admission never preempts);
4. the prefill chunks run, then one batched decode of every decoding sequence.
So a decoding stream advances every step, and a step carries at most one chunk per prefilling
sequence. The waiting queue is bounded: `submit` beyond `max_queued` is RESOURCE_EXHAUSTED.
Cost: one host round trip per prefill chunk and per decode batch of up to 64 rows.
"""
from __future__ import annotations

import collections
import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from gpu_worker.engines.scheduler.histogram import Histogram
from gpu_worker.engines.scheduler.kv_pool import BlockTable, KVBlockPool, KVGeometry
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

MAX_DECODE_ROWS = 64     # the top of the decode ladder; larger batches run as several decodes
_END = object()


@dataclass(frozen=True)
class DecodeRow:
    token: int           # the sequence's last token, whose KV this step appends
    position: int        # its position
    table: np.ndarray    # the sequence's block table row (max_blocks int32), valid for the call
    sampling: SamplingParams


class EventSink(Protocol):
    """Where the engine thread puts a stream's items: tokens (int), then an error (an
    exception) or the end marker. `put` must never block the engine."""

    def put(self, item: object) -> None: ...


class StepRunner(Protocol):
    """What the scheduler needs of a model (gpu_worker/models/paged.py on the device)."""

    geometry: KVGeometry
    prefill_chunk: int

    def prefill(self, tokens: list[int], start: int, table: list[int],
                sampling: SamplingParams, sample: bool) -> int | None:
        """Append the KV of `tokens` at positions start.. and, when `sample`, return the token
        sampled after the last one (keyed by its position)."""

    def decode(self, rows: list[DecodeRow]) -> list[int]:
        """One batched step: the next token of each row."""


@dataclass(eq=False)
class Sequence:
    """One request: its tokens, block table and stream. Engine-thread state but `cancel()`."""

    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    table: BlockTable
    cancelled_fn: Callable[[], bool] = lambda: False
    deadline: float | None = None            # time.monotonic() after which it is cancelled
    generated: list[int] = field(default_factory=list)
    computed: int = 0                        # positions whose KV is in the pool
    state: str = "waiting"                   # waiting | running | finished
    finish_reason: str = ""
    submitted: float = field(default_factory=time.monotonic)
    admitted_step: int = -1                  # the step that first admitted it
    token_steps: list[int] = field(default_factory=list)   # the step that produced each token
    preemptions: int = 0
    last_token_at: float = 0.0
    _events: queue.Queue | EventSink = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    @property
    def last_token(self) -> int:
        return self.generated[-1] if self.generated else self.prompt[-1]

    @property
    def prefill_target(self) -> int:
        """Positions to prefill before decoding: the prompt, or after a preemption every known
        token but the last (which the next decode appends, as it would have)."""
        return len(self.prompt) + max(0, len(self.generated) - 1)

    @property
    def decoding(self) -> bool:
        return bool(self.generated) and self.computed >= self.prefill_target

    def cancel(self) -> None:
        self._cancel.set()

    def is_cancelled(self) -> bool:
        if self._cancel.is_set() or self.cancelled_fn():
            return True
        return self.deadline is not None and time.monotonic() > self.deadline

    def stream(self) -> Iterator[int]:
        """Tokens as the engine produces them; raises the engine's error if the step failed.
        Closing the iterator early cancels the sequence (its blocks go within one step)."""
        try:
            while True:
                item = self._events.get()
                if item is _END:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            if self.state != "finished":
                self.cancel()


class Scheduler:
    """The engine of one model. `thread=True`: a daemon thread steps while there is work;
    `thread=False`: the caller calls `step()` (deterministic tests)."""

    def __init__(self, runner: StepRunner, pool: KVBlockPool, *, max_batch_size: int = 64,
                 max_step_tokens: int = 2048, max_queued: int = 1024,
                 eos_token_ids: tuple[int, ...] = (),
                 model_lock: contextlib.AbstractContextManager | None = None,
                 pin: Callable[[], contextlib.AbstractContextManager] | None = None,
                 settle: Callable[[], None] | None = None,
                 thread: bool = True, name: str = "model") -> None:
        for flag, value in (("max_batch_size", max_batch_size), ("max_step_tokens", max_step_tokens),
                            ("max_queued", max_queued)):
            if value < 1:
                raise InvalidArgument(f"{flag} must be >= 1, got {value}")
        if max_step_tokens < max_batch_size:
            # a full batch of decodes would leave no budget for a prefilling member: it starves
            raise InvalidArgument(f"max_step_tokens ({max_step_tokens}) must be at least "
                                  f"max_batch_size ({max_batch_size})")
        self.runner, self.pool = runner, pool
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.max_queued = max_queued
        self.eos = frozenset(eos_token_ids)
        self._model_lock = model_lock if model_lock is not None else threading.RLock()
        self._pin = pin
        self._settle = settle       # at idle: let the model's fenced releases complete
        self._pinned: contextlib.ExitStack | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._ended: list[tuple[Sequence, BaseException | None]] = []
        self._closed = False
        self.counters = dict.fromkeys(("steps", "preemptions", "prefill_tokens", "decode_tokens",
                                       "peak_batch_size", "finished", "cancelled", "rejected",
                                       "failed"), 0)
        self.ttft, self.tpot, self.queue_time = Histogram(), Histogram(), Histogram()
        self._thread: threading.Thread | None = None
        if thread:
            self._thread = threading.Thread(target=self._loop, name=f"engine-{name}", daemon=True)
            self._thread.start()

    # -- requests ------------------------------------------------------------------------------
    def submit(self, prompt: list[int], max_new_tokens: int, sampling: SamplingParams = GREEDY,
               cancelled: Callable[[], bool] = lambda: False,
               deadline: float | None = None, events: EventSink | None = None) -> Sequence:
        """Queue a request; RESOURCE_EXHAUSTED at once when the waiting queue is full (nothing
        changes), FAILED_PRECONDITION when the scheduler is closed. `events` receives the
        stream's items instead of the sequence's own queue (gpu_worker/core/token_stream.py:
        the engine thread puts, never waits); `Sequence.stream()` then has nothing to read."""
        geo = self.runner.geometry
        if not prompt or max_new_tokens < 1:
            raise InvalidArgument("send a non-empty prompt and max_new_tokens >= 1")
        if len(prompt) + max_new_tokens > geo.max_context:
            raise InvalidArgument(f"prompt of {len(prompt)} tokens + max_new_tokens="
                                  f"{max_new_tokens} exceeds the context of {geo.max_context}")
        need = geo.blocks_for(len(prompt) + max_new_tokens)
        if need > self.pool.capacity_blocks:
            raise ResourceExhausted(
                f"the request needs {need} KV blocks, more than the pool's capacity of "
                f"{self.pool.capacity_blocks} (--kv-pool-bytes)", asked_bytes=need * self.pool.block_bytes,
                free_bytes=self.pool.capacity_blocks * self.pool.block_bytes, zone="kv")
        seq = Sequence(list(prompt), int(max_new_tokens), sampling, BlockTable(geo), cancelled,
                       deadline)
        if events is not None:
            seq._events = events
        with self._cond:
            if self._closed:
                raise FailedPrecondition("the model's scheduler is closed (model unloaded)")
            if len(self._waiting) >= self.max_queued:
                self.counters["rejected"] += 1
                raise ResourceExhausted(
                    f"{len(self._waiting)} requests are already waiting for this model "
                    f"(--max-queued {self.max_queued}); retry later",
                    asked_bytes=0, free_bytes=0, zone="")
            self._waiting.append(seq)
            self._cond.notify_all()
        return seq

    def wake(self) -> None:
        """A cancel happened: let the engine reap it now."""
        with self._cond:
            self._cond.notify_all()

    def busy(self) -> bool:
        with self._cond:
            return bool(self._running or self._waiting)

    def is_engine_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def wait_idle(self, timeout: float) -> bool:
        """Block until the model has no sequences (or `timeout`); whether it is idle."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._running or self._waiting), timeout)

    # -- the engine ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._running or self._waiting):
                    self._cond.wait()
                if self._closed:
                    return
            try:
                self.step()
            except Exception as exc:  # noqa: BLE001 - the failure went to the streams
                # step() failed the affected sequences; a failure outside them (the lock, the
                # pin) fails every sequence so no stream waits forever
                self._fail_all(exc)
            # a waiting head that cannot be admitted while others run: let them finish first
            time.sleep(0)

    def step(self) -> int:
        """One iteration; returns the number of tokens it processed (prefill + decode).

        Streams that ended in the step see their end only after it, once their blocks are back
        and an idle pool has shrunk: a client that saw its stream end sees the memory settled."""
        with self._model_lock:
            try:
                return self._step()
            finally:
                self._flush_ended()

    def _step(self) -> int:
        if self._closed:
            return 0
        self._reap()
        if not (self._running or self._waiting):
            self._idle()
            return 0
        if self._pin is not None and self._pinned is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._pin())
            self._pinned = stack
        step = self.counters["steps"]
        prefills, decodes = self._plan(step)
        if not prefills and not decodes:
            self._idle()
            return 0
        self.counters["steps"] += 1
        done = 0
        try:
            for seq, n in prefills:
                done += self._run_prefill(seq, n, step)
            for i in range(0, len(decodes), MAX_DECODE_ROWS):
                done += self._run_decode(decodes[i:i + MAX_DECODE_ROWS], step)
        except Exception as exc:
            for seq in [s for s, _ in prefills] + decodes:
                if seq.state == "running":
                    self._finish(seq, "", error=exc)
            raise
        finally:
            if not (self._running or self._waiting):
                self._idle()
        return done

    def _plan(self, step: int) -> tuple[list[tuple[Sequence, int]], list[Sequence]]:
        prefills: list[tuple[Sequence, int]] = []
        decodes: list[Sequence] = []
        budget = self.max_step_tokens - sum(1 for s in self._running if s.decoding)
        for seq in list(self._running):          # oldest first; victims come from the end
            if seq.state != "running":
                continue
            if seq.decoding:
                if self._reserve(seq, seq.computed + 1):
                    decodes.append(seq)
                continue
            n = min(self.runner.prefill_chunk, seq.prefill_target - seq.computed, budget)
            if n <= 0:
                continue
            if self._reserve(seq, seq.computed + n):
                prefills.append((seq, n))
                budget -= n
        while len(self._running) < self.max_batch_size and budget > 0:
            with self._cond:          # submit appends from request threads
                if not self._waiting:
                    break
                seq = self._waiting[0]
            n = min(self.runner.prefill_chunk, seq.prefill_target, budget)
            got = self.pool.allocate(seq.table.blocks_needed(n))
            if got is None:
                if not self._running:   # nothing will ever free a block for it
                    self._pop_waiting()
                    self._finish(seq, "", error=ResourceExhausted(
                        "no KV blocks can be committed for this request (the kv zone is full)",
                        asked_bytes=seq.table.blocks_needed(n) * self.pool.block_bytes,
                        free_bytes=0, zone="kv"))
                    continue
                break
            self._pop_waiting()
            seq.table.extend(got)
            seq.state = "running"
            if seq.admitted_step < 0:
                seq.admitted_step = step
                self.queue_time.observe(time.monotonic() - seq.submitted)
            self._running.append(seq)
            prefills.append((seq, n))
            budget -= n
        self.counters["peak_batch_size"] = max(self.counters["peak_batch_size"], len(decodes))
        return prefills, decodes

    def _reserve(self, seq: Sequence, positions: int) -> bool:
        """Blocks for `positions` positions of `seq`, preempting the newest running sequences
        while the pool has none; False when `seq` itself was the one preempted."""
        while True:
            need = seq.table.blocks_needed(positions)
            if need == 0:
                return True
            got = self.pool.allocate(need)
            if got is not None:
                seq.table.extend(got)
                return True
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.pool.free(seq.table.clear())
        seq.computed = 0
        seq.state = "waiting"
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        with self._cond:
            self._waiting.appendleft(seq)

    def _pop_waiting(self) -> Sequence:
        with self._cond:
            return self._waiting.popleft()

    def _all(self) -> list[Sequence]:
        """Running then waiting (a snapshot: request threads append to the queue)."""
        with self._cond:
            return [*self._running, *self._waiting]

    def _run_prefill(self, seq: Sequence, n: int, step: int) -> int:
        start = seq.computed
        last = start + n == seq.prefill_target
        fresh = not seq.generated
        token = self.runner.prefill(seq.tokens[start:start + n], start, seq.table.row(),
                                    seq.sampling, sample=last and fresh)
        seq.computed += n
        self.counters["prefill_tokens"] += n
        if last and fresh:
            self._emit(seq, int(token), step)
        return n

    def _run_decode(self, batch: list[Sequence], step: int) -> int:
        rows = [DecodeRow(s.last_token, s.computed, s.table.row(), s.sampling) for s in batch]
        tokens = self.runner.decode(rows)
        self.counters["decode_tokens"] += len(batch)
        for seq, token in zip(batch, tokens, strict=True):
            seq.computed += 1
            self._emit(seq, int(token), step)
        return len(batch)

    def _emit(self, seq: Sequence, token: int, step: int) -> None:
        now = time.monotonic()
        if not seq.generated:
            self.ttft.observe(now - seq.submitted)
        else:
            self.tpot.observe(now - seq.last_token_at)
        seq.last_token_at = now
        seq.generated.append(token)
        seq.token_steps.append(step)
        seq._events.put(token)
        if token in seq.sampling.stop_token_ids or token in self.eos:
            self._finish(seq, "stop")
        elif len(seq.generated) >= seq.max_new_tokens:
            self._finish(seq, "length")

    def _reap(self) -> None:
        for seq in self._all():
            if seq.is_cancelled():
                self._finish(seq, "cancelled")

    def _finish(self, seq: Sequence, reason: str, error: BaseException | None = None) -> None:
        """Leave the batch now: blocks back to the pool, the stream ended."""
        if seq in self._running:
            self._running.remove(seq)
        with self._cond:
            if seq in self._waiting:
                self._waiting.remove(seq)
        if seq.table.blocks:
            self.pool.free(seq.table.clear())
        seq.state, seq.finish_reason = "finished", reason or "error"
        key = {"cancelled": "cancelled", "": "failed"}.get(reason, "finished")
        self.counters[key] += 1
        self._ended.append((seq, error))

    def _flush_ended(self) -> None:
        """End the streams that finished (after the step's frees and shrink)."""
        ended, self._ended = self._ended, []
        for seq, error in ended:
            if error is not None:
                seq._events.put(error)
            seq._events.put(_END)

    def _idle(self) -> None:
        """No work: unpin the weights (the model is reclaimable again), shrink the pool."""
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        self.pool.shrink()
        if self._settle is not None:
            self._settle()
        with self._cond:
            self._cond.notify_all()     # wait_idle

    def _fail_all(self, exc: BaseException) -> None:
        with self._model_lock:
            for seq in self._all():
                self._finish(seq, "", error=exc)
            self._idle()
            self._flush_ended()

    # -- reclaim, stats, close -----------------------------------------------------------------
    def preempt_newest(self) -> bool:
        """Issue 14's last reclaim step, called with the model lock held: preempt the newest
        running sequence and shrink the pool; False when nothing was running."""
        victim = self._running[-1] if self._running else None
        if victim is not None:
            self._preempt(victim)
        self.pool.shrink()
        return victim is not None

    def stats(self) -> dict[str, int]:
        with self._cond:
            running, waiting = len(self._running), len(self._waiting)
        return {"running": running, "waiting": waiting, **self.counters, **self.pool.stats()}

    def close(self, reason: str = "the model was unloaded") -> None:
        """Fail every stream with FAILED_PRECONDITION, stop the engine, give the pool back."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        with self._model_lock:
            for seq in self._all():
                self._finish(seq, "", error=FailedPrecondition(reason))
            self._idle()
            self._flush_ended()
            self.pool.close()
