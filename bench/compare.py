"""`make bench-compare [BASE=<rev>]`: the CPU benchmarks on a base revision and on the working tree.

    .venv/bin/python bench/compare.py [--base REV] [--rounds 2] [--only cache_service_bench.py]

The base (default: the merge base of HEAD and `main`) is exported with `git archive` into a
temporary directory; the working tree runs as it is, uncommitted changes included. Both use this
checkout's virtual environment (same dependencies), each with its own tree first on PYTHONPATH.
Runs alternate (base, tree, then tree, base, ...) so a shared machine's changing load lands on
both sides alike. Every numeric figure a benchmark writes with `--json` on both sides is printed
with the median of its per-round ratios (tree / base) and their spread (min..max); a benchmark
without `--json` on one side is reported and skipped. Informational: the exit status is 0 even
when a benchmark misses its own target (CI prints this, it does not gate on it).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCHES = [
    ("cache_service_bench.py", ["--quick"]),
    ("governor_bench.py", ["--seconds", "2", "--open-seconds", "4"]),
    ("compile_bench.py", ["--rounds", "3"]),
    ("scheduler_host_bench.py", []),
]
_SKIP = ("loadavg", "date", "quick", "clients")  # context, not figures


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout.strip()


def export(rev: str, into: pathlib.Path) -> str:
    """Write `rev`'s tree into `into` (no git metadata, nothing shared with other worktrees)."""
    sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=ROOT, check=True,
                             capture_output=True).stdout
    tar_path = into.with_suffix(".tar")
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(into, filter="data")
    tar_path.unlink()
    return sha


def flatten(value: object, prefix: str = "") -> dict[str, float]:
    """Numeric leaves of a JSON document as {"a.b.0": x}; context fields are left out."""
    out: dict[str, float] = {}
    if isinstance(value, dict):
        for k, v in value.items():
            if not any(s in str(k) for s in _SKIP):
                out.update(flatten(v, f"{prefix}{k}."))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.update(flatten(v, f"{prefix}{i}."))
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        out[prefix.rstrip(".")] = float(value)
    return out


def run_bench(tree: pathlib.Path, script: str, args: list[str],
              scratch: pathlib.Path) -> dict[str, float] | None:
    """One run of `script` from `tree`; its figures, or None when it wrote no JSON."""
    path = tree / "bench" / script
    if not path.exists() or "--json" not in path.read_text():
        return None
    out = scratch / f"{script}.{time.monotonic_ns()}.json"
    env = {**os.environ, "PYTHONPATH": str(tree), "GPUPLANE_LOG_LEVEL": "WARNING"}
    # A non-zero exit is a benchmark reporting a MISSED target: its figures still count.
    proc = subprocess.run([sys.executable, str(path), *args, "--json", str(out)], cwd=tree,
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    try:
        return flatten(json.loads(out.read_text()))
    except (OSError, ValueError) as exc:   # none written, or cut short (a full disk, a crash)
        print(f"  {script} on {tree.name}: no figures (exit {proc.returncode}; {exc}): "
              f"{proc.stderr.strip()[-300:]}", flush=True)
        return None


def compare(base: dict[str, list[dict[str, float]]], tree: dict[str, list[dict[str, float]]],
            ) -> list[str]:
    """Lines: per benchmark and figure, base median, tree median, ratio median and spread."""
    lines = []
    for script, t_runs in tree.items():
        b_runs = base.get(script, [])
        if not b_runs or not t_runs:
            lines.append(f"{script}: figures on one side only (no --json on the base?); skipped")
            continue
        lines.append(f"{script}")
        lines.append(f"  {'figure':<46} {'base':>11} {'tree':>11} {'tree/base':>9} {'spread':>15}")
        common = sorted(set.intersection(*(set(r) for r in b_runs + t_runs)))
        for key in common:
            ratios = [t[key] / b[key] for b, t in zip(b_runs, t_runs) if b[key]]
            if not ratios:
                continue
            lines.append(
                f"  {key[:46]:<46} {statistics.median(r[key] for r in b_runs):>11.4g} "
                f"{statistics.median(r[key] for r in t_runs):>11.4g} "
                f"{statistics.median(ratios):>9.3f} {min(ratios):>7.3f}..{max(ratios):<7.3f}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="", help="revision (default: merge base with main)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--only", action="append", help="run only these scripts (repeatable)")
    args = parser.parse_args(argv)
    rev = args.base or _git("merge-base", "HEAD", "main")
    benches = [b for b in BENCHES if not args.only or b[0] in args.only]
    with tempfile.TemporaryDirectory(prefix="bench-compare-") as tmp:
        scratch = pathlib.Path(tmp)
        base_tree = scratch / "base"
        sha = export(rev, base_tree)
        print(f"bench-compare: base {rev} ({sha[:12]}) vs the working tree {ROOT}, "
              f"{args.rounds} rounds, alternating", flush=True)
        results: dict[str, dict[str, list]] = {"base": {}, "tree": {}}
        for round_ in range(args.rounds):
            order = [("base", base_tree), ("tree", ROOT)]
            if round_ % 2:
                order.reverse()
            for script, bench_args in benches:
                for side, tree in order:
                    figures = run_bench(tree, script, bench_args, scratch)
                    if figures is not None:
                        results[side].setdefault(script, []).append(figures)
                    print(f"  round {round_ + 1}: {script} on {side} done", flush=True)
    # Pair runs by round; a side that failed a round shortens the pairing, never mismatches it.
    for script in list(results["tree"]):
        n = min(len(results["base"].get(script, [])), len(results["tree"][script]))
        results["base"][script] = results["base"].get(script, [])[:n]
        results["tree"][script] = results["tree"][script][:n]
    print("\n".join(compare(results["base"], results["tree"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
