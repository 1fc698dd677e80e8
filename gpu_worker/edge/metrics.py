"""Prometheus view of the worker: read from `WorkerRuntime.stats()` on each scrape, never copied.

Gauges for device truth, the ledger by zone (committed and content) and unaccounted bytes; the
kernel cache, plans, weights, compile, capture and Embed batching counters as the stats report
them, and the histogram of sequences per Embed batch. A scrape that cannot read the stats (the
runtime closed, or stats() raised) yields none of these rather than failing the endpoint; the
failure is logged and counted in gpuplane_worker_survived_errors_total{site="metrics_scrape"}
(gpu_worker/telemetry/survived.py), which the same endpoint serves.
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gpu_worker.telemetry.survived import survived

# Sections of the stats dict exported as gpuplane_worker_<section>_<field>.
SECTIONS = ("kernel_cache", "plans", "weights", "compile", "capture", "arena", "reclaim",
            "embed_batch", "scheduler")
# Latency histograms of the decoders' schedulers (gpuplane_worker_scheduler_<name>).
HISTOGRAMS = {"ttft_seconds": "Time from Generate to its first token",
              "tpot_seconds": "Time between consecutive output tokens of a stream",
              "queue_seconds": "Time a Generate request waited before its first step"}


class WorkerCollector(Collector):
    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    def collect(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily]:
        try:
            stats = self.runtime.stats()
        except Exception as exc:  # noqa: BLE001 - a closed runtime must not break the scrape
            survived("metrics_scrape", exc, "worker stats unreadable: this scrape has no worker "
                     "gauges")
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
        batch_stats = getattr(self.runtime, "embed_batch_stats", None)
        if batch_stats is not None:
            buckets, total = batch_stats.histogram()
            sizes = HistogramMetricFamily("gpuplane_worker_embed_batch_sequences",
                                          "Sequences per Embed encoder batch")
            sizes.add_metric([], buckets, float(total))
            yield sizes
        histograms = getattr(self.runtime, "scheduler_histograms", None)
        if histograms is None:
            return
        for name, hist in histograms().items():
            buckets, total = hist.snapshot()
            yield HistogramMetricFamily(f"gpuplane_worker_scheduler_{name}", HISTOGRAMS[name],
                                        buckets=buckets, sum_value=total)
