"""Prometheus view of the worker: read from `WorkerRuntime.stats()` on each scrape, never copied.

Gauges for device truth, the ledger by zone (committed and content) and unaccounted bytes; the
kernel cache, plans, weights, compile, capture and Embed batching counters as the stats report
them, and the histogram of sequences per Embed batch. A scrape that cannot read the stats (the
runtime closed, or stats() raised) yields none of these rather than failing the endpoint; the
failure is logged and counted in gpuplane_worker_survived_errors_total{site="metrics_scrape"}
(gpu_worker/telemetry/survived.py), which the same endpoint serves. The serving metrics carry
vLLM's names with a `gpuplane:` prefix (docs/worker.md lists them).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from gpu_worker.telemetry.survived import survived

# Sections of the stats dict exported as gpuplane_worker_<section>_<field>.
SECTIONS = ("kernel_cache", "plans", "weights", "compile", "capture", "arena", "reclaim",
            "embed_batch", "scheduler")
# Latency histograms of the decoders' schedulers (gpuplane_worker_scheduler_<name>).
HISTOGRAMS = {"ttft_seconds": "Time from Generate to its first token",
              "tpot_seconds": "Time between consecutive output tokens of a stream",
              "queue_seconds": "Time a Generate request waited before its first step",
              "step_seconds": "Wall time of an engine step (host work + waiting for the device)",
              "step_host_seconds": "The engine thread's own work per step (wall less the wait)",
              "step_device_seconds": "The device's span per step (first to last event)"}


# Serving metrics under vLLM's names (vllm:<name> -> gpuplane:<name>), so dashboards built for
# one read the other. Latencies are the edge's (what a client sees, gRPC included); queue time
# and the running/waiting gauges are the schedulers'.
SERVING_HISTOGRAMS = {
    "time_to_first_token_seconds": "Time from a Generate call to its first token message",
    "time_per_output_token_seconds": "Mean time between a stream's output tokens, per stream",
    "e2e_request_latency_seconds": "Time from a Generate call to its end",
}


# The prefix cache and KV tiers (docs/scheduler.md), under GetStatsResponse.scheduler's names.
KV_TIER_COUNTERS = {
    "prefix_cache_hit_tokens": "Prompt tokens whose KV came from cached blocks",
    "prefix_cache_queried_tokens": "Prompt tokens looked up in the prefix cache at admission",
    "kv_swapped_out_blocks": "KV blocks of preempted sequences copied to pinned host",
    "kv_swapped_in_blocks": "KV blocks copied back from pinned host",
    "kv_swap_outs": "Preempted sequences whose KV was swapped out to pinned host",
    "kv_swap_ins": "Sequences whose KV was swapped back in from pinned host",
    "kv_swap_declined": "Preemptions that recomputed: cheaper than the copies, or no prefill rate",
    "kv_swap_refused": "Preemptions that recomputed: the pinned host KV budget was full",
    "kv_swap_failed": "Preemptions that recomputed: the device refused a swap copy",
    "kv_blocks_demoted": "Evicted cached prefix blocks copied to pinned host",
    "kv_blocks_promoted": "Host-cached prefix blocks copied back for a prefix hit",
}
KV_TIER_GAUGES = {
    "kv_blocks_cached": "Committed KV blocks no sequence uses, kept for prefix hits",
    "kv_swap_host_bytes": "Pinned KV slab bytes demoted blocks do not hold: swapped-out KV and "
                          "free slots",
    "kv_swap_host_budget_bytes": "The worker's pinned host budget for swapped KV (0: no host tier)",
    "kv_host_cached_blocks": "Cached prefix blocks held on pinned host",
    "kv_host_cached_bytes": "Pinned host bytes cached prefix blocks hold now",
}


def _kv_tiers(scheduler: dict[str, Any]) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
    for name, text in KV_TIER_COUNTERS.items():
        counter = CounterMetricFamily(f"gpuplane:{name}", text)
        counter.add_metric([], float(scheduler.get(name, 0)))
        yield counter
    for name, text in KV_TIER_GAUGES.items():
        gauge = GaugeMetricFamily(f"gpuplane:{name}", text)
        gauge.add_metric([], float(scheduler.get(name, 0)))
        yield gauge


class WorkerCollector(Collector):
    """`streams`: the edge's StreamStats (gpu_worker/core/token_stream.py), when served."""

    def __init__(self, runtime: Any, streams: Any = None) -> None:
        self.runtime = runtime
        self.streams = streams

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
        scheduler = dict(stats.get("scheduler", {}))
        for name, field, text in (("num_requests_running", "running",
                                   "Generate requests in a decoder's running batch"),
                                  ("num_requests_waiting", "waiting",
                                   "Generate requests queued for a decoder's batch")):
            gauge = GaugeMetricFamily(f"gpuplane:{name}", text)
            gauge.add_metric([], float(scheduler.get(field, 0)))
            yield gauge
        yield from _kv_tiers(scheduler)
        histograms = getattr(self.runtime, "scheduler_histograms", None)
        if histograms is not None:
            merged = histograms()
            for name, hist in merged.items():
                buckets, total = hist.snapshot()
                yield HistogramMetricFamily(f"gpuplane_worker_scheduler_{name}", HISTOGRAMS[name],
                                            buckets=buckets, sum_value=total)
            if "queue_seconds" in merged:
                buckets, total = merged["queue_seconds"].snapshot()
                yield HistogramMetricFamily("gpuplane:request_queue_time_seconds",
                                            "Time a Generate request waited for its first step",
                                            buckets=buckets, sum_value=total)
        if self.streams is not None:
            yield from self._streams()

    def _streams(self) -> Iterator[GaugeMetricFamily | HistogramMetricFamily | CounterMetricFamily]:
        for name, hist in (("time_to_first_token_seconds", self.streams.ttft),
                           ("time_per_output_token_seconds", self.streams.tpot),
                           ("e2e_request_latency_seconds", self.streams.e2e)):
            buckets, total = hist.snapshot()
            yield HistogramMetricFamily(f"gpuplane:{name}", SERVING_HISTOGRAMS[name],
                                        buckets=buckets, sum_value=total)
        snap = self.streams.snapshot()
        gauge = GaugeMetricFamily("gpuplane:num_streams_open", "Open Generate streams")
        gauge.add_metric([], float(snap["open_streams"]))
        yield gauge
        for name, field, text in (
                ("stream_buffer_overflows", "overflowed",
                 "Streams cancelled because their reader fell --max-stream-buffer-tokens behind"),
                ("generation_tokens", "tokens", "Tokens sent on Generate streams"),
                ("stream_messages", "messages", "Token messages sent on Generate streams")):
            counter = CounterMetricFamily(f"gpuplane:{name}", text)
            counter.add_metric([], float(snap[field]))
            yield counter
