"""Iteration-level (continuous) batching for one decoder model: FCFS admission, chunked prefill
sharing each step's token budget with the decodes, recompute preemption, and steps that overlap
with the device. Backend-independent (no grpc, no device calls: the runner and the pool make them).

Hazard: one model, many streams. A stream must never stall behind another's long prompt, a
cancelled or finished stream must give its KV back at once, running out of KV blocks must never
be an OOM, and the host must not sit between two steps on the device. Contract, per step
(`step()`), under the model's request lock:
1. reap: cancelled sequences (client gone, deadline passed) leave and free their blocks;
2. the running batch, oldest first: a decoding sequence reserves one position (none once it has
   launched its last token); a reservation that finds no block preempts the newest running
   sequence (blocks freed, to the front of the waiting queue). With the host KV tier
   (kv_swap.py) its blocks are first copied to pinned host when the copies cost less than the
   prefill they save (measured rates) and the host budget holds them, and copied back into
   fresh blocks when it is readmitted; else it recomputes its prompt and generated tokens by
   prefill later. Either way its stream continues with the tokens it would have produced:
   greedy, or sampling keyed by (seed, position);
3. prefill: what is left of `max_step_tokens` after the decode rows is shared by the prefilling
   sequences and the waiting ones admitted now (FCFS, while the batch bound and free blocks
   allow; admission never preempts), by `prefill_order`: "shortest" (the default) gives the
   oldest prompt its floor of `min_prefill_share` tokens, then the shortest remaining prompts
   what they need (`shortest_first_shares`; admission may pass over a longer waiting one);
   "fair" shares max-min fairly over the FCFS prefix whose floors fit (`prefill_shares`). Each
   gets at most one chunk: a short prompt arriving behind a long one gets its whole prompt in
   the next step instead of waiting for the long one's last chunk. With the prefix cache on
   (the default) an admitted sequence first takes, shared, every cached full block of its
   prefix (kv_pool.py, prefix_cache.py) and prefills from the first block not cached; each
   block a prefill chunk completes is named for later sequences at its launch, whatever the
   chunk boundaries, and cached when its last sequence ends;
4. launch: one batched decode over the decoding sequences' slots, then the prefill chunks, then
   the readback of every slot's token (StepRunner.end_step);
5. complete: with `overlap` (the default) the tokens read back are the previous step's, read
   after this step was launched, so the device runs step n+1 while the host streams step n's
   tokens and plans n+2; without it, this step's.
The sampled token of step n is step n+1's input on the device (the runner's decode slots), so a
decode needs nothing from the host but positions. Stops are known one step late: a sequence
whose step-n token is a stop id was already launched in step n+1; that speculative token is
dropped and its KV write went to a block the sequence still held (blocks are freed only on the
host, after the launch, and every later use of the block is queued behind it on the one
stream). `max_new_tokens` is known ahead and never launches a token too many. A cancelled or
preempted sequence's token in flight is dropped the same way (rows carry the sequence's epoch).
Overlapped and serial steps give the same tokens (tests/scheduler/test_overlap.py).
Cost: per step, host work in the number of rows and the table entries that changed, never in
context length; one pinned upload, one graph replay per decode group and per prefill chunk, one
pinned readback and one event wait (no device-wide synchronize).
"""
from __future__ import annotations

import collections
import contextlib
import heapq
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from gpu_worker.config import DEFAULT_MIN_PREFILL_SHARE, DEFAULT_PREFILL_ORDER, PREFILL_ORDERS
from gpu_worker.engines.scheduler.histogram import STEP_BUCKETS, Histogram
from gpu_worker.engines.scheduler.kv_demote import COUNTERS as HOST_COUNTERS
from gpu_worker.engines.scheduler.kv_demote import HostPrefixCache
from gpu_worker.engines.scheduler.kv_pool import BlockTable, KVBlockPool
from gpu_worker.engines.scheduler.kv_swap import KVSwap, SwapFailed, SwappedKV, swap_is_cheaper
from gpu_worker.engines.scheduler.prefix_cache import chain_hashes, root_key
from gpu_worker.engines.scheduler.runner import HostStepRunner, StepHandle, StepRunner
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.scheduler.shares import prefill_shares, shortest_first_shares
from services.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted

_END = object()


class EventSink(Protocol):
    """Where the engine thread puts a stream's items: tokens (int), then an error (an
    exception) or the end marker. `put` must never block the engine."""

    def put(self, item: object) -> None: ...


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
    computed: int = 0                        # positions whose KV is in the pool or launched
    state: str = "waiting"                   # waiting | running | finished
    slot: int = -1                           # the runner's decode slot while running
    prefilled: bool = False                  # (re)prefill launched to the end: it decodes
    pending: int = 0                         # tokens launched, not yet read back
    epoch: int = 0                           # +1 per preemption: drops its tokens in flight
    finish_reason: str = ""
    submitted: float = field(default_factory=time.monotonic)
    admitted_step: int = -1                  # the step that first admitted it
    token_steps: list[int] = field(default_factory=list)   # the step that produced each token
    preemptions: int = 0
    last_token_at: float = 0.0
    keys: list[bytes] = field(default_factory=list)   # prefix-cache keys of its first full blocks
    swapped: SwappedKV | None = None         # preempted with its KV on the host (kv_swap.py)
    _events: queue.Queue | EventSink = field(default_factory=queue.Queue)
    _cancel: threading.Event = field(default_factory=threading.Event)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.generated

    def token_slice(self, lo: int, hi: int) -> list[int]:
        """tokens[lo:hi] without building the whole context."""
        p = len(self.prompt)
        if hi <= p:
            return self.prompt[lo:hi]
        if lo >= p:
            return self.generated[lo - p:hi - p]
        return self.prompt[lo:] + self.generated[:hi - p]

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
        return self.prefilled

    @property
    def launched(self) -> int:
        """Tokens produced or in flight: at max_new_tokens nothing more is launched."""
        return len(self.generated) + self.pending

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


@dataclass(eq=False)
class _Launched:
    """A step on the device: its handle and the (sequence, epoch, slot) rows whose tokens it
    makes (the slot at launch: a sequence may move to a lower slot before it is read back)."""

    handle: StepHandle
    rows: list[tuple[Sequence, int, int]]
    step: int
    prefill_tokens: int = 0
    decode_rows: int = 0
    chunks: tuple[int, ...] = ()      # the prefill chunks' lengths, in launch order
    graph_rows: int = 0               # decode graph rows run: decode rows + the rungs' padding
    chunk_rows: tuple[int, ...] = ()  # each chunk's graph rows: its tokens + its bucket's padding


def trace_record(batch: _Launched, host_s: float, wait_s: float) -> dict[str, object]:
    """A read-back step as one --step-trace record: its composition (decode rows, prefill chunk
    lengths and graph rows), its device span, and the engine iteration that read it back (host
    work, wait). With overlap that iteration launched the next step: its host time is the next
    step's."""
    return {"step": batch.step, "decode_rows": batch.decode_rows,
            "decode_graph_rows": batch.graph_rows, "chunks": list(batch.chunks),
            "chunk_rows": list(batch.chunk_rows),
            "device_us": round(batch.handle.device_s * 1e6), "host_us": round(host_s * 1e6),
            "wait_us": round(wait_s * 1e6)}


class Scheduler:
    """The engine of one model. `thread=True`: a daemon thread steps while there is work;
    `thread=False`: the caller calls `step()` (deterministic tests)."""

    def __init__(self, runner: StepRunner, pool: KVBlockPool, *, max_batch_size: int = 64,
                 max_step_tokens: int = 2048, max_queued: int = 1024,
                 eos_token_ids: tuple[int, ...] = (),
                 model_lock: contextlib.AbstractContextManager | None = None,
                 pin: Callable[[], contextlib.AbstractContextManager] | None = None,
                 settle: Callable[[], None] | None = None,
                 thread: bool = True, name: str = "model", overlap: bool = True,
                 min_prefill_share: int = DEFAULT_MIN_PREFILL_SHARE,
                 prefill_order: str = DEFAULT_PREFILL_ORDER,
                 prefix_cache: bool = True, prefix_key: str = "",
                 kv_swap: KVSwap | None = None, prefill_tokens_per_s: float = 0.0,
                 kv_demote: bool = True,
                 step_trace: Callable[[dict[str, object]], None] | None = None) -> None:
        for flag, value in (("max_batch_size", max_batch_size), ("max_step_tokens", max_step_tokens),
                            ("max_queued", max_queued), ("min_prefill_share", min_prefill_share)):
            if value < 1:
                raise InvalidArgument(f"{flag} must be >= 1, got {value}")
        if prefill_order not in PREFILL_ORDERS:
            raise InvalidArgument(f"prefill_order must be {' or '.join(PREFILL_ORDERS)}, "
                                  f"got {prefill_order!r}")
        if max_step_tokens < max_batch_size:
            # a full batch of decodes would leave no budget for a prefilling member: it starves
            raise InvalidArgument(f"max_step_tokens ({max_step_tokens}) must be at least "
                                  f"max_batch_size ({max_batch_size})")
        if not prefill_tokens_per_s >= 0 or prefill_tokens_per_s == float("inf"):
            raise InvalidArgument(f"prefill_tokens_per_s must be a finite number >= 0 (0: the "
                                  f"rate this scheduler measures), got {prefill_tokens_per_s}")
        if not hasattr(runner, "begin_step"):      # a host-token runner (tests, host bench)
            runner = HostStepRunner(runner, max_batch_size)
        if runner.slots < max_batch_size:
            raise InvalidArgument(f"the model has {runner.slots} decode slots, fewer than "
                                  f"max_batch_size ({max_batch_size})")
        self.runner, self.pool = runner, pool
        self.max_batch_size, self.max_step_tokens = max_batch_size, max_step_tokens
        self.max_queued, self.overlap = max_queued, overlap
        self.min_prefill_share, self.prefill_order = min_prefill_share, prefill_order
        # the prefix cache: `prefix_key` names the model (its K/V depend on its weights)
        self.prefix_cache = prefix_cache
        self._root = root_key(prefix_key or name, runner.geometry.block_tokens)
        # the host KV tier: a preemption swaps when the copies cost less than the recompute
        self.kv_swap = kv_swap
        self.prefill_tokens_per_s = float(prefill_tokens_per_s)   # 0: measured (_observe)
        # prefill tokens per device second of recent read-back steps (prefill only, or mixed)
        self._prefill_obs = {"pure": collections.deque(maxlen=32),
                             "mixed": collections.deque(maxlen=32)}
        self._resumed = False       # a swapped-in decoder's token must be written this step
        # evicted cached prefix blocks demoted to pinned host (kv_demote.py) instead of dropped:
        # with the host KV tier and the prefix cache on, unless `kv_demote` is False
        self.host_cache = (HostPrefixCache(kv_swap, runner.geometry.block_tokens,
                                           self.prefill_rate, reused=pool.reused,
                                           remembered=2 * pool.capacity_blocks)
                           if kv_swap is not None and prefix_cache and kv_demote else None)
        if self.host_cache is not None:
            pool.on_evict = self.host_cache.demote
        self.eos = frozenset(eos_token_ids)
        self._model_lock = model_lock if model_lock is not None else threading.RLock()
        self._pin = pin
        self._settle = settle       # at idle: let the model's fenced releases complete
        self._pinned: contextlib.ExitStack | None = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._running: list[Sequence] = []
        self._ended: list[tuple[Sequence, BaseException | None]] = []
        self._free_slots = list(range(max_batch_size))      # a min-heap: lowest slot first
        self._inflight: _Launched | None = None             # overlap: the step not read back
        self._closed = False
        self.counters = dict.fromkeys(("steps", "preemptions", "prefill_tokens", "decode_tokens",
                                       "peak_batch_size", "finished", "cancelled", "rejected",
                                       "failed", "dropped_tokens", "step_host_us",
                                       "step_device_us", "step_wait_us",
                                       "prefix_cache_hit_tokens", "prefix_cache_queried_tokens",
                                       "kv_swapped_out_blocks", "kv_swapped_in_blocks",
                                       "kv_swap_outs", "kv_swap_ins", "kv_swap_declined",
                                       "kv_swap_refused", "kv_swap_failed", "slot_moves"), 0)
        self.ttft, self.tpot, self.queue_time = Histogram(), Histogram(), Histogram()
        # per engine step: wall time, the host's part (wall less the wait for the device) and
        # the device's span between the step's first and last event (CUDA events on cuda)
        self.step_time = Histogram(STEP_BUCKETS)
        self.step_host_time = Histogram(STEP_BUCKETS)
        self.step_device_time = Histogram(STEP_BUCKETS)
        # one record per read-back step (`trace_record`), for --step-trace
        self.step_trace = step_trace
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
            return bool(self._running or self._waiting or self._inflight)

    def is_engine_thread(self) -> bool:
        return self._thread is threading.current_thread()

    def wait_idle(self, timeout: float) -> bool:
        """Block until the model has no sequences (or `timeout`); whether it is idle."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not (self._running or self._waiting or self._inflight), timeout)

    # -- the engine ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not (self._running or self._waiting or self._inflight):
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
        started = time.perf_counter()
        self._reap()
        if not (self._running or self._waiting or self._inflight):
            self._idle()
            return 0
        if self._pin is not None and self._pinned is None:
            stack = contextlib.ExitStack()
            stack.enter_context(self._pin())
            self._pinned = stack
        step = self.counters["steps"]
        if self.kv_swap is not None:
            with contextlib.suppress(SwapFailed):   # the step itself will meet the fault
                self.kv_swap.collect()      # host slots whose swap-in copies ran
        self._resumed = False
        decodes, prefills = self._plan(step)
        launched: _Launched | None = None
        done = 0
        try:
            # a swapped-in decoder alone still needs the step: its end writes the slot's token
            if decodes or prefills or self._resumed:
                self.counters["steps"] += 1
                launched = self._launch(decodes, prefills, step)
                done = len(decodes) + sum(n for _, n in prefills)
            if self.overlap:   # read step n back only now that step n+1 is queued behind it
                previous, self._inflight = self._inflight, launched
            else:
                previous = launched
            wait = self._complete(previous) if previous is not None else 0.0
        except Exception as exc:
            failed = [s for s, _ in prefills] + decodes
            for batch in (self._inflight, launched):
                if batch is not None:
                    failed += [s for s, _, _ in batch.rows]
            self._inflight = None
            self.pool.forget()      # a launched block may never have been written
            self._unswap_all()      # nor may a block swapped out behind a failed step
            for seq in failed:
                if seq.state == "running":
                    self._finish(seq, "", error=exc)
            raise
        finally:
            if not (self._running or self._waiting or self._inflight):
                self._idle()
        if launched is not None or previous is not None:
            wall = time.perf_counter() - started
            self.step_time.observe(wall)
            self.step_host_time.observe(wall - wait)
            self.counters["step_host_us"] += int((wall - wait) * 1e6)
            self.counters["step_wait_us"] += int(wait * 1e6)
            if self.step_trace is not None and previous is not None:
                self.step_trace(trace_record(previous, wall - wait, wait))
        return done

    def _plan(self, step: int) -> tuple[list[Sequence], list[tuple[Sequence, int]]]:
        """This step's decode rows and prefill chunks (reservations and admissions made)."""
        decodes: list[Sequence] = []
        for seq in list(self._running):          # oldest first; victims come from the end
            if seq.state != "running" or not seq.decoding:
                continue
            if seq.launched >= seq.max_new_tokens:
                continue      # its last token is in flight: it ends when that is read back
            if self._reserve(seq, seq.computed + 1):
                decodes.append(seq)
        decodes = [s for s in decodes if s.state == "running"]   # a later reserve preempted it
        budget = self.max_step_tokens - len(decodes)
        prefilling = [s for s in self._running if s.state == "running" and not s.decoding]
        # candidates: the running prefills, then waiting sequences the batch could admit
        with self._cond:          # submit appends from request threads
            room = self.max_batch_size - len(self._running)
            admit = list(itertools.islice(self._waiting, max(0, min(room, budget))))
        cands = prefilling + admit
        bt = self.runner.geometry.block_tokens
        hits = [0 if s.swapped is not None else self._cached_prefix(s) for s in admit]
        starts = [s.computed for s in prefilling] + [
            s.swapped.positions if s.swapped is not None else h * bt for s, h in zip(admit, hits)]
        shares = self._shares(cands, starts, budget)
        prefills: list[tuple[Sequence, int]] = []
        for seq, n in zip(cands[:len(prefilling)], shares, strict=False):
            if n > 0 and seq.state == "running" and self._reserve(seq, seq.computed + n):
                prefills.append((seq, n))
        passed: list[Sequence] = []     # "shortest": waiting ones with no share, left queued
        for seq, n, hit in zip(admit, shares[len(prefilling):], hits, strict=True):
            swapped = seq.swapped is not None
            resumes_decoding = swapped and seq.swapped.positions == seq.prefill_target
            if n <= 0 and not resumes_decoding:
                if self.prefill_order == "fair":
                    break
                passed.append(seq)
                continue
            with self._cond:    # a preemption above may have put a victim in front of it
                if list(itertools.islice(self._waiting, len(passed) + 1)) != [*passed, seq]:
                    break
            # the hit again, now taken: an allocation above may have evicted part of it
            shared = self.pool.acquire(seq.keys[:hit]) if hit else []
            # the host-resident blocks after the device run leave the host LRU first: the
            # allocation below may demote blocks and drop the oldest host ones
            hosted = (self.host_cache.take(seq.keys[len(shared):hit])
                      if self.host_cache is not None and hit > len(shared) else [])
            start = seq.swapped.positions if swapped else (len(shared) + len(hosted)) * bt
            got = self.pool.allocate(seq.table.geometry.blocks_for(start + n) - len(shared))
            if got is not None and swapped and not self._swap_in(seq, got):
                self.pool.free(got)     # it stays at the head, to be recomputed next step
                break
            if got is None:
                self.pool.free(shared)
                if hosted:
                    self.host_cache.put_back(hosted)
                if not self._running:   # nothing will ever free a block for it
                    self._take_waiting(seq)
                    self._finish(seq, "", error=ResourceExhausted(
                        "no KV blocks can be committed for this request (the kv zone is full)",
                        asked_bytes=seq.table.blocks_needed(n) * self.pool.block_bytes,
                        free_bytes=0, zone="kv"))
                    continue
                break
            if hosted:      # copied in before this step's prefill reads them
                start = (len(shared) + self._promote(hosted, got)) * bt
            self._take_waiting(seq)
            seq.state = "running"
            seq.slot = heapq.heappop(self._free_slots)
            self.runner.assign(seq.slot, seq.sampling)
            self._extend(seq, shared + got)
            seq.computed = start
            if resumes_decoding:    # its next decode appends its last token, as it would have
                seq.prefilled, self._resumed = True, True
                self.runner.set_token(seq.slot, seq.generated[-1])
            elif self.prefix_cache and not swapped:
                self.counters["prefix_cache_queried_tokens"] += seq.prefill_target
                self.counters["prefix_cache_hit_tokens"] += start
            if seq.admitted_step < 0:
                seq.admitted_step = step
                self.queue_time.observe(time.monotonic() - seq.submitted)
            self._running.append(seq)
            if n > 0:
                prefills.append((seq, n))
        # a reservation may have preempted a sequence planned before it
        decodes = [s for s in decodes if s.state == "running"]
        prefills = [(s, n) for s, n in prefills if s.state == "running"]
        self.counters["peak_batch_size"] = max(self.counters["peak_batch_size"], len(decodes))
        return decodes, prefills

    def _shares(self, cands: list[Sequence], starts: list[int], budget: int) -> list[int]:
        """The prefill candidates' tokens this step (their prefill goes on from `starts`), by
        `prefill_order`; each at most one chunk."""
        if not cands:
            return []
        remaining = [s.prefill_target - start for s, start in zip(cands, starts, strict=True)]
        demands = [min(self.runner.prefill_chunk, r) for r in remaining]
        if self.prefill_order == "fair":
            return prefill_shares(demands, budget, self.min_prefill_share)
        # a swapped sequence that resumes decoding needs no prefill: the floor goes to the next
        oldest = min(range(len(cands)), key=lambda i: (demands[i] == 0, cands[i].submitted))
        return shortest_first_shares(demands, remaining, budget, self.min_prefill_share, oldest)

    def _keys(self, seq: Sequence, blocks: int) -> list[bytes]:
        """The prefix-cache keys of `seq`'s first `blocks` blocks (hashed once, then kept: the
        tokens at known positions never change)."""
        have = len(seq.keys)
        if have < blocks:
            bt = self.runner.geometry.block_tokens
            parent = seq.keys[-1] if seq.keys else self._root
            seq.keys += chain_hashes(parent, seq.token_slice(have * bt, blocks * bt), bt)
        return seq.keys[:blocks]

    def _promote(self, hosted: list, got: list[int]) -> int:
        """Copy host-resident prefix blocks into the first of the fresh blocks `got` and name
        them; returns how many were copied (at a refused copy the rest are prefilled)."""
        done = self.host_cache.promote(hosted, got[:len(hosted)])
        for (key, _), block in zip(hosted[:done], got, strict=False):
            self.pool.name(block, key, reused=True)
        return done

    def _cached_prefix(self, seq: Sequence) -> int:
        """Blocks of a waiting sequence's prefill the cache holds now: whole blocks only, and
        never the block of the target's last position. That position must be computed (its
        logits give the first token), and computing it means writing its block, which a shared
        block never is: so a prompt cached to a block boundary re-prefills its last block into
        a fresh one (at most block_tokens positions) rather than copying the shared block on
        the device first (a new runner op that would save those few positions)."""
        if not self.prefix_cache:
            return 0
        bt = self.runner.geometry.block_tokens
        keys = self._keys(seq, (seq.prefill_target - 1) // bt)
        hit = self.pool.match(keys)
        if self.host_cache is not None:     # then the blocks demoted to host (promoted at admission)
            hit += self.host_cache.match(keys[hit:])
        return hit

    def _name_blocks(self, seq: Sequence, lo: int, hi: int) -> None:
        """A prefill chunk launched positions [lo, hi): the blocks it completed get their keys.
        Only prefill-written blocks are named (decode-written ones never are), so a hit replaces
        exactly the computation a miss would run: tokens are the same with caching on and off."""
        bt = self.runner.geometry.block_tokens
        first, last = lo // bt, hi // bt
        if last > first:
            keys = self._keys(seq, last)
            for i in range(first, last):
                self.pool.name(seq.table.blocks[i], keys[i])

    def _extend(self, seq: Sequence, blocks: list[int]) -> None:
        lo = len(seq.table.blocks)
        seq.table.extend(blocks)
        self.runner.write_table(seq.slot, seq.table.row(), lo, lo + len(blocks))

    def _reserve(self, seq: Sequence, positions: int) -> bool:
        """Blocks for `positions` positions of `seq`, preempting the newest running sequences
        while the pool has none; False when `seq` itself was the one preempted."""
        while True:
            need = seq.table.blocks_needed(positions)
            if need == 0:
                return True
            got = self.pool.allocate(need)
            if got is not None:
                self._extend(seq, got)
                return True
            victim = self._running[-1]
            self._preempt(victim)
            if victim is seq:
                return False

    def _release_slot(self, seq: Sequence) -> None:
        if seq.slot >= 0:
            heapq.heappush(self._free_slots, seq.slot)
            seq.slot = -1

    def _preempt(self, seq: Sequence) -> None:
        """To the front of the waiting queue, its blocks freed: swapped to host first when that
        is cheaper than recomputing them (kv_swap.py), else recomputed when it is readmitted."""
        self._running.remove(seq)
        seq.swapped = self._swap_out(seq)    # queued before any later write to the blocks
        self.pool.free(seq.table.clear())
        self._release_slot(seq)
        seq.computed, seq.pending, seq.prefilled = 0, 0, False
        seq.epoch += 1            # its tokens in flight are recomputed, not streamed
        seq.state = "waiting"
        seq.preemptions += 1
        self.counters["preemptions"] += 1
        with self._cond:
            self._waiting.appendleft(seq)

    def _resume_at(self, seq: Sequence) -> int:
        """Positions a swapped sequence keeps: every computed one up to its prefill target
        (its in-flight token is dropped, as for a recompute, and its next decode appends its
        last token again). Before its first token is known the last prompt position is left
        out: it is computed again, by a one-token prefill, for the first token's logits."""
        target = seq.prefill_target if seq.generated else len(seq.prompt) - 1
        return max(0, min(seq.computed, target))

    def prefill_rate(self) -> float | None:
        """Prefill tokens per device second: the configured rate, else the highest measured
        over the last 32 read-back steps that ran only prefill chunks, else over those that
        also decoded (a lower bound: their decode rows' time counts too); None before any.
        The highest, because a step's device span also holds the device's idle gaps (a graph
        captured mid-step, a host behind the device): the fastest step is the closest to the
        prefill's own rate."""
        if self.prefill_tokens_per_s > 0:
            return self.prefill_tokens_per_s
        for kind in ("pure", "mixed"):
            if self._prefill_obs[kind]:
                return max(self._prefill_obs[kind])
        return None

    def _observe(self, batch: _Launched) -> None:
        """A read-back step's prefill tokens over its device span, for `prefill_rate`."""
        if batch.prefill_tokens and batch.handle.device_s > 0:
            kind = "mixed" if batch.decode_rows else "pure"
            self._prefill_obs[kind].append(batch.prefill_tokens / batch.handle.device_s)

    def _swap_out(self, seq: Sequence) -> SwappedKV | None:
        """The preempted `seq`'s leading blocks copied to pinned host, when the copies cost
        less than the prefill a recompute runs and the host budget holds them; else None."""
        if self.kv_swap is None:
            return None
        positions = self._resume_at(seq)
        blocks = seq.table.blocks[:seq.table.geometry.blocks_for(positions)]
        nbytes = len(blocks) * self.pool.block_bytes
        if not swap_is_cheaper(nbytes, positions, self.kv_swap.rates, self.prefill_rate()):
            self.counters["kv_swap_declined"] += 1
            return None
        try:
            rec = self.kv_swap.swap_out(blocks, positions)
        except SwapFailed:
            self.counters["kv_swap_failed"] += 1
            return None
        if rec is None and self.host_cache is not None and self.host_cache.make_room(nbytes):
            try:        # demoted prefix blocks made room: a swapped sequence goes first
                rec = self.kv_swap.swap_out(blocks, positions)
            except SwapFailed:
                self.counters["kv_swap_failed"] += 1
                return None
        if rec is None:
            self.counters["kv_swap_refused"] += 1      # the pinned host budget is full
            return None
        self.counters["kv_swap_outs"] += 1
        self.counters["kv_swapped_out_blocks"] += len(blocks)
        return rec

    def _swap_in(self, seq: Sequence, got: list[int]) -> bool:
        """Queue `seq`'s host copy into the first of its fresh blocks `got`; False when the
        copy failed (the sequence then is a plain preempted one: it recomputes)."""
        rec, seq.swapped = seq.swapped, None
        assert rec is not None
        try:
            self.kv_swap.swap_in(rec, got[:rec.blocks])
        except SwapFailed:
            self.counters["kv_swap_failed"] += 1
            return False
        self.counters["kv_swap_ins"] += 1
        self.counters["kv_swapped_in_blocks"] += rec.blocks
        return True

    def _drop_swapped(self, seq: Sequence) -> None:
        """Forget `seq`'s host copy (it recomputes, or it ended): its bytes go once copied."""
        if seq.swapped is not None:
            self.kv_swap.release(seq.swapped)
            seq.swapped = None

    def _unswap_all(self) -> None:
        """A step failed: host copies made behind it may hold unwritten blocks; recompute."""
        for seq in self._all():
            self._drop_swapped(seq)
        if self.host_cache is not None:
            self.host_cache.clear()

    def _take_waiting(self, seq: Sequence) -> None:
        with self._cond:
            self._waiting.remove(seq)

    def _all(self) -> list[Sequence]:
        """Running then waiting (a snapshot: request threads append to the queue)."""
        with self._cond:
            return [*self._running, *self._waiting]

    def _launch(self, decodes: list[Sequence], prefills: list[tuple[Sequence, int]],
                step: int) -> _Launched:
        """Enqueue the step: the decode, then the chunks, then the readback."""
        runner = self.runner
        rows: list[tuple[Sequence, int, int]] = []
        runner.begin_step()
        self._compact_slots()
        graph_rows = 0
        if decodes:
            graph_rows = runner.decode([(s.slot, s.computed) for s in decodes])
            for seq in decodes:
                seq.computed += 1
                seq.pending += 1
                rows.append((seq, seq.epoch, seq.slot))
            self.counters["decode_tokens"] += len(decodes)
        chunk_rows = []
        for seq, n in prefills:
            start = seq.computed
            last = start + n == seq.prefill_target
            fresh = not seq.generated
            chunk_rows.append(runner.prefill(seq.slot, seq.token_slice(start, start + n), start,
                                             seq.table.row(), seq.sampling, last and fresh))
            seq.computed += n
            self.counters["prefill_tokens"] += n
            if self.prefix_cache:
                self._name_blocks(seq, start, start + n)
            if last:
                seq.prefilled = True
                if fresh:
                    seq.pending += 1
                    rows.append((seq, seq.epoch, seq.slot))
                else:   # recomputed: its next decode appends its last known token
                    runner.set_token(seq.slot, seq.generated[-1])
        return _Launched(runner.end_step(), rows, step, sum(n for _, n in prefills), len(decodes),
                         tuple(n for _, n in prefills), graph_rows, tuple(chunk_rows))

    def _compact_slots(self) -> None:
        """Keep the running sequences on the lowest slots: while a free slot lies below the
        highest held one, that slot's sequence moves down. A decode graph's rung covers its
        group's highest decoding slot, so without this a batch's tail of few streams left on
        high slots ran the 64-row graph (9.5 ms a step at 64 streams on the H200 where the
        batch needed 2.5-5). At most one move per slot freed since the last step."""
        held = {s.slot: s for s in self._running if s.slot >= 0}
        while self._free_slots and held and self._free_slots[0] < max(held):
            top = max(held)
            seq, dst = held.pop(top), heapq.heappop(self._free_slots)
            self.runner.move_slot(top, dst)
            seq.slot, held[dst] = dst, seq
            heapq.heappush(self._free_slots, top)
            self.counters["slot_moves"] += 1

    def _complete(self, batch: _Launched) -> float:
        """Read a launched step's tokens back and stream them; returns the seconds waited."""
        t = time.perf_counter()
        tokens = batch.handle.tokens()
        waited = time.perf_counter() - t
        self.step_device_time.observe(batch.handle.device_s)
        self._observe(batch)
        self.counters["step_device_us"] += int(batch.handle.device_s * 1e6)
        for seq, epoch, slot in batch.rows:
            if seq.state != "running" or seq.epoch != epoch:
                self.counters["dropped_tokens"] += 1    # finished, cancelled or preempted since
                continue
            seq.pending -= 1
            self._emit(seq, int(tokens[slot]), batch.step)
        return waited

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
        self._drop_swapped(seq)
        self._release_slot(seq)
        seq.pending = 0           # a token in flight is dropped when its step is read back
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
        if self.kv_swap is not None:      # no sequence is swapped out: idle chunks go
            with contextlib.suppress(SwapFailed):    # a lost context: they stay booked
                self.kv_swap.collect(wait=True)
        with self._cond:
            self._cond.notify_all()     # wait_idle

    def _fail_all(self, exc: BaseException) -> None:
        with self._model_lock:
            self._inflight = None
            self.pool.forget()
            if self.host_cache is not None:
                self.host_cache.clear()
            for seq in self._all():
                self._finish(seq, "", error=exc)
            self._idle()
            self._flush_ended()

    # -- reclaim, stats, close -----------------------------------------------------------------
    def preempt_newest(self) -> bool:
        """Issue 14's last reclaim step, called with the model lock held: preempt the newest
        running sequence and shrink the pool (the victim's named blocks are cached now: the
        shrink evicts them too); False when nothing was running."""
        victim = self._running[-1] if self._running else None
        if victim is not None:
            self._preempt(victim)
        # not demoted: the cached_kv step before this one demoted what paid, and the victim's
        # blocks are on host already when it swapped (else recompute was the cheaper)
        self.pool.shrink(evict_cached=True, demote=False)
        return victim is not None

    def release_cached(self, need_bytes: int) -> int:
        """Reclaim's first KV step, called with the model lock held (or on the engine thread
        between pool calls): evict cached blocks from the pool's top and decommit the granules
        that then hold no used block, until `need_bytes` went; returns the bytes released.
        Never a block in use."""
        return self.pool.shrink(evict_cached=True, need_bytes=max(1, need_bytes))

    def stats(self) -> dict[str, int]:
        """Gauges and counters. Beyond GetStatsResponse.scheduler's fields: `dropped_tokens`
        (speculative tokens of sequences that stopped, were cancelled or preempted one step
        earlier), `slot_moves` (sequences moved to a lower decode slot, `_compact_slots`), `step_host_us` / `step_wait_us` / `step_device_us` (totals over steps: the
        host's work, the host's wait for the device, the device's span), `overlap` (1 when steps
        overlap), `inflight_steps`, `prefix_cache` (1 when on) and the pool's
        `kv_blocks_capacity`, `kv_block_bytes` and `kv_cache_evictions` (cached blocks
        evicted, for a new block or a reclaim). The host KV tier: `kv_swap` (1 when on),
        `kv_swap_host_bytes` (pinned host bytes of this decoder's slab that demoted blocks do
        not hold: its swapped KV and its free slots), `kv_swap_host_free_bytes` (the free
        slots'), `kv_swap_chunks_pinned` (the slab's pinned allocations since the load),
        `kv_swap_outs` / `kv_swap_ins` (sequences), `kv_swap_declined` (preemptions that
        recomputed because that was cheaper, or no prefill rate was known yet),
        `kv_swap_refused` (the host budget was full), `kv_swap_failed` (a copy the device
        refused: recomputed), `kv_swap_host_us` (engine-thread time queueing swaps, the slab's
        growth included), and the rates the rule used: `kv_swap_prefill_tokens_per_s`,
        `kv_swap_h2d_bytes_per_s`, `kv_swap_d2h_bytes_per_s`. Cached prefix blocks on host
        (kv_demote.py): `kv_demote` (1 when on), `kv_host_cached_blocks` / `_bytes` (demoted
        blocks held now: `kv_swap_host_bytes` + `kv_host_cached_bytes` is every byte this
        decoder books in the host budget), `kv_blocks_demoted` / `kv_blocks_promoted`,
        `kv_demote_declined` (dropped: the rule, a capture on this thread, or no free slot
        pinned yet),
        `kv_demote_refused` (dropped: the budget had no room even with no host block left),
        `kv_demote_failed` / `kv_promote_failed` (a copy the device refused: dropped /
        prefilled) and `kv_host_cache_evictions` (host blocks dropped, oldest first, for a
        demotion or a swap-out)."""
        with self._cond:
            running, waiting = len(self._running), len(self._waiting)
        swap, host = self.kv_swap, self.host_cache
        hosted = host.nbytes if host is not None else 0
        return {"running": running, "waiting": waiting, **self.counters, **self.pool.stats(),
                **(host.counters if host is not None else dict.fromkeys(HOST_COUNTERS, 0)),
                "kv_demote": int(host is not None),
                "kv_host_cached_blocks": host.blocks if host is not None else 0,
                "kv_host_cached_bytes": hosted,
                "overlap": int(self.overlap), "inflight_steps": int(self._inflight is not None),
                "prefix_cache": int(self.prefix_cache), "kv_swap": int(swap is not None),
                "kv_swap_host_bytes": swap.host_bytes - hosted if swap is not None else 0,
                "kv_swap_host_us": int(swap.swap_seconds * 1e6) if swap is not None else 0,
                "kv_swap_host_free_bytes": swap.spare_bytes if swap is not None else 0,
                "kv_swap_chunks_pinned": swap.slab.growths if swap is not None else 0,
                "kv_swap_prefill_tokens_per_s": int(self.prefill_rate() or 0),
                "kv_swap_h2d_bytes_per_s": int(swap.rates.h2d_bytes_per_s) if swap else 0,
                "kv_swap_d2h_bytes_per_s": int(swap.rates.d2h_bytes_per_s) if swap else 0}

    def histograms(self) -> dict[str, Histogram]:
        """Latency histograms by Prometheus-style name (seconds)."""
        return {"ttft_seconds": self.ttft, "tpot_seconds": self.tpot,
                "queue_seconds": self.queue_time, "step_seconds": self.step_time,
                "step_host_seconds": self.step_host_time,
                "step_device_seconds": self.step_device_time}

    def close(self, reason: str = "the model was unloaded") -> None:
        """Fail every stream with FAILED_PRECONDITION, stop the engine, give the pool back."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=60)
        with self._model_lock:
            self._inflight = None       # its tokens are nobody's now; settle waits for the stream
            for seq in self._all():
                self._finish(seq, "", error=FailedPrecondition(reason))
            self._idle()
            self._flush_ended()
            if self.host_cache is not None:
                self.pool.on_evict = None
                self.host_cache.clear()
            if self.kv_swap is not None:
                with contextlib.suppress(SwapFailed):   # a lost context: the bytes stay booked
                    self.kv_swap.close()
            self.pool.close()
