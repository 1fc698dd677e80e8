"""Start a kernel cache server: store + servicer + metrics + a maintenance timer on create_server."""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import REGISTRY, CollectorRegistry

from cache_service.access import ACCESS
from cache_service.auth import with_write_token
from cache_service.claims import ClaimTable
from cache_service.config import ServerConfig
from cache_service.malloc import keep_large_blocks_in_heap
from cache_service.metrics import CacheMetrics
from cache_service.servicer import SERVICE_NAME, KernelCacheServicer, add_to_server
from cache_service.store import ArtifactStore
from services.common.authz import table
from services.common.metrics import start_metrics_endpoint
from services.common.server import RunningServer, ServiceRegistration, create_server
from services.common.telemetry import tracer_provider as default_tracer_provider

log = logging.getLogger(__name__)


@dataclass
class CacheServer:
    running: RunningServer
    store: ArtifactStore
    servicer: KernelCacheServicer
    metrics: CacheMetrics

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def address(self) -> str:
        return self.running.address

    def stop(self, grace: float = 5.0) -> None:
        self.running.stop(grace)


class _Maintenance(threading.Thread):
    def __init__(self, store: ArtifactStore, claims: ClaimTable, interval_s: float) -> None:
        super().__init__(name="cache-maintenance", daemon=True)
        self.store, self.claims = store, claims
        self.interval_s, self.stopped = interval_s, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(self.interval_s):
            try:
                self.claims.reap()
                self.store.maintain()
            except Exception:
                log.exception("maintenance pass failed")


def start_cache_server(config: ServerConfig, tracer_provider: TracerProvider | None = None,
                       registry: CollectorRegistry = REGISTRY) -> CacheServer:
    """Open the store (refusing a database another server holds), then serve on `config.listen`."""
    keep_large_blocks_in_heap()  # see cache_service.malloc: the largest cost of a hot hit
    store = ArtifactStore(config.db, config.store)
    claims = ClaimTable(max_ttl_s=config.max_claim_ttl_s, max_wait_s=config.max_claim_wait_s,
                        max_waiters=config.max_claim_waiters)
    store.add_store_listener(claims.stored)
    metrics = CacheMetrics(store, claims, registry)
    servicer = KernelCacheServicer(store, claims)
    try:
        running = create_server(
            config.listen,
            [ServiceRegistration(SERVICE_NAME, servicer, add_to_server)],
            tracer_provider or default_tracer_provider("kernel-cache"),
            extra_interceptors=[metrics.interceptor()],
            security=with_write_token(config.security, config.write_token),
            access=table(SERVICE_NAME, ACCESS),
        )
    except BaseException:
        metrics.unregister()
        store.close()
        raise
    maintenance = _Maintenance(store, claims, config.maintenance_s)
    maintenance.start()
    if config.metrics_port:
        start_metrics_endpoint(config.metrics_port)
    # Order matters: stop the timer before closing the store it writes to.
    # Claim waiters still blocked (a stop with little grace) are woken before the store closes.
    running.on_stop += [maintenance.stopped.set, maintenance.join, claims.close, store.close,
                        metrics.unregister]
    log.info("kernel cache serving", extra={
        "port": running.port, "db": str(config.db), "budget_bytes": config.store.budget_bytes,
        "namespace_budgets": dict(config.store.namespace_budgets),
        "writes_need_token": config.write_token is not None,
        "tls": config.security.tls is not None})
    return CacheServer(running=running, store=store, servicer=servicer, metrics=metrics)
