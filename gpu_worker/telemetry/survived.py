"""Errors the worker survives on purpose: each logged with context and counted, never silent.

Hazard: a fallback that swallows its cause (a quarantined device range, a CuPy free that did not
reach the arena, NVML missing, a failed metrics scrape) keeps the worker running but changes what
its figures mean, and nothing shows it. Contract: every such `except` calls `survived(site, exc,
**context)`: the counter `gpuplane_worker_survived_errors_total{site}` (process-wide Prometheus
registry, the one the worker's /metrics serves) counts every occurrence, and a WARNING log line with
the context goes out once per site, or per occurrence with `every=True` for rare failures that each
leak something (a quarantined range). The caller keeps its fallback. Cost: a lock-free counter
increment; logging only on the first occurrence per site.
"""
from __future__ import annotations

import logging
import threading

from prometheus_client import REGISTRY, Counter

_log = logging.getLogger(__name__)

SURVIVED = Counter("gpuplane_worker_survived_errors",
                   "Errors the worker survived with a fallback, by site", ["site"])

_logged: set[str] = set()
_lock = threading.Lock()


def survived(site: str, exc: BaseException | None, message: str, *, every: bool = False,
             **context: object) -> None:
    """Count one survived error at `site`; log it (with `context`) the first time, or always."""
    SURVIVED.labels(site=site).inc()
    with _lock:
        first = site not in _logged
        _logged.add(site)
    if first or every:
        error = "" if exc is None else f"{type(exc).__name__}: {exc}"
        _log.warning(message, extra={"site": site, "error": error, **context})


def count(site: str) -> float:
    """Occurrences counted at `site` in this process (for tests and stats)."""
    value = REGISTRY.get_sample_value("gpuplane_worker_survived_errors_total", {"site": site})
    return value or 0.0
