"""The worker's Prometheus collector reads a real runtime's stats at scrape time."""
from __future__ import annotations

import pathlib

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker.metrics import WorkerCollector


def test_the_metrics_collector_exports_the_ledger_and_caches_and_survives_a_closed_runtime(
        tmp_path: pathlib.Path) -> None:
    from gpu_worker.runtime import WorkerConfig, WorkerRuntime

    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path)).start()
    registry = CollectorRegistry()
    registry.register(WorkerCollector(runtime))
    try:
        text = generate_latest(registry).decode()
        ledger = runtime.stats()["ledger_bytes"]
    finally:
        runtime.close()
    values = {sample.name: sample.value for family in text_string_to_metric_families(text)
              for sample in family.samples}
    assert values["gpuplane_worker_ledger_bytes"] == ledger, "the ledger is not exported as is"
    assert 'gpuplane_worker_zone_committed_bytes{zone="context"}' in text, "zones not exported"
    assert "gpuplane_worker_kernel_cache_entries" in text, "kernel cache not exported"
    assert "gpuplane_worker_compile_compiled" in text, "compile counters not exported"
    assert generate_latest(registry) is not None, "a scrape after close broke the endpoint"
