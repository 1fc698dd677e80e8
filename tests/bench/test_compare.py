"""bench/compare.py (make bench-compare): what it compares and how, without running benchmarks."""
from __future__ import annotations

import pathlib

from bench.compare import compare, export, flatten


def test_flatten_keeps_numeric_figures_and_drops_context_fields() -> None:
    doc = {"date": "2026-11-30", "loadavg_start": [1.0, 2.0], "quick": True,
           "sizes": {"256KiB": {"hit_1": {"p50_ms": 1.5, "ops": 10}, "label": "x"}},
           "runs": [{"compiled": 7}], "nan": float("nan")}
    assert flatten(doc) == {"sizes.256KiB.hit_1.p50_ms": 1.5, "sizes.256KiB.hit_1.ops": 10.0,
                            "runs.0.compiled": 7.0}


def test_compare_prints_the_median_ratio_and_its_spread_over_paired_rounds() -> None:
    base = {"b.py": [{"x": 2.0, "only_base": 1.0}, {"x": 4.0, "only_base": 1.0}]}
    tree = {"b.py": [{"x": 1.0, "new": 3.0}, {"x": 3.0, "new": 3.0}]}
    lines = compare(base, tree)
    row = next(line for line in lines if line.strip().startswith("x "))
    assert "0.625" in row and "0.500..0.750" in row, row  # ratios 0.5 and 0.75
    assert not any("only_base" in line or "new" in line for line in lines), \
        "a figure missing on one side must not be compared"


def test_a_benchmark_with_figures_on_one_side_only_is_reported_and_skipped() -> None:
    lines = compare({}, {"g.py": [{"x": 1.0}]})
    assert lines == ["g.py: figures on one side only (no --json on the base?); skipped"]


def test_the_base_is_exported_without_touching_any_worktree(tmp_path: pathlib.Path) -> None:
    sha = export("HEAD", tmp_path / "base")
    assert len(sha) == 40
    assert (tmp_path / "base" / "bench" / "compare.py").exists() or \
        (tmp_path / "base" / "Makefile").exists()
    assert not (tmp_path / "base" / ".git").exists(), "the export must not be a git checkout"


def test_a_benchmark_whose_json_is_empty_or_cut_short_gives_no_figures(tmp_path: pathlib.Path,
                                                                       capsys) -> None:
    """A full disk leaves an empty --json file: the round reports it and goes on."""
    from bench.compare import run_bench
    tree = tmp_path / "tree"
    (tree / "bench").mkdir(parents=True)
    script = tree / "bench" / "half_bench.py"
    script.write_text("import sys, pathlib\n"
                      "p = pathlib.Path(sys.argv[sys.argv.index('--json') + 1])\n"
                      "p.write_text(sys.argv[1])\n")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert run_bench(tree, "half_bench.py", [""], scratch) is None
    assert run_bench(tree, "half_bench.py", ['{"a": 1'], scratch) is None
    assert "no figures" in capsys.readouterr().out
    assert run_bench(tree, "half_bench.py", ['{"a": 1}'], scratch) == {"a": 1.0}
