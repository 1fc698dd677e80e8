"""Prometheus view of the worker: read from `WorkerRuntime.stats()` on each scrape, never copied.

Gauges for device truth, the ledger by zone (committed and content) and unaccounted bytes; the
kernel cache, plans, weights, compile and capture counters as the stats report them. A scrape that
finds the runtime closed yields nothing rather than failing the endpoint.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

# Sections of the stats dict exported as gpuplane_worker_<section>_<field>.
SECTIONS = ("kernel_cache", "plans", "weights", "compile", "capture", "arena", "reclaim")


class WorkerCollector(Collector):
    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            stats = self.runtime.stats()
        except Exception:  # noqa: BLE001 - a closed runtime must not break the scrape
            return
        for name in ("device_total_bytes", "device_used_bytes", "ledger_bytes", "unaccounted_bytes"):
            gauge = GaugeMetricFamily(f"gpuplane_worker_{name}", f"Worker: {name}")
            gauge.add_metric([], float(stats.get(name, 0)))
            yield gauge
        committed = GaugeMetricFamily("gpuplane_worker_zone_committed_bytes",
                                      "Granule-rounded bytes booked per zone", labels=["zone"])
        content = GaugeMetricFamily("gpuplane_worker_zone_content_bytes",
                                    "Bytes the contents of a zone need", labels=["zone"])
        for zone, (c, n) in dict(stats.get("zones", {})).items():
            committed.add_metric([zone], float(c))
            content.add_metric([zone], float(n))
        yield committed
        yield content
        for section in SECTIONS:
            for field, value in dict(stats.get(section, {})).items():
                gauge = GaugeMetricFamily(f"gpuplane_worker_{section}_{field}",
                                          f"Worker {section}: {field}")
                gauge.add_metric([], float(value))
                yield gauge
