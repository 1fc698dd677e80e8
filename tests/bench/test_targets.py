"""bench/targets.py and `python -m bench`: a target MISSED makes the bench, then the run, fail."""
from __future__ import annotations

import math
import pathlib

import pytest

import bench.__main__ as bench_main
from bench.targets import Targets

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_a_missed_target_prints_missed_and_makes_the_exit_code_non_zero(capsys):
    t = Targets("demo")
    assert t.check("page-in ratio", 0.95, ">=", 0.80)
    assert not t.check("wall ratio", 1.20, "<=", 1.00)
    out = capsys.readouterr().out
    assert "target page-in ratio: 0.95 (target >= 0.80) met" in out
    assert "target wall ratio: 1.20 (target <= 1.00) MISSED" in out
    assert t.exit_code() == 1, "a MISSED target must make the bench exit non-zero"
    assert "MISSED: wall ratio" in capsys.readouterr().out


def test_met_targets_exit_zero_and_nan_is_never_met():
    t = Targets("demo")
    t.check("a", 2.0, ">", 1.0)
    t.require("identical tokens", True, "graph vs eager")
    assert t.exit_code() == 0
    assert not t.check("nothing measured", math.nan, "<=", 1.0), "NaN must not pass a <= target"
    assert not t.check("nothing measured", math.nan, ">=", 1.0)
    assert t.exit_code() == 1


def test_an_unknown_comparison_is_refused():
    with pytest.raises(ValueError, match="unknown comparison"):
        Targets("demo").check("x", 1.0, "~", 1.0)


def _script(path: pathlib.Path, body: str) -> pathlib.Path:
    path.write_text(f"import sys\nsys.path.insert(0, {str(ROOT)!r})\n{body}")
    return path


def test_python_m_bench_runs_every_bench_and_fails_when_one_missed_a_target(tmp_path, monkeypatch):
    ran = tmp_path / "ran"
    missed = _script(tmp_path / "missed_bench.py",
                     "from bench.targets import Targets\nt = Targets('missed')\n"
                     "t.check('ratio', 0.5, '>=', 0.8)\nsys.exit(t.exit_code())\n")
    after = _script(tmp_path / "after_bench.py",
                    "from bench.targets import Targets\nt = Targets('after')\n"
                    f"t.check('ratio', 0.9, '>=', 0.8)\nopen({str(ran)!r}, 'w').close()\n"
                    "sys.exit(t.exit_code())\n")
    monkeypatch.setattr(bench_main, "HERE", tmp_path)
    monkeypatch.setattr(bench_main, "CPU", [(missed.name, []), (after.name, [])])
    monkeypatch.setattr(bench_main, "GPU", [])
    monkeypatch.setattr(bench_main, "_cuda_present", lambda: False)
    assert bench_main.main([]) == 1, "a bench that MISSED a target must fail `python -m bench`"
    assert ran.exists(), "the benches after a failed one must still run"
    monkeypatch.setattr(bench_main, "CPU", [(after.name, [])])
    assert bench_main.main([]) == 0, "all targets met: `python -m bench` must succeed"


def test_every_bench_that_prints_targets_exits_with_their_status():
    """A bench that prints targets but ignores them would let `make bench` pass on a MISSED."""
    for path in sorted((ROOT / "bench").glob("*_bench.py")):
        text = path.read_text()
        if "Targets(" in text and not path.name.startswith("_"):   # _*: helpers benches share
            assert "exit_code()" in text and "sys.exit(main())" in text, \
                f"{path.name} checks targets but does not exit with their status"
        assert "NOT met" not in text and "[target" not in text, \
            f"{path.name} prints a target outside bench/targets.py"
