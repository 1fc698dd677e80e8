"""bench/scheduler_host_bench.py keeps running (it is in `make bench` and `make bench-compare`):
a short run writes a positive step time per batch, and the per-row figure is the step's share."""
from __future__ import annotations

import json
import sys

import pytest

from bench import scheduler_host_bench


def test_a_short_run_reports_a_step_time_per_batch(tmp_path, monkeypatch):
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["scheduler_host_bench", "--batches", "1,4", "--steps", "5",
                                      "--prompt", "20", "--json", str(out)])
    assert scheduler_host_bench.main() == 0
    figures = json.loads(out.read_text())
    for batch in (1, 4):
        step = figures[f"batch_{batch}"]
        assert step["step_us"] > 0 and step["row_us"] * batch == pytest.approx(step["step_us"])
