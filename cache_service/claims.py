"""Cross-host single-flight compiles: claims with a TTL on cache keys. Never imports grpc.

Hazard: a fleet rollout starts many hosts with empty disks at once; each misses the shared cache
for the same keys and compiles them all (4 hosts compiled 28 modules where 7 were needed). The
fix makes hosts wait for one another, and waiting is the new hazard: a holder that dies or stalls
must not make every other host wait forever, and a waiter must not hold one of the server's
threads that the holder's Store needs to wake it (the sync gRPC server has a fixed pool).
Contract:
- `claim()` answers FOUND (the key is stored), GRANTED (the caller holds the claim now: a first
  claim, a renewal by the same holder, or a takeover of an expired claim) or HELD (another
  holder's claim is live). With `wait_s > 0` a HELD caller waits on a condition for the key's
  store, a release or the claim's expiry, whichever comes first, up to `wait_s`.
- A Store of the key (any holder) ends its claim and wakes its waiters (`stored()`, called by the
  store's listener after the commit). `release()` ends a claim only for its holder.
- At most `max_waiters` calls wait at once; the next HELD caller is answered at once with a
  `retry_after_s`, so waiters can never take every server thread.
- Claims live in memory only. They are advisory: losing them (a restart) costs duplicate
  compiles, never a wrong artifact; the artifact is still verified by digest everywhere.
Cost: a dict lookup under one lock per call; a wake is one `notify_all` per store of a claimed key.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import Generic, TypeVar

from services.common.errors import InvalidArgument

EntryId = tuple[str, str]  # (namespace, key)
T = TypeVar("T")

DEFAULT_MAX_TTL_S = 300.0
DEFAULT_MAX_WAIT_S = 5.0  # one call waits at most this long; clients loop up to their deadline
DEFAULT_MAX_WAITERS = 16  # half the server's default 32 threads
_HOLDER_MAX = 256


class Outcome(Enum):
    GRANTED = "granted"
    FOUND = "found"
    HELD = "held"


@dataclass(frozen=True)
class ClaimResult(Generic[T]):
    outcome: Outcome
    found: T | None = None        # FOUND: what `lookup` returned
    expires_in_s: float = 0.0     # GRANTED: the caller's claim; HELD: the other holder's
    took_over: bool = False       # GRANTED over another holder's expired claim
    retry_after_s: float = 0.0    # HELD at once because every waiting slot was taken
    waited: bool = False          # this call waited on another holder's claim


@dataclass(frozen=True)
class ClaimStats:
    granted: int
    waits: int
    wait_hits: int
    expired: int
    released: int
    active: int
    waiting: int
    renewed: int = 0


@dataclass
class _Claim:
    holder: str
    expires: float  # on the table's clock


class ClaimTable:
    """Claims by (namespace, key); see the module doc for the contract."""

    def __init__(self, max_ttl_s: float = DEFAULT_MAX_TTL_S, max_wait_s: float = DEFAULT_MAX_WAIT_S,
                 max_waiters: int = DEFAULT_MAX_WAITERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_ttl_s <= 0 or max_wait_s < 0 or max_waiters < 0:
            raise ValueError("max_ttl_s must be positive, max_wait_s and max_waiters not negative")
        self.max_ttl_s, self.max_wait_s, self.max_waiters = max_ttl_s, max_wait_s, max_waiters
        self._clock = clock
        self._cond = threading.Condition()
        self._claims: dict[EntryId, _Claim] = {}
        self._waiting = 0
        self._closed = False  # the server is stopping: nobody waits any more
        self._counts = {"granted": 0, "waits": 0, "wait_hits": 0, "expired": 0, "released": 0,
                        "renewed": 0}

    def validate(self, holder: str, ttl_s: float, wait_s: float) -> None:
        """InvalidArgument for a request the table would refuse (checked before anything changes)."""
        if not holder or len(holder) > _HOLDER_MAX:
            raise InvalidArgument(f"holder must be 1..{_HOLDER_MAX} characters (a host/process id)")
        if not 0 < ttl_s <= self.max_ttl_s:
            raise InvalidArgument(f"ttl_s must be in (0, {self.max_ttl_s}] seconds, got {ttl_s}")
        if not 0 <= wait_s <= 3600:
            raise InvalidArgument(f"wait_s must be in [0, 3600] seconds, got {wait_s}")

    def claim(self, entry: EntryId, holder: str, ttl_s: float, wait_s: float,
              lookup: Callable[[], T | None]) -> ClaimResult[T]:
        """FOUND / GRANTED / HELD for `holder` on `entry`; `lookup()` reads the stored artifact.

        `lookup` runs outside the table's lock (it reads SQLite); a store that lands between it
        and the grant only costs the claimant a compile whose Store is an idempotent no-op.
        """
        self.validate(holder, ttl_s, wait_s)
        deadline = self._clock() + min(wait_s, self.max_wait_s)
        waited = False
        while True:
            with self._cond:
                if self._closed:
                    return ClaimResult(Outcome.HELD)
            found = lookup()
            if found is not None:
                if waited:
                    with self._cond:
                        self._counts["wait_hits"] += 1
                return ClaimResult(Outcome.FOUND, found=found, waited=waited)
            with self._cond:
                now = self._clock()
                current = self._claims.get(entry)
                if current is None or current.holder == holder or current.expires <= now:
                    took_over = current is not None and current.holder != holder
                    if took_over:
                        self._counts["expired"] += 1
                    renewal = current is not None and current.holder == holder and \
                        current.expires > now
                    self._claims[entry] = _Claim(holder, now + ttl_s)
                    self._counts["renewed" if renewal else "granted"] += 1
                    return ClaimResult(Outcome.GRANTED, expires_in_s=ttl_s, took_over=took_over,
                                       waited=waited)
                left = deadline - now
                if left <= 0 or self._closed:
                    return ClaimResult(Outcome.HELD, expires_in_s=current.expires - now,
                                       waited=waited)
                if self._waiting >= self.max_waiters:
                    retry = min(left, current.expires - now, 0.25)
                    return ClaimResult(Outcome.HELD, expires_in_s=current.expires - now,
                                       retry_after_s=retry, waited=waited)
                if not waited:
                    self._counts["waits"] += 1
                    waited = True
                self._waiting += 1
                try:
                    # Wakes on a store or release of any claimed key (then re-checks), or when
                    # this claim expires, or at the caller's deadline.
                    self._cond.wait(min(left, current.expires - now))
                finally:
                    self._waiting -= 1

    def stored(self, entry: EntryId) -> None:
        """The key was stored: its claim is over (whoever stored it); wake its waiters."""
        with self._cond:
            if self._claims.pop(entry, None) is not None:
                self._cond.notify_all()

    def release(self, entry: EntryId, holder: str) -> bool:
        """End `holder`'s live claim on `entry` (its compile failed); False if it held none."""
        if not holder:
            raise InvalidArgument("holder is empty")
        with self._cond:
            current = self._claims.get(entry)
            if current is None or current.holder != holder or current.expires <= self._clock():
                return False
            del self._claims[entry]
            self._counts["released"] += 1
            self._cond.notify_all()
            return True

    def close(self) -> None:
        """Wake every waiter and answer HELD from now on (before the store closes under them)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def reap(self) -> int:
        """Drop expired claims nobody asked about again (bounds memory); counted as expired."""
        with self._cond:
            now = self._clock()
            dead = [e for e, c in self._claims.items() if c.expires <= now]
            for e in dead:
                del self._claims[e]
            self._counts["expired"] += len(dead)
            return len(dead)

    def stats(self) -> ClaimStats:
        with self._cond:
            return ClaimStats(active=len(self._claims), waiting=self._waiting, **self._counts)
