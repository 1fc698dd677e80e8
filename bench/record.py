"""The benchmark record: one JSON line per figure in `bench/results/<device>.jsonl` (issue 21).

A figure is what a benchmark prints and a doc may quote: its metric name, value and unit, the
peer's value and the limit it was divided by where there is one, the target and whether it was
met. Each line also names the date, the commit, the device and the command that re-runs it
(without `--record`). `python -m bench.report` turns the record into docs/benchmarks.md.

    python bench/<name>.py --record            # appends to bench/results/<device>.jsonl
    python bench/<name>.py --record /tmp/out   # appends to /tmp/out/<device>.jsonl

The commit comes from GPUPLANE_COMMIT when set (the GPU machine gets a copy of the working tree
without .git), else from git ("+dirty" when tracked files differ from it). The device comes from
GPUPLANE_BENCH_DEVICE when set, else nvidia-smi's name of GPU 0, else "cpu".
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import pathlib
import re
import shlex
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FIELDS = ("date", "commit", "device", "command", "bench", "metric", "value", "unit", "peer",
          "limit", "target", "met")


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="DIR",
                        help="append one JSON line per figure to DIR/<device>.jsonl "
                             "(default DIR: bench/results)")


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def device_name() -> str:
    if os.environ.get("GPUPLANE_BENCH_DEVICE"):
        return slug(os.environ["GPUPLANE_BENCH_DEVICE"])
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=20, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return slug(out.stdout.strip().splitlines()[0])
    except (OSError, subprocess.TimeoutExpired):
        pass
    return "cpu"


def commit() -> str:
    if os.environ.get("GPUPLANE_COMMIT"):
        return os.environ["GPUPLANE_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=20, check=False)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=20, check=False).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def command(argv: list[str] | None = None) -> str:
    """The command that re-runs this benchmark from the repository root, without `--record`."""
    argv = list(sys.argv if argv is None else argv)
    script, rest = argv[0], argv[1:]
    try:
        script = str(pathlib.Path(script).resolve().relative_to(ROOT))
    except ValueError:
        pass
    kept, skip = [], False
    for i, a in enumerate(rest):
        if skip:
            skip = False
            continue
        if a == "--record":
            skip = i + 1 < len(rest) and not rest[i + 1].startswith("-")
            continue
        if a.startswith("--record="):
            continue
        kept.append(a)
    if script.endswith("__main__.py"):
        script = "-m " + str(pathlib.Path(script).parent).replace("/", ".")
    return " ".join(["python", script, *map(shlex.quote, kept)])


def _number(x):
    if x is None:
        return None
    x = float(x)
    return None if math.isnan(x) or math.isinf(x) else x


class Recorder:
    """Appends figures for one benchmark run; every line shares the run's date/commit/command."""

    def __init__(self, bench: str, directory: str | os.PathLike, device: str | None = None,
                 argv: list[str] | None = None) -> None:
        self.bench = bench
        self.device = device or device_name()
        self.path = pathlib.Path(directory) / f"{self.device}.jsonl"
        self.base = {"date": _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
                     "commit": commit(), "device": self.device, "command": command(argv),
                     "bench": bench}

    def add(self, metric: str, value: float, unit: str = "", peer: float | None = None,
            limit: float | None = None, target: str | None = None,
            met: bool | None = None) -> dict:
        line = {**self.base, "metric": metric, "value": _number(value), "unit": unit,
                "peer": _number(peer), "limit": _number(limit), "target": target, "met": met}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=False) + "\n")
        return line


def read(paths: list[pathlib.Path]) -> list[dict]:
    """Every figure in these .jsonl files, in file order; malformed lines are skipped, named."""
    rows = []
    for p in paths:
        for n, text in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError:
                print(f"{p}:{n}: not JSON, skipped", file=sys.stderr)
                continue
            if not all(k in row for k in FIELDS):
                print(f"{p}:{n}: missing {[k for k in FIELDS if k not in row]}, skipped",
                      file=sys.stderr)
                continue
            rows.append(row)
    return rows
