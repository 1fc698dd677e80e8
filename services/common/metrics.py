"""Prometheus metrics endpoint. Each service defines its own metrics with prometheus_client."""
from __future__ import annotations

import logging

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


def start_metrics_endpoint(port: int, host: str = "0.0.0.0") -> int | None:
    """Serve /metrics on `port` (0 = disabled). Returns the port, or None when disabled."""
    if port <= 0:
        return None
    start_http_server(port, addr=host)
    log.info("metrics endpoint started", extra={"port": port})
    return port
