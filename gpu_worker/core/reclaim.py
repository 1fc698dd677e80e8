"""The worker's one reclaim policy: what gives device memory back, and in which order.

Hazards and contract:
- A refusal (RESOURCE_EXHAUSTED) used to reach the caller while idle models still held plans,
  kernel variants and weights that could go. Every refusal of an arena commit and every load
  admission now comes here first, and so does every governor reclaim ask; a caller sees the
  refusal only once nothing in the order below frees anything.
- The order is fixed (DESIGN 5.3, 6.3), cheapest to rebuild first: completed releases, cached
  prefix KV blocks (no sequence uses them; busy decoders' too, between two of their steps, and
  never a block in use: gpu_worker/engines/scheduler/kv_pool.py), plans and kernel variants of
  idle models, pooled handles, idle models' weights (paged out to their pinned host
  copies through the slots; the next request pages them back in), then the newest sequences' KV
  by preemption (gpu_worker/scheduler: their blocks freed, their pool's free top granules
  decommitted; they recompute by prefill later and stream the same tokens). A cached-only governor
  ask (Reclaim.cached_only) runs only the first two steps: it never preempts a live sequence and
  never touches plans, handles or weights, even when the cached blocks fall short of the ask.
- A busy model is never stripped: a model is idle exactly when its request lock can be taken
  without waiting (`acquire(blocking=False)`), and it is held while its caches or weights go. The
  model asking (whose lock its own thread holds) is therefore never a candidate, and a try-lock
  can never deadlock against a request thread waiting on the arena or the slots.
- No lock of its own is held while it frees (it frees through the arena and the weight slots, whose
  locks a request thread may hold while it waits here): two concurrent reclaims are allowed and
  each measures what it saw freed.
- Each step books what it freed: the drop of the ledger's committed bytes (all zones, or the
  asked zone for a governor ask) once the fenced releases it queued have run, and counts it.
- A refusal that reclaiming everything could not cure (asked > free + what idle models and the
  pool hold + what the governor names as reclaimable on other workers) strips nothing: a request
  that can never fit must change nothing.
- Last in the order, other workers on the device: when the governor's refusal names memory they
  hold (its reclaimable hints; it asks them to give back through their heartbeats), the caller is
  told to retry at intervals for up to `peer_wait_s` (about one of their heartbeats) before the
  refusal goes through, once per refusal episode of a thread, and never while the thread holds a
  capture-gate section (a weight page-in does): load admission probes first, outside any section.
Cost: nothing until a refusal or an ask; then one fenced-release drain per step and per model.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from services.common.errors import ResourceExhausted

PEER_POLLS = 6  # retries spread over one peer wait
# A busy decoder's engine holds its lock for each step and takes it again at once, so a try-lock
# would almost never win: kv_preemption waits this long for the gap between two steps. Bounded,
# so two engines refused at once (each waiting on the other's lock) cannot deadlock.
KV_PREEMPT_LOCK_WAIT_S = 0.5

log = logging.getLogger(__name__)

# completed releases first: they are memory already given up, and cost no cached prefix
STEPS: tuple[str, ...] = ("completed_releases", "cached_kv", "idle_plans", "pooled_handles",
                          "idle_weights", "kv_preemption")
# The zones each step can shrink; an ask for one zone (the governor's) skips steps that cannot.
STEP_ZONES: dict[str, frozenset[str] | None] = {
    "completed_releases": None,  # any zone
    "cached_kv": frozenset({"kv"}),
    "idle_plans": frozenset({"activations", "graphs", "workspace"}),
    "pooled_handles": frozenset({"scratch"}),
    "idle_weights": frozenset({"weights"}),
    "kv_preemption": frozenset({"kv"}),
}
# A cached-only ask (the governor's Reclaim.cached_only: cached KV wanted by another worker's
# refused admission) stops here: never a live sequence's KV, never plans or weights.
CACHED_ONLY_STEPS: tuple[str, ...] = ("completed_releases", "cached_kv")


class IdleCandidate(Protocol):
    """A loaded model as the reclaimer sees it."""

    model_id: str
    lock: threading.Lock      # held by a running request: then the model is busy
    last_used: float          # monotonic time its last request ended (least recent goes first)
    closed: bool              # unloaded since it was listed

    def drop_caches(self) -> int: ...   # plans and kernel variants; returns bytes released
    def page_out(self) -> int: ...      # weights to pinned host; returns bytes released
    def reclaimable_bytes(self) -> int: ...  # what the two above would release now
    # Optional, decoders with a scheduler: preempt the newest running sequence and shrink the KV
    # pool (called with the lock held; False when nothing ran), and the KV bytes that could go;
    # evict cached prefix blocks until `need` bytes could go (lock held or on the engine
    # thread), and what that could release now (readable from any thread).
    # preempt_kv(self) -> bool; kv_bytes(self) -> int; engine_is_current(self) -> bool
    # release_cached_kv(self, need: int) -> int; kv_cached_bytes(self) -> int


@dataclass(frozen=True)
class StepResult:
    step: str
    freed_bytes: int                   # ledger drop measured after the step's releases ran
    models: tuple[str, ...] = ()       # the idle models it took caches or weights from


@dataclass
class ReclaimReport:
    reason: str                        # "refusal" | "governor" | "load"
    zone: str | None                   # None: any zone helps (a refusal of the device budget)
    asked_bytes: int
    cached_only: bool = False          # a cached-only governor ask: the order stopped at cached_kv
    steps: list[StepResult] = field(default_factory=list)

    @property
    def freed_bytes(self) -> int:
        return sum(s.freed_bytes for s in self.steps)


class Reclaimer:
    """One per worker: answers arena refusals, load admission and governor asks in one order."""

    def __init__(self, device, models: Callable[[], list[IdleCandidate]], worker_id: str = "",
                 peer_wait_s: float = 0.0) -> None:
        self._device = device
        self._models = models
        self._worker_id = worker_id
        self._peer_wait_s = peer_wait_s
        self._episode = threading.local()  # per thread: when its current peer wait ends
        self._lock = threading.Lock()  # guards only the counters, never held while freeing
        self.counters: dict[str, int] = {"rounds": 0, "governor_asks": 0, "peer_waits": 0,
                                         **{f"{s}_bytes": 0 for s in STEPS}}
        self.last: ReclaimReport | None = None

    # -- entry points ----------------------------------------------------------------------------
    def on_refusal(self, zone: str, refusal: ResourceExhausted, reason: str = "refusal") -> int:
        """A commit in `zone` was refused; returns the bytes freed, or a positive number when a
        retry is worth it (a peer is giving back), 0 when the refusal should go through.

        Any zone's bytes help a refusal of the device budget, and the caller retries after each
        round, so a zone cap the frees of this round did not relieve gets the next round."""
        nbytes = max(1, refusal.asked_bytes)
        peers = sum(h.bytes for h in refusal.reclaimable if h.worker_id != self._worker_id)
        if max(0, refusal.free_bytes) + self.reclaimable_bytes() + peers < nbytes:
            log.info("reclaim skipped: the refusal cannot be cured",
                     extra={"zone": zone, "asked": nbytes, "free": refusal.free_bytes})
            return 0
        freed = self.reclaim(nbytes, None, reason).freed_bytes
        if freed > 0 or peers <= 0:
            return freed
        return self._wait_for_peers()

    def _wait_for_peers(self) -> int:
        """Sleep one slice of the peer wait and ask for a retry; 0 once the wait is over."""
        # Never sleep inside a capture-gate section (a weight page-in holds one): a capture
        # queued behind it would stall every thread of the worker for the whole wait.
        if self._peer_wait_s <= 0 or self._device.gate.holds_section():
            return 0
        now = time.monotonic()
        ends = getattr(self._episode, "ends", 0.0)
        if now >= ends + self._peer_wait_s:  # a new refusal episode: start a wait
            ends = self._episode.ends = now + self._peer_wait_s
            with self._lock:
                self.counters["peer_waits"] += 1
        if now >= ends:
            return 0
        time.sleep(min(ends - now, self._peer_wait_s / PEER_POLLS))
        return 1

    def reclaimable_bytes(self) -> int:
        """What the order could free now: idle models' caches and weights, pooled handles and
        queued releases (an upper bound; a model that turns busy meanwhile keeps its own)."""
        models = [m for m in self._models() if not m.closed]
        idle = [m for m in models if not m.lock.locked()]
        total = sum(m.reclaimable_bytes() for m in idle)
        total += sum(m.kv_bytes() for m in idle if hasattr(m, "kv_bytes"))
        # a busy decoder's cached prefix blocks can go too (an idle one's are in kv_bytes)
        total += sum(m.kv_cached_bytes() for m in models
                     if m not in idle and hasattr(m, "kv_cached_bytes"))
        pooled = self._device.arena.stats()["pooled_bytes"]
        # Queued releases give back exactly the arena's mappings on their way out (counting
        # any pending release as unbounded made an incurable refusal strip idle models).
        queued = self._device.arena.releasing_bytes()
        return total + pooled + queued

    def commit(self, zone: str, nbytes: int) -> None:
        """Book `nbytes` in `zone` on the ledger directly (a load's admission probe), reclaiming
        and retrying on refusal like an arena commit; raises the last refusal."""
        def attempt() -> None:
            self._device.ledger.commit(zone, nbytes)
        self._device.arena.retry_reclaiming(zone, attempt, reason="load")

    def on_governor_ask(self, zone: str, nbytes: int, cached_only: bool = False) -> None:
        """The governor client's on_reclaim: shrink `zone` by `nbytes` before it gives back.
        `cached_only` (Reclaim.cached_only, the client's on_reclaim_cached): only completed
        releases and cached prefix KV blocks go, even when they fall short of `nbytes`."""
        with self._lock:
            self.counters["governor_asks"] += 1
        self.reclaim(nbytes, zone, "governor", cached_only=cached_only)

    def on_governor_cached_ask(self, zone: str, nbytes: int) -> None:
        """The governor client's on_reclaim_cached: a cached-only ask (see on_governor_ask)."""
        self.on_governor_ask(zone, nbytes, cached_only=True)

    # -- the order -------------------------------------------------------------------------------
    def reclaim(self, need_bytes: int, zone: str | None = None, reason: str = "refusal",
                cached_only: bool = False) -> ReclaimReport:
        """Run the steps in order until `need_bytes` are freed (in `zone`, if given); with
        `cached_only`, only up to the cached KV step (CACHED_ONLY_STEPS)."""
        report = ReclaimReport(reason, zone, need_bytes, cached_only)
        for step in CACHED_ONLY_STEPS if cached_only else STEPS:
            if report.freed_bytes >= need_bytes:
                break
            zones = STEP_ZONES[step]
            if zone is not None and zones is not None and zone not in zones:
                continue
            left = need_bytes - report.freed_bytes
            if step in ("idle_plans", "idle_weights"):
                result = self._per_idle_model(step, left, zone)
            elif step == "kv_preemption":
                result = self._preempt_kv(left, zone)
            elif step == "cached_kv":
                result = self._cached_kv(left, zone)
            else:
                result = self._measured(step, zone, self._step_action(step))
            report.steps.append(result)
        with self._lock:
            self.counters["rounds"] += 1
            for r in report.steps:
                self.counters[f"{r.step}_bytes"] += r.freed_bytes
        self.last = report
        log.info("reclaim", extra={"reason": reason, "zone": zone or "any", "asked": need_bytes,
                                   "cached_only": cached_only, "freed": report.freed_bytes,
                                   "steps": {r.step: r.freed_bytes for r in report.steps}})
        return report

    def _step_action(self, step: str) -> Callable[[], object]:
        arena = self._device.arena
        if step == "pooled_handles":
            return arena.release_pool
        return lambda: None  # completed_releases: the settle after every step does it

    def _per_idle_model(self, step: str, need: int, zone: str | None) -> StepResult:
        """Take from idle models, least recently used first, until `need` is freed."""
        freed, took = 0, []
        candidates = sorted((m for m in self._models() if not m.closed),
                            key=lambda m: m.last_used)
        for m in candidates:
            if freed >= need:
                break
            if not m.lock.acquire(blocking=False):
                continue  # busy: a running request launches on its plans and weights
            try:
                if m.closed:
                    continue
                action = m.drop_caches if step == "idle_plans" else m.page_out
                released = 0

                def run(action=action) -> None:
                    nonlocal released
                    released = action()
                freed += self._measured(step, zone, run).freed_bytes
            finally:
                m.lock.release()
            if released:  # granules shared with a neighbour stay committed: 0 freed is possible
                took.append(m.model_id)
        return StepResult(step, freed, tuple(took))

    def _cached_kv(self, need: int, zone: str | None) -> StepResult:
        """Evict cached prefix blocks from the decoders' pools, least recently used model first,
        until `need` is freed. Busy models too: their cached blocks are no sequence's, and the
        engine gives its lock up between steps (waited for like kv_preemption). On a decoder's
        own engine thread (a refusal of a commit it made mid-step) its pool is called directly:
        the thread is between pool calls (a pool that is growing shrinks nothing)."""
        freed, took = 0, []
        for m in sorted((m for m in self._models() if not m.closed), key=lambda m: m.last_used):
            release = getattr(m, "release_cached_kv", None)
            if release is None or freed >= need or m.kv_cached_bytes() <= 0:
                continue
            own = m.engine_is_current()
            if not own and not m.lock.acquire(timeout=KV_PREEMPT_LOCK_WAIT_S):
                continue
            try:
                if m.closed:
                    continue
                left = need - freed

                def run(release=release, left=left) -> None:
                    release(left)
                got = self._measured("cached_kv", zone, run).freed_bytes
            finally:
                if not own:
                    m.lock.release()
            freed += got
            if got:
                took.append(m.model_id)
        return StepResult("cached_kv", freed, tuple(took))

    def _preempt_kv(self, need: int, zone: str | None) -> StepResult:
        """Preempt the newest sequences of the most recently used decoders, one at a time, until
        `need` is freed. A model whose engine is the calling thread (the refusal may be its own
        pool growing) is skipped: the scheduler preempts within its own batch."""
        freed, took = 0, []
        for m in sorted((m for m in self._models() if not m.closed), key=lambda m: m.last_used,
                        reverse=True):
            preempt = getattr(m, "preempt_kv", None)
            if preempt is None or freed >= need or m.engine_is_current():
                continue
            if not m.lock.acquire(timeout=KV_PREEMPT_LOCK_WAIT_S):
                continue
            try:
                while freed < need and not m.closed:
                    ran = False

                    def run(preempt=preempt) -> None:
                        nonlocal ran
                        ran = preempt()
                    freed += self._measured("kv_preemption", zone, run).freed_bytes
                    if not ran:
                        break
                    if m.model_id not in took:
                        took.append(m.model_id)
            finally:
                m.lock.release()
        return StepResult("kv_preemption", freed, tuple(took))

    def _measured(self, step: str, zone: str | None, action: Callable[[], object]) -> StepResult:
        before = self._committed(zone)
        action()
        self._settle()
        return StepResult(step, max(0, before - self._committed(zone)))

    def _committed(self, zone: str | None) -> int:
        ledger = self._device.ledger
        if zone is None:
            return ledger.total_committed()
        return ledger.snapshot()[zone][0]

    def _settle(self) -> None:
        """Run the fenced releases the step queued (event waits, never a device-wide sync)."""
        queue = self._device.queue
        queue.poll()
        if queue.pending() and not self._device.gate.is_capturing_thread():
            queue.drain()

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)
