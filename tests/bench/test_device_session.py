"""bench/device_session.py: the fixed list of GPU runs packs into groups that fit one device
call, every run records, and every run's command line is logged with its outcome."""
from __future__ import annotations

import json
import pathlib
import subprocess

import pytest

from bench import device_session as ds

BENCH = pathlib.Path(ds.__file__).resolve().parent


@pytest.mark.parametrize("quick", [False, True])
def test_every_run_is_in_exactly_one_group_and_no_group_exceeds_the_budget(quick):
    runs = ds.plan(quick)
    packed = ds.groups(runs, quick)
    flat = [r for g in packed for r in g]
    assert sorted(r.name for r in flat) == sorted(r.name for r in runs), "each run once"
    for g in packed:
        total = sum(r.estimate(quick) for r in g)
        assert total <= ds.BUDGET_S or len(g) == 1, f"group over budget: {total} s"
        order = [runs.index(r) for r in g]
        assert order == sorted(order), "a group keeps the runs' priority order"


def test_first_fit_fills_earlier_groups_before_opening_new_ones():
    runs = [ds.Run(n, "x.py", (), est) for n, est in
            (("a", 300), ("b", 300), ("c", 150), ("d", 600))]
    packed = ds.groups(runs, quick=False, budget_s=500)
    assert [[r.name for r in g] for g in packed] == [["a", "c"], ["b"], ["d"]]


def test_quick_serving_covers_every_level_issue_23_asks_for_in_one_run():
    quick = ds.plan(True)
    assert not [r for r in quick if r.name.startswith("serving_bench@")], "folded into one run"
    serving = next(r for r in quick if r.name == "serving_bench")
    argv = serving.argv(True)
    assert argv[argv.index("--concurrency") + 1] == "1,8,32,64,128"
    assert int(argv[argv.index("--trials") + 1]) >= 3, "at least 3 trials even when quick"
    full = {lvl for r in ds.plan(False) if r.name.startswith("serving_bench")
            for lvl in r.argv(False)[r.argv(False).index("--concurrency") + 1].split(",")}
    assert full == {"1", "8", "32", "64", "128"}


def test_every_planned_benchmark_takes_record_and_knows_every_flag_it_is_given():
    for r in ds.PLAN:
        source = (BENCH / r.script).read_text() + (BENCH / "_kernel_bench.py").read_text()
        assert "add_record_flag" in source, f"{r.script} has no --record"
        for quick in (False, True):
            for flag in r.argv(quick)[1:]:
                if flag.startswith("--"):
                    assert f'"{flag}"' in source, f"{r.script} does not define {flag}"


def test_a_group_run_logs_each_command_with_record_and_its_outcome(tmp_path, monkeypatch):
    calls = []

    def fake_run(argv, cwd, env, timeout, check):
        calls.append((argv, timeout, env["GPUPLANE_BENCH_KERNEL_CACHE"]))
        if "slow.py" in argv[1]:
            raise subprocess.TimeoutExpired(argv, timeout)
        return subprocess.CompletedProcess(argv, 1 if "miss.py" in argv[1] else 0)
    monkeypatch.setattr(ds.subprocess, "run", fake_run)
    monkeypatch.setattr(ds, "device_name", lambda: "test-gpu")
    monkeypatch.setattr(ds, "commit", lambda: "abc123")
    monkeypatch.setenv("GPUPLANE_BENCH_KERNEL_CACHE", str(tmp_path / "kernels"))
    runs = [ds.Run("ok", "ok.py", ("--reps", "3"), 40), ds.Run("miss", "miss.py", (), 40),
            ds.Run("slow", "slow.py", (), 40)]
    results = ds.run_group(runs, quick=False, record=str(tmp_path), budget_s=500,
                           python="python3")
    assert [e["rc"] for e in results] == [0, 1, "timeout"]
    argv, timeout, _ = calls[0]
    assert argv[1:] == ["bench/ok.py", "--reps", "3", "--record", str(tmp_path.resolve())]
    assert timeout == 80, "a run is stopped after twice its estimate"
    logged = [json.loads(x) for x in
              (tmp_path / "sessions" / "test-gpu.jsonl").read_text().splitlines()]
    assert [e["run"] for e in logged] == ["ok", "miss", "slow"]
    assert logged[0]["command"] == f"python bench/ok.py --reps 3 --record {tmp_path.resolve()}"
    assert {"date", "commit", "device", "rc", "wall_s", "estimate_s"} <= set(logged[0])
    assert logged[0]["commit"] == "abc123" and logged[0]["device"] == "test-gpu"


def test_a_run_with_no_time_left_in_the_group_is_skipped_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(ds.subprocess, "run", lambda *a, **k: pytest.fail("must not start"))
    monkeypatch.setattr(ds, "device_name", lambda: "test-gpu")
    monkeypatch.setenv("GPUPLANE_BENCH_KERNEL_CACHE", str(tmp_path / "kernels"))
    results = ds.run_group([ds.Run("late", "late.py", (), 100)], quick=False, record=None,
                           budget_s=-ds.GRACE_S)
    assert results[0]["rc"] == "skipped"
