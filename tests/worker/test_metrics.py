"""The worker's Prometheus collector reads a real runtime's stats at scrape time."""
from __future__ import annotations

import logging
import pathlib

from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpu_worker.edge.metrics import WorkerCollector
from gpu_worker.telemetry import survived


def test_the_metrics_collector_exports_the_ledger_and_caches_and_survives_a_closed_runtime(
        tmp_path: pathlib.Path) -> None:
    from gpu_worker import WorkerConfig, WorkerRuntime

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



def test_a_scrape_of_a_closed_runtime_serves_no_worker_gauges_and_logs_and_counts_the_failure(
        tmp_path: pathlib.Path, caplog, monkeypatch) -> None:
    from gpu_worker import WorkerConfig, WorkerRuntime

    monkeypatch.setattr(survived, "_logged", set())
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path)).start()
    registry = CollectorRegistry()
    registry.register(WorkerCollector(runtime))
    runtime.close()
    before = survived.count("metrics_scrape")
    with caplog.at_level(logging.WARNING, logger="gpu_worker.telemetry.survived"):
        text = generate_latest(registry).decode()  # must not raise: the endpoint stays up
    assert "gpuplane_worker_ledger_bytes" not in text, "a closed runtime exported stale gauges"
    assert survived.count("metrics_scrape") == before + 1, "the failed scrape was not counted"
    assert [r for r in caplog.records if getattr(r, "site", None) == "metrics_scrape"], \
        "the failed scrape was not logged"
    served = generate_latest(REGISTRY).decode()  # the registry the worker's /metrics serves
    assert 'gpuplane_worker_survived_errors_total{site="metrics_scrape"}' in served


def test_the_collector_exports_the_embed_batch_size_histogram(tmp_path: pathlib.Path) -> None:
    from gpu_worker import WorkerConfig, WorkerRuntime

    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path)).start()
    registry = CollectorRegistry()
    registry.register(WorkerCollector(runtime))
    try:
        runtime.load_model("enc", "encoder", "tiny", 1)
        runtime.embed("enc", [[1, 2, 3], [4] * 40, [5]])   # one request: one batch of 3
        runtime.embed("enc", [[6, 7]])                      # one batch of 1
        text = generate_latest(registry).decode()
    finally:
        runtime.close()
    values = {(s.name, s.labels.get("le")): s.value for f in text_string_to_metric_families(text)
              for s in f.samples}
    h = "gpuplane_worker_embed_batch_sequences"
    assert values[(h + "_bucket", "1.0")] == 1 and values[(h + "_bucket", "4.0")] == 2
    assert values[(h + "_count", None)] == 2 and values[(h + "_sum", None)] == 4
    assert values[("gpuplane_worker_embed_batch_peak_batch_sequences", None)] == 3
