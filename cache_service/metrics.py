"""Prometheus metrics of the kernel cache: store counters read at scrape time, RPC latency, errors.

Counters and gauges come from `ArtifactStore.stats()` through a collector, so the numbers on
/metrics are the same ones GetStats and `python -m cache_service stats` print. Latency and error
counts come from a server interceptor that sees the final status code of every call.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from cache_service.claims import ClaimTable
from cache_service.store import ArtifactStore

# Loopback hits are ~0.3 ms; remote 4 MiB stores tens of ms; a stalled writer seconds.
_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class StoreCollector:
    """Exposes an ArtifactStore's and a ClaimTable's stats as kernel_cache_* metrics."""

    def __init__(self, store: ArtifactStore, claims: ClaimTable) -> None:
        self.store, self.claims = store, claims

    def collect(self) -> Iterator[Any]:
        s = self.store.stats()
        c = self.claims.stats()
        for name, value, doc in (
            ("claims_granted", c.granted, "Single-flight compile claims granted"),
            ("claim_waits", c.waits, "Claim calls that waited on another host's claim"),
            ("claim_wait_hits", c.wait_hits, "Claim waits that ended with the artifact stored"),
            ("claims_expired", c.expired, "Claims whose holder neither stored nor released"),
            ("claims_released", c.released, "Claims given back after a failed compile"),
            ("claims_renewed", c.renewed, "Claims renewed by a holder still compiling"),
        ):
            yield CounterMetricFamily(f"kernel_cache_{name}", doc, value=value)
        yield GaugeMetricFamily("kernel_cache_claims_active", "Live claims", value=c.active)
        yield GaugeMetricFamily("kernel_cache_claim_waiting", "Claim calls waiting now",
                                value=c.waiting)
        for name, value, doc in (
            ("hits", s.hits, "Lookups answered with verified bytes"),
            ("misses", s.misses, "Lookups of absent (or corrupt) entries"),
            ("evictions", s.evictions, "Entries evicted by LRU byte budgets"),
            ("stores", s.stores, "New entries stored"),
            ("corrupt", s.corrupt, "Reads whose bytes failed the digest check (quarantined)"),
            ("digest_conflicts", s.digest_conflicts, "Stores of a known key with another digest"),
            ("compile_seconds_saved", s.compile_seconds_saved, "Compile time hits saved callers"),
            ("bytes_served", s.bytes_served, "Artifact bytes returned by hits"),
        ):
            yield CounterMetricFamily(f"kernel_cache_{name}", doc, value=value)
        yield CounterMetricFamily("kernel_cache_hot_hits", "Hits served from the in-memory tier",
                                  value=s.hot_hits)
        yield GaugeMetricFamily("kernel_cache_hot_bytes", "Bytes in the in-memory tier",
                                value=s.hot_bytes)
        yield GaugeMetricFamily("kernel_cache_hot_budget_bytes", "In-memory tier budget (0 = off)",
                                value=s.hot_budget_bytes)
        yield GaugeMetricFamily("kernel_cache_entries", "Entries held", value=s.entries)
        yield GaugeMetricFamily("kernel_cache_db_file_bytes", "Database + WAL file size",
                                value=s.db_file_bytes)
        held = GaugeMetricFamily("kernel_cache_bytes", "Artifact bytes held", labels=["namespace"])
        budget = GaugeMetricFamily("kernel_cache_budget_bytes", "Byte budget (0 = unbounded)",
                                   labels=["namespace"])
        held.add_metric([""], s.total_bytes)
        budget.add_metric([""], s.budget_bytes)
        for ns in s.namespaces:
            held.add_metric([ns.namespace], ns.total_bytes)
            budget.add_metric([ns.namespace], ns.budget_bytes)
        yield held
        yield budget


class CacheMetrics:
    """Registers the store collector and the RPC metrics in `registry` (default: the global one)."""

    def __init__(self, store: ArtifactStore, claims: ClaimTable,
                 registry: CollectorRegistry = REGISTRY) -> None:
        self.registry = registry
        self.collector = StoreCollector(store, claims)
        registry.register(self.collector)
        self.latency = Histogram("kernel_cache_request_seconds", "RPC latency by method",
                                 ["method"], buckets=_LATENCY_BUCKETS, registry=registry)
        self.errors = Counter("kernel_cache_errors", "RPCs that ended with a non-OK status",
                              ["method", "code"], registry=registry)

    def interceptor(self) -> grpc.ServerInterceptor:
        return _MetricsInterceptor(self)

    def unregister(self) -> None:
        for collector in (self.collector, self.latency, self.errors):
            self.registry.unregister(collector)


class _MetricsInterceptor(grpc.ServerInterceptor):
    def __init__(self, metrics: CacheMetrics) -> None:
        self.metrics = metrics

    def intercept_service(self, continuation: Callable, details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not handler.unary_unary or "KernelCacheService" not in details.method:
            return handler
        inner = handler.unary_unary
        method = details.method.rsplit("/", 1)[-1]
        metrics = self.metrics

        def timed(request: Any, context: grpc.ServicerContext) -> Any:
            start = time.perf_counter()
            try:
                return inner(request, context)
            except Exception:
                code = context.code() or grpc.StatusCode.INTERNAL
                metrics.errors.labels(method, code.name).inc()
                raise
            finally:
                metrics.latency.labels(method).observe(time.perf_counter() - start)

        return grpc.unary_unary_rpc_method_handler(
            timed, handler.request_deserializer, handler.response_serializer)
