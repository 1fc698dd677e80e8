"""Cross-host single flight: claim a missed key at the cache service before compiling it.

Hazard: N hosts that start together miss the shared cache for the same keys and all compile
them. Waiting for another host instead is only safe if the wait is bounded: a dead or stalled
holder, or a cache service that is down or slow, must never hold a cold start for longer than
its deadline, and no answer of the service may stop this host from compiling.
Contract: `acquire(key)` returns within `policy.wait_s` (plus one RPC deadline) with
- `Fetched(artifact)`: another host stored it (the client verified its digest);
- `CLAIMED`: this host holds the claim; compile, then the store of the key ends the claim (or
  `release()` after a failed compile, so waiters need not wait out the TTL);
- `COMPILE`: compile without a claim: the service did not answer, refused, or the wait ran out.
While the holder compiles, `renewing(key)` claims the key again every ttl/3, so a slow compile
(a loaded host) keeps its claim; a holder that dies or hangs stops renewing and its claim
expires after `policy.ttl_s`; the next waiter takes it over.
Cost: one Claim RPC per missed key when nobody holds it, one per ttl/3 of compiling; a waiter
holds one RPC open on the service for up to 5 s at a time (the service caps waiters and tells
the rest to poll).
"""
from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

CLAIM_TTL_ENV = "GPUPLANE_KERNEL_CLAIM_TTL_S"
CLAIM_WAIT_ENV = "GPUPLANE_KERNEL_CLAIM_WAIT_S"
# A module compiles in 0.1-1 s (docs/compile.md); a holder silent for 10x that is dead or stuck.
DEFAULT_TTL_S = 10.0
# Longer than a takeover (TTL) plus a compile, so a dead holder's waiters take over rather
# than all compiling at their deadline; 0 turns single flight off.
DEFAULT_WAIT_S = 20.0
_WAIT_PER_CALL_S = 5.0  # the service's own cap (cache_service.claims.DEFAULT_MAX_WAIT_S)
# Deadline of a Claim call past its wait: room for the answer to come back from a loaded service
# (a waiter whose call times out compiles locally, which is what single flight is there to avoid).
_ANSWER_SLACK_S = 1.0


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected seconds, e.g. 10 or 2.5") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} cannot be negative")
    return value


def _default_holder() -> str:
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class ClaimPolicy:
    ttl_s: float = DEFAULT_TTL_S
    wait_s: float = DEFAULT_WAIT_S  # the most one module's compile waits on other hosts
    holder: str = field(default_factory=_default_holder)

    def __post_init__(self) -> None:
        if self.ttl_s <= 0 or self.wait_s < 0:
            raise ValueError("claim ttl_s must be positive and wait_s not negative")

    @classmethod
    def from_env(cls) -> ClaimPolicy:
        """GPUPLANE_KERNEL_CLAIM_TTL_S and GPUPLANE_KERNEL_CLAIM_WAIT_S, else the defaults."""
        return cls(ttl_s=_env_seconds(CLAIM_TTL_ENV, DEFAULT_TTL_S) or DEFAULT_TTL_S,
                   wait_s=_env_seconds(CLAIM_WAIT_ENV, DEFAULT_WAIT_S))


@dataclass(frozen=True)
class Fetched:
    artifact: Any  # a verified cache_service.artifact.Artifact


CLAIMED = "claimed"
COMPILE = "compile"


class SingleFlight:
    """Claim-or-wait against a KernelCacheClient (`remote`); see the module doc."""

    FIELDS = ("claims_granted", "claim_waits", "claim_wait_hits", "claim_takeovers",
              "claim_wait_timeouts")

    def __init__(self, remote: Any, namespace: str, policy: ClaimPolicy,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        self.remote, self.namespace, self.policy = remote, namespace, policy
        self._clock, self._sleep = clock, sleep
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(self.FIELDS, 0)

    @property
    def enabled(self) -> bool:
        return self.remote is not None and self.policy.wait_s > 0

    def acquire(self, key: str) -> Fetched | str:
        """Fetched(artifact), CLAIMED or COMPILE, within policy.wait_s plus one RPC deadline."""
        if not self.enabled:
            return COMPILE
        deadline = self._clock() + self.policy.wait_s
        waited = False
        while True:
            left = max(0.0, deadline - self._clock())
            try:
                reply = self.remote.claim(key, self.namespace, self.policy.holder,
                                          self.policy.ttl_s, wait_s=min(left, _WAIT_PER_CALL_S),
                                          slack_s=_ANSWER_SLACK_S)
            except Exception:  # noqa: BLE001 - the client promises not to raise; never load-bearing
                reply = None
            if reply is None:
                return COMPILE
            if not waited and (reply.waited or reply.outcome == "held"):
                self._count("claim_waits")
                waited = True
            if reply.outcome == "found":
                if waited:
                    self._count("claim_wait_hits")
                return Fetched(reply.artifact)
            if reply.outcome == "granted":
                self._count("claims_granted", *(("claim_takeovers",) if reply.took_over else ()))
                return CLAIMED
            left = deadline - self._clock()
            if left <= 0:
                self._count("claim_wait_timeouts")
                return COMPILE
            if reply.retry_after_s > 0:  # the service had no waiting slot free: poll
                self._sleep(min(reply.retry_after_s, left))

    @contextlib.contextmanager
    def renewing(self, key: str) -> Iterator[None]:
        """Renew this host's claim on `key` every ttl/3 while the body (the compile) runs."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.policy.ttl_s / 3):
                try:
                    reply = self.remote.claim(key, self.namespace, self.policy.holder,
                                              self.policy.ttl_s, wait_s=0.0)
                except Exception:  # noqa: BLE001 - renewal is best effort; the TTL still holds
                    reply = None
                if reply is not None and reply.outcome != "granted":
                    return  # stored meanwhile, or taken over: nothing left to keep

        thread = threading.Thread(target=renew, name="kernel-claim-renew", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(timeout=self.policy.ttl_s)

    def release(self, key: str) -> None:
        try:
            self.remote.release_claim(key, self.namespace, self.policy.holder)
        except Exception:  # the claim then expires on its own
            log.exception("releasing the compile claim on %s failed; it will expire", key[:16])

    def _count(self, *names: str) -> None:
        with self._lock:
            for name in names:
                self._counts[name] += 1

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
