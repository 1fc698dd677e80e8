"""The workers' client of the kernel cache. The cache is never load-bearing: every failure is a miss.

Hazard: a worker that waits on a slow or dead cache stalls its cold start longer than compiling
would, and a worker that loads unverified bytes executes whatever the network handed it.
Contract: `lookup`/`batch_lookup` never raise and return within their deadline (a lookup
`deadline_s`, a batch 4x that per round trip), or at once while the circuit breaker is open; bytes
are returned only when their SHA-256 matches. `store` never raises and never blocks: it enqueues
on a bounded queue (items and bytes) that one background thread drains; when the queue is full
the store is dropped and counted (the next worker to miss will store it again).
Cost: one RPC per lookup (~0.3 ms on loopback for 256 KiB), one per batch of up to 1024 keys.
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

import grpc
from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cache_service.artifact import Artifact, sha256_hex
from cache_service.breaker import CircuitBreaker
from cache_service.convert import artifact_from_pb, artifact_to_pb
from services.common.channels import open_lean_channel
from services.common.tls import ChannelTLS

log = logging.getLogger(__name__)

SERVICE_NAME = "gpuplane.kernelcache.v1.KernelCacheService"
_BATCH_KEYS = 1024
# Codes that say the peer is unhealthy (trip the breaker); others mean it answered and refused.
_PEER_FAILURES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.UNKNOWN, grpc.StatusCode.CANCELLED}


@dataclass(frozen=True)
class ClaimReply:
    """What Claim answered: outcome "granted" | "found" | "held"; `artifact` is verified."""

    outcome: str
    artifact: Artifact | None = None
    expires_in_s: float = 0.0
    took_over: bool = False
    retry_after_s: float = 0.0
    waited: bool = False  # the service waited on another holder's claim before answering


_CLAIM_OUTCOMES = {pb.CLAIM_OUTCOME_GRANTED: "granted", pb.CLAIM_OUTCOME_FOUND: "found",
                   pb.CLAIM_OUTCOME_HELD: "held"}


class KernelCacheClient:
    """Lookups with a short deadline behind a circuit breaker; fire-and-forget stores."""

    def __init__(self, target: str, write_token: str | None = None, deadline_s: float = 0.25,
                 tracer_provider: Any = None, *, store_deadline_s: float = 5.0,
                 queue_items: int = 256, queue_bytes: int = 64 << 20,
                 failure_threshold: int = 5, cooldown_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic, tls: ChannelTLS | None = None) -> None:
        self.target = target
        self.deadline_s = deadline_s
        self.store_deadline_s = store_deadline_s
        # Lean: the token (every call: it names us) and the trace context go in each call's
        # metadata rather than through a Python channel interceptor per call.
        self._lean = open_lean_channel(target, SERVICE_NAME,
                                       idempotent_methods=("Lookup", "BatchLookup", "GetStats"),
                                       tracer_provider=tracer_provider, tls=tls,
                                       metadata_token=write_token)
        self._channel = self._lean.channel
        self._stub = pb_grpc.KernelCacheServiceStub(self._channel)
        # Connect now, in the background: a cold worker's first BatchLookup comes during model
        # load, and the TCP + HTTP/2 handshake should not be part of that stall. A health check
        # rather than channel_ready_future: the latter polls connectivity on a gRPC thread that
        # raises 'Channel closed!' when close() shuts the channel under it (114 of 200 tries).
        self._connecting = health_pb2_grpc.HealthStub(self._channel).Check.future(
            health_pb2.HealthCheckRequest(), timeout=max(deadline_s, 1.0))
        self.breaker = CircuitBreaker(failure_threshold, cooldown_s, clock)
        self._stats_lock = threading.Lock()
        self._stats = {"hits": 0, "misses": 0, "errors": 0, "timeouts": 0, "corrupt": 0, "stores": 0,
                           "short_circuits": 0, "dropped": 0}
        self._logged_codes: set[grpc.StatusCode] = set()
        # The store queue: (key, namespace, artifact); bounded by items and by bytes.
        self._queue: collections.deque[tuple[str, str, Artifact]] = collections.deque()
        self._queue_items, self._queue_bytes = queue_items, queue_bytes
        self._queued_bytes = 0
        self._in_flight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._worker: threading.Thread | None = None

    # -- lookups ------------------------------------------------------------------------------

    def lookup(self, key: str, namespace: str = "") -> Artifact | None:
        """The verified artifact, or None for a miss, a failure, a timeout or corrupt bytes."""
        try:
            response = self._call(self._stub.Lookup, pb.LookupRequest(key=key, namespace=namespace),
                                  self.deadline_s)
            if response is None or not response.found:
                self._count("misses")
                return None
            artifact = self._verified(key, response.artifact)
            self._count("hits" if artifact is not None else "misses")
            return artifact
        except Exception:
            log.exception("kernel cache lookup failed unexpectedly")
            self._count("errors", "misses")
            return None

    def batch_lookup(self, keys: list[str], namespace: str = "") -> dict[str, Artifact]:
        """Verified artifacts for the keys found; absent keys are misses. One RPC per 1024 keys."""
        found: dict[str, Artifact] = {}
        try:
            pending = list(dict.fromkeys(keys))
            while pending:
                chunk, pending = pending[:_BATCH_KEYS], pending[_BATCH_KEYS:]
                response = self._call(self._stub.BatchLookup,
                                      pb.BatchLookupRequest(keys=chunk, namespace=namespace),
                                      4 * self.deadline_s)
                if response is None or len(response.results) != len(chunk):
                    self._count(*["misses"] * len(chunk))
                    continue
                omitted = []
                for key, result in zip(chunk, response.results):
                    if result.omitted:
                        omitted.append(key)  # exists, did not fit this response: ask again
                        continue
                    artifact = self._verified(key, result.artifact) if result.found else None
                    if artifact is None:
                        self._count("misses")
                    else:
                        self._count("hits")
                        found[key] = artifact
                pending = omitted + pending
        except Exception:
            log.exception("kernel cache batch lookup failed unexpectedly")
            self._count("errors")
        return found

    # -- single-flight claims -------------------------------------------------------------------

    def claim(self, key: str, namespace: str, holder: str, ttl_s: float,
              wait_s: float = 0.0, slack_s: float | None = None) -> ClaimReply | None:
        """Claim `key` for compiling, or wait up to `wait_s` on another holder's claim.

        None when the service cannot answer (down, slow, refused, breaker open, corrupt bytes):
        the caller compiles locally. Returns within `wait_s` plus `slack_s` (default: the
        lookup deadline), the time the answer has to come back after the service's wait.
        """
        try:
            response = self._call(
                self._stub.Claim,
                pb.ClaimRequest(key=key, namespace=namespace, holder=holder, ttl_s=ttl_s,
                                wait_s=wait_s),
                wait_s + (self.deadline_s if slack_s is None else slack_s))
            if response is None:
                return None
            outcome = _CLAIM_OUTCOMES.get(response.outcome)
            if outcome is None:
                self._count("errors")
                return None
            artifact = None
            if outcome == "found":
                artifact = self._verified(key, response.artifact)
                if artifact is None:
                    return None
                self._count("hits")
            return ClaimReply(outcome, artifact, response.expires_in_s, response.took_over,
                              response.retry_after_s, response.waited)
        except Exception:
            log.exception("kernel cache claim failed unexpectedly")
            self._count("errors")
            return None

    def release_claim(self, key: str, namespace: str, holder: str) -> bool:
        """Give a claim back (the compile failed) so waiters need not wait out its TTL."""
        try:
            response = self._call(self._stub.ReleaseClaim,
                                  pb.ReleaseClaimRequest(key=key, namespace=namespace,
                                                         holder=holder),
                                  self.deadline_s)
            return bool(response is not None and response.released)
        except Exception:
            log.exception("kernel cache claim release failed unexpectedly")
            self._count("errors")
            return False

    def _verified(self, key: str, message: pb.Artifact) -> Artifact | None:
        try:
            artifact, claimed = artifact_from_pb(message)
        except Exception:  # noqa: BLE001 - an unknown kind is as good as corrupt
            claimed, artifact = "", None
        if artifact is None or claimed != artifact.sha256:
            log.error("kernel cache returned bytes that fail their digest; treated as a miss",
                      extra={"key": key, "claimed_sha256": claimed,
                             "actual_sha256": sha256_hex(message.data)})
            self._count("corrupt")
            return None
        return artifact

    def _call(self, method: Callable[..., Any], request: Any, timeout: float,
              metadata: tuple[tuple[str, str], ...] = ()) -> Any | None:
        """One RPC through the breaker; None on any failure (counted)."""
        if not self.breaker.allow():
            self._count("short_circuits")
            return None
        try:
            response = method(request, timeout=timeout,
                              metadata=self._lean.metadata(metadata) or None)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                self._count("timeouts")
            else:
                self._count("errors")
            if code in _PEER_FAILURES:
                self.breaker.record_failure()
            else:
                self.breaker.record_success()  # it answered; the request was refused
            if code not in self._logged_codes:  # once per code: a dead cache must not flood logs
                self._logged_codes.add(code)
                log.warning("kernel cache call failed; treating it as a miss", extra={
                    "target": self.target, "code": code.name, "detail": exc.details()
                    if hasattr(exc, "details") else ""})
            return None
        self.breaker.record_success()
        return response

    # -- stores -------------------------------------------------------------------------------

    def store(self, key: str, artifact: Artifact, namespace: str = "") -> None:
        """Queue `artifact` for upload and return at once; dropped (counted) when the queue is full."""
        try:
            with self._cond:
                if self._closing or len(self._queue) >= self._queue_items or \
                        self._queued_bytes + artifact.size > self._queue_bytes:
                    self._count("dropped")
                    return
                self._queue.append((key, namespace, artifact))
                self._queued_bytes += artifact.size
                if self._worker is None:
                    self._worker = threading.Thread(target=self._drain, name="kernel-cache-store",
                                                    daemon=True)
                    self._worker.start()
                self._cond.notify_all()
        except Exception:
            log.exception("kernel cache store could not be queued")
            self._count("dropped")

    def _drain(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._cond.wait()
                if not self._queue:
                    return
                key, namespace, artifact = self._queue.popleft()
                self._queued_bytes -= artifact.size
                self._in_flight += 1
            try:
                request = pb.StoreRequest(key=key, namespace=namespace)
                artifact_to_pb(artifact, into=request.artifact)  # in place: see convert
                if self._call(self._stub.Store, request, self.store_deadline_s) is not None:
                    self._count("stores")
            except Exception:
                log.exception("kernel cache store failed unexpectedly")
                self._count("errors")
            finally:
                with self._cond:
                    self._in_flight -= 1
                    self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait until every queued store has been sent (or failed). False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
        return True

    # -- introspection and lifecycle ----------------------------------------------------------

    def _count(self, *names: str) -> None:
        with self._stats_lock:
            for name in names:
                self._stats[name] += 1

    def stats(self) -> dict[str, int]:
        """hits, misses, errors, timeouts, corrupt, stores, breaker_open (0/1), short_circuits,
        dropped, queued."""
        with self._stats_lock:
            out = dict(self._stats)
        out["breaker_open"] = int(self.breaker.state != "closed")
        with self._cond:
            out["queued"] = len(self._queue) + self._in_flight
        return out

    def close(self, flush_timeout: float = 2.0) -> None:
        """Send what is queued (up to `flush_timeout`), then stop the store thread and the channel."""
        try:
            self.flush(flush_timeout)
            with self._cond:
                self._closing = True
                dropped = len(self._queue)
                self._queue.clear()
                self._queued_bytes = 0
                self._cond.notify_all()
            if dropped:
                with self._stats_lock:
                    self._stats["dropped"] += dropped
            if self._worker is not None:
                self._worker.join(self.store_deadline_s + 1.0)
            self._connecting.cancel()
            self._channel.close()
        except Exception:
            log.exception("kernel cache client close failed")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

