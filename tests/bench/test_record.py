"""bench/record.py, bench/targets.py's recording and bench/report.py: every printed figure is one
line of the record, and docs/benchmarks.md is generated from it."""
from __future__ import annotations

import json
import math
import os
import pathlib
import subprocess
import sys

import bench.__main__ as bench_main
from bench import report
from bench.record import FIELDS, RESULTS, Recorder, add_record_flag, command, read
from bench.targets import Targets

ROOT = pathlib.Path(__file__).resolve().parents[2]


def lines(path: pathlib.Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def recorder(tmp_path, bench="demo", argv=("bench/demo_bench.py", "--reps", "3")):
    return Recorder(bench, tmp_path, device="test-gpu", argv=list(argv))


def test_every_check_requirement_and_figure_is_one_line_with_every_field(tmp_path):
    t = Targets("demo", record=recorder(tmp_path))
    t.check("batch 8: ours / peer", 0.41, ">=", 1.0, unit="ratio", peer=3412.0, limit=4250.0)
    t.require("same tokens", True)
    t.figure("limit: D2D copy", 4250.0, "GB/s")
    rows = lines(tmp_path / "test-gpu.jsonl")
    assert len(rows) == 3, "one line per figure"
    for row in rows:
        assert set(FIELDS) <= set(row), f"a line lacks {set(FIELDS) - set(row)}"
        assert row["device"] == "test-gpu" and row["bench"] == "demo"
    ratio, same, limit = rows
    assert (ratio["value"], ratio["peer"], ratio["limit"]) == (0.41, 3412.0, 4250.0)
    assert ratio["target"] == ">= 1" and ratio["met"] is False, "a missed target is met: false"
    assert same["met"] is True and same["unit"] == "yes/no"
    assert limit["met"] is None and limit["target"] is None, "a plain figure has no target"


def test_a_nan_figure_is_recorded_as_null_and_never_met(tmp_path):
    t = Targets("demo", record=recorder(tmp_path))
    assert not t.check("nothing measured", math.nan, "<=", 1.0)
    row = lines(tmp_path / "test-gpu.jsonl")[0]
    assert row["value"] is None and row["met"] is False


def test_the_recorded_command_reruns_the_benchmark_without_the_record_flag():
    assert command(["bench/x_bench.py", "--record", "/tmp/out", "--reps", "3"]) == \
        "python bench/x_bench.py --reps 3"
    assert command(["bench/x_bench.py", "--record", "--reps", "3"]) == \
        "python bench/x_bench.py --reps 3", "a bare --record must not swallow the next flag"
    assert command(["bench/x_bench.py", "--record=/tmp/o"]) == "python bench/x_bench.py"
    assert command([str(ROOT / "bench" / "x_bench.py")]) == "python bench/x_bench.py", \
        "the command names the script relative to the repository root"


def test_targets_record_only_when_the_flag_is_given(tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    add_record_flag(p)
    assert Targets("demo", args=p.parse_args([])).recorder is None
    args = p.parse_args(["--record", str(tmp_path)])
    t = Targets("demo", args=args)
    t.figure("x", 1.0, "s")
    assert list(tmp_path.glob("*.jsonl")), "--record DIR must write DIR/<device>.jsonl"


def test_python_m_bench_record_passes_the_directory_to_every_benchmark(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(bench_main, "run_all", lambda scripts: seen.extend(scripts) or [])
    monkeypatch.setattr(bench_main, "_cuda_present", lambda: False)
    assert bench_main.main(["--record", str(tmp_path)]) == 0
    assert seen and all(flags[-2:] == ["--record", str(tmp_path.resolve())]
                        for _, flags in seen), "every benchmark must get --record DIR"


def write_runs(path: pathlib.Path, values: list[float], met: list[bool | None]) -> None:
    path.write_text("".join(json.dumps({
        "date": f"2026-12-0{i + 1}T10:00:00Z", "commit": f"c{i}", "device": "nvidia-h200",
        "command": "python bench/batching_bench.py", "bench": "batching_bench",
        "metric": "batch 64: gpuplane / pytorch fp16 graph", "value": v, "unit": "ratio",
        "peer": 6198.0, "limit": None, "target": ">= 1", "met": m}) + "\n"
        for i, (v, m) in enumerate(zip(values, met, strict=True))))


def test_the_report_shows_the_latest_figure_with_its_history_and_how_much_it_missed(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write_runs(results / "nvidia-h200.jsonl", [0.22, 0.30, 0.45], [False, False, False])
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out)]) == 0
    text = out.read_text()
    row = next(x for x in text.splitlines() if x.startswith("| batch 64"))
    assert "| 0.45 |" in row, "the latest value is the one shown"
    assert "0.3 (2026-12-02), 0.22 (2026-12-01)" in row, "earlier values, newest first"
    assert "MISSED (0.45x the bound)" in row, "a miss says by how much"
    assert "Latest figures that MISSED their target: 1" in text
    assert "`python bench/batching_bench.py`" in text, "the command that re-runs it"
    assert (out.parent / "benchmarks" / "nvidia-h200-batching-bench.png").exists(), \
        "three runs of a metric get a plot"
    assert report.main(["--results", str(results), "--out", str(out), "--strict"]) == 1, \
        "--strict fails on a latest figure that MISSED"


def test_a_retired_metric_leaves_the_missed_list_and_says_why(tmp_path, monkeypatch):
    results = tmp_path / "results"
    results.mkdir()
    write_runs(results / "nvidia-h200.jsonl", [0.22, 0.30], [False, False])
    out = tmp_path / "docs" / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out), "--strict"]) == 1
    metric = "batch 64: gpuplane / pytorch fp16 graph"
    monkeypatch.setitem(report.RETIRED, ("batching_bench", metric), "renamed to something else")
    assert report.main(["--results", str(results), "--out", str(out), "--strict"]) == 0, \
        "a retired metric's last miss no longer fails --strict"
    text = out.read_text()
    assert "Latest figures that MISSED their target: 0" in text
    assert "batch 64: gpuplane / pytorch fp16 graph: renamed to something else" in text
    row = next(x for x in text.splitlines() if x.startswith("| batch 64"))
    assert "| retired |" in row and "0.22 (2026-12-01)" in row, "its figures stay, marked"


def test_every_retired_metric_is_recorded_and_named_by_no_benchmark_any_more():
    recorded = {(r["bench"], r["metric"]) for r in read(sorted(RESULTS.glob("*.jsonl")))}
    sources = "\n".join(p.read_text() for p in (ROOT / "bench").glob("*.py")
                        if p.name != "report.py")   # RETIRED itself names them
    for bench, metric in report.RETIRED:
        assert (bench, metric) in recorded, f"{bench}: {metric!r} is not in the record"
        assert metric not in sources, f"{bench}: {metric!r} is still named by a benchmark"


def test_the_report_check_fails_when_the_page_is_out_of_date(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    write_runs(results / "nvidia-h200.jsonl", [1.2], [True])
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(results), "--out", str(out), "--check"]) == 1
    report.main(["--results", str(results), "--out", str(out)])
    assert report.main(["--results", str(results), "--out", str(out), "--check"]) == 0
    write_runs(results / "nvidia-h200.jsonl", [1.2, 0.9], [True, False])
    assert report.main(["--results", str(results), "--out", str(out), "--check"]) == 1, \
        "a new figure makes the page out of date"


def test_malformed_lines_are_skipped_not_fatal(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('not json\n{"date": "d"}\n')
    assert read([path]) == []


def test_the_committed_benchmarks_page_is_generated_from_the_committed_record():
    assert report.main(["--check"]) == 0, \
        "docs/benchmarks.md differs from python -m bench.report's output: regenerate it"


def test_a_sim_benchmark_run_with_record_lands_in_the_report(tmp_path):
    """End to end on the CPU: the sim backend drives the batching benchmark (the worker in its own
    process), --record writes the figures, the report renders them."""
    env = {**os.environ, "GPUPLANE_BENCH_DEVICE": "sim"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "batching_bench.py"), "--backend", "sim",
         "--config", "tiny", "--batches", "1,2", "--prompt", "8", "--new", "4", "--trials", "1",
         "--record", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = lines(tmp_path / "sim.jsonl")
    metrics = {r["metric"] for r in rows}
    assert "gpuplane decode via gRPC, batch 2" in metrics
    assert "batch 2: every stream equals the solo stream" in metrics
    assert all(r["command"].startswith("python bench/batching_bench.py --backend sim")
               for r in rows)
    out = tmp_path / "benchmarks.md"
    assert report.main(["--results", str(tmp_path), "--out", str(out)]) == 0
    assert "### batching_bench" in out.read_text()


def test_a_variant_run_names_every_figure_so_it_never_stands_in_for_the_default(tmp_path, capsys):
    t = Targets("demo", record=recorder(tmp_path), variant="stream interval 4")
    t.check("batch 64: ratio", 1.0, "<=", 1.1)
    t.require("same tokens", True)
    t.figure("tokens/s", 9.0, "tok/s")
    names = [r["metric"] for r in lines(tmp_path / "test-gpu.jsonl")]
    assert names == ["batch 64: ratio (stream interval 4)", "same tokens (stream interval 4)",
                     "tokens/s (stream interval 4)"]
    assert "target batch 64: ratio (stream interval 4): " in capsys.readouterr().out
