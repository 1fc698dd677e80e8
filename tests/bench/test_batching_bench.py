"""bench/batching_bench.py's step split: beside the end-to-end / device step it reports the decode
tokens the engine made over the window and the share of them the streams received, the figure
that shows an edge falling behind its engine (the GPU run itself needs a device)."""
from __future__ import annotations

import json
import os

from bench.batching_bench import process_cpu_s, step_figures
from bench.targets import Targets


def trial(e2e_over_device: float, received_over_made: float) -> dict[str, float]:
    return {"steps": 120, "e2e_ms": 4.8 * e2e_over_device, "device_ms": 4.8, "host_ms": 1.5,
            "e2e_over_device": e2e_over_device, "made_tps": 13_000.0,
            "received_over_made": received_over_made, "cpu_us_per_token": 61.0}


def test_the_step_split_gives_the_median_share_of_the_engines_tokens_the_streams_received(
        capsys) -> None:
    targets = Targets("batching_bench", record=None)
    ratios = step_figures(targets, {64: [trial(1.02, 0.74), trial(1.04, 0.70), trial(1.00, 0.98)]})
    assert ratios == {64: (1.02, 0.74)}, "the medians of the trials, per batch"
    out = capsys.readouterr().out
    assert "the engine made 13,000.0 tokens/s, the streams received 0.740 of them" in out


def test_the_engines_rate_is_a_recorded_figure(tmp_path) -> None:
    from argparse import Namespace
    targets = Targets("batching_bench", args=Namespace(record=str(tmp_path)))
    step_figures(targets, {8: [trial(0.9, 1.0)]})
    rows = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
    made = [r for r in rows if r["metric"] == "gpuplane decode tokens/s the engine made, batch 8"]
    assert made and made[0]["value"] == 13_000.0 and made[0]["unit"] == "tok/s"


def test_a_batch_without_a_window_gives_no_split(capsys) -> None:
    assert step_figures(Targets("batching_bench"), {1: [], 64: [trial(1.0, 1.0)]}) is None


def test_the_worker_cpu_a_token_is_printed_and_recorded(tmp_path, capsys) -> None:
    from argparse import Namespace
    targets = Targets("batching_bench", args=Namespace(record=str(tmp_path)))
    step_figures(targets, {64: [trial(1.0, 1.0)]})
    assert "the worker's CPU 61.0 us a token" in capsys.readouterr().out
    rows = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
    assert [r["value"] for r in rows if r["metric"].startswith("gpuplane worker CPU")] == [61.0]


def test_a_process_cpu_reading_grows_with_the_work_it_did() -> None:
    before = process_cpu_s(os.getpid())
    sum(i * i for i in range(2_000_000))
    assert process_cpu_s(os.getpid()) > before >= 0
