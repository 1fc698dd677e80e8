"""Prometheus view of the ledger: read on each scrape, so the figures are never stale copies."""
from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from services.governor.ledger import Ledger


class LedgerCollector(Collector):
    """Per device and zone: budget, leased, committed, content, borrowed, cached; per device:
    used, ledger, unaccounted and the alert; zone kv split into in use and cached, per device
    and per worker; counters of admissions, refusals and expiries."""

    def __init__(self, ledger: Ledger) -> None:
        self.ledger = ledger

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        device_gauges = {
            name: GaugeMetricFamily(f"gpuplane_governor_device_{name}", help_, labels=["device"])
            for name, help_ in [
                ("budget_bytes", "Device budget the governor admits against"),
                ("leased_bytes", "Bytes leased to workers"),
                ("used_bytes", "Device truth: used bytes reported by the workers' heartbeats"),
                ("ledger_bytes", "Committed bytes the workers report, context included"),
                ("unaccounted_bytes", "used - ledger: device memory no zone accounts for"),
                ("unaccounted_alert", "1 while the unaccounted figure is growing"),
            ]
        }
        zone_gauges = {
            name: GaugeMetricFamily(f"gpuplane_governor_zone_{name}", f"Per zone: {name}",
                                    labels=["device", "zone"])
            for name in ("leased_bytes", "committed_bytes", "content_bytes", "budget_bytes",
                         "borrowed_bytes", "cached_bytes")
        }
        kv_device = {
            part: GaugeMetricFamily(
                f"gpuplane_governor_kv_{part}_bytes",
                f"Committed bytes of zone kv {what}, per device", labels=["device"])
            for part, what in [("in_use", "held by live sequences"),
                               ("cached", "cached (no sequence's: reclaimable at once)")]
        }
        kv_worker = {
            part: GaugeMetricFamily(
                f"gpuplane_governor_worker_kv_{part}_bytes",
                f"Committed bytes of zone kv {what}, per worker", labels=["device", "worker"])
            for part, what in [("in_use", "held by live sequences"), ("cached", "cached")]
        }
        host_worker = {
            part: GaugeMetricFamily(
                f"gpuplane_governor_worker_host_{part}_bytes",
                f"Pinned host memory of a worker's host tier: {what}", labels=["device", "worker"])
            for part, what in [("weights", "weights' host copies"),
                               ("kv", "KV swapped out or demoted")]
        }
        for d in self.ledger.resources():
            for name, value in [("budget_bytes", d.budget_bytes), ("leased_bytes", d.leased_bytes),
                                ("used_bytes", d.device_used_bytes),
                                ("ledger_bytes", d.ledger_bytes),
                                ("unaccounted_bytes", d.unaccounted_bytes),
                                ("unaccounted_alert", int(d.unaccounted_alert))]:
                device_gauges[name].add_metric([d.uuid], value)
            for z in d.zones:
                for name, gauge in zone_gauges.items():
                    gauge.add_metric([d.uuid, z.zone], getattr(z, name))
            kv_device["in_use"].add_metric([d.uuid], d.kv_in_use_bytes)
            kv_device["cached"].add_metric([d.uuid], d.kv_cached_bytes)
            for w in d.workers:
                kv_worker["in_use"].add_metric([d.uuid, w.worker_id], w.kv_in_use_bytes)
                kv_worker["cached"].add_metric([d.uuid, w.worker_id], w.kv_cached_bytes)
                host_worker["weights"].add_metric([d.uuid, w.worker_id], w.host_weights_bytes)
                host_worker["kv"].add_metric([d.uuid, w.worker_id], w.host_kv_bytes)
        yield from device_gauges.values()
        yield from zone_gauges.values()
        yield from kv_device.values()
        yield from kv_worker.values()
        yield from host_worker.values()
        for name, value in dict(self.ledger.counters).items():
            counter = CounterMetricFamily(f"gpuplane_governor_{name}", f"Governor events: {name}")
            counter.add_metric([], value)
            yield counter
