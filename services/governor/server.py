"""Assemble a running governor: store, ledger, servicer, expiry sweeper, optional metrics.

The governor is served by the asyncio flavour of the common server (services.common.aio_server):
its calls are short and all go through one lock, so a thread pool only adds hand-offs.
"""
from __future__ import annotations

import pathlib
import threading

from opentelemetry.sdk.trace import TracerProvider

from services.common.aio_server import AioRunningServer, create_aio_server
from services.common.authz import table
from services.common.security import ServerSecurity
from services.common.telemetry import is_recording
from services.common.telemetry import tracer_provider as default_tracer_provider
from services.governor.access import ACCESS
from services.governor.ledger import Ledger
from services.governor.policy import Policy
from services.governor.servicer import MAX_REQUEST_BYTES, SERVICE_NAME, registration
from services.governor.store import Store


def start_governor(listen: str, db: str | pathlib.Path, policy: Policy | None = None,
                   tracer_provider: TracerProvider | None = None,
                   durable: bool = False,
                   security: ServerSecurity | None = None) -> tuple[AioRunningServer, Ledger]:
    """Open the store, load the ledger, serve on `listen`; stop() also ends the sweeper."""
    policy = policy or Policy()
    store = Store(db, durable=durable)
    ledger = Ledger(store, policy)
    provider = tracer_provider or default_tracer_provider("governor")
    service = registration(ledger, traced=is_recording(provider))
    try:
        server = create_aio_server(listen, [service], provider,
                                   security=security, access=table(SERVICE_NAME, ACCESS),
                                   max_receive_bytes=MAX_REQUEST_BYTES)
    except BaseException:
        store.close()
        raise
    stop = threading.Event()

    def sweep() -> None:
        # Expiry also runs before every admission; the sweeper returns a dead worker's memory to
        # the pool even when nobody asks, within a quarter of the TTL (and forgets devices left
        # without a worker for the device TTL).
        while not stop.wait(max(0.05, policy.lease_ttl_s / 4)):
            ledger.expire()

    sweeper = threading.Thread(target=sweep, name="governor-expiry", daemon=True)
    sweeper.start()
    server.on_stop.append(stop.set)
    server.on_stop.append(lambda: sweeper.join(timeout=5))
    server.on_stop.append(service.servicer.close)
    server.on_stop.append(store.close)
    return server, ledger
