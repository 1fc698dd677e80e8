"""Where a served step's device time goes, from a worker's `--step-trace` file.

    python bench/step_trace_fit.py steps.jsonl [--skip 50]

Fits each step's device span by least squares on its composition:
    device_us ~ decode_pass * [decode rows > 0] + per_decode_row * decode_rows
              + per_chunk * prefill chunks + per_prefill_row * prefill rows
so `per_chunk` is what one more forward pass costs beyond its rows (every weight read once
more, the launches). The prefill rows are the chunks' graph rows (`chunk_rows`: the tokens and
their bucket's padding, which the linears compute too) where the trace has them, else their
tokens; both fits' R² are printed when it has them. It prints the mean step split into those parts, the steps grouped by how
many chunks they ran, and the decode-only steps by the rows their decode graphs ran. An analysis tool, not a benchmark: it has no targets and records
nothing. The first `--skip` steps (captures, warm-up) are left out.
"""
from __future__ import annotations

import argparse
import collections
import json
import pathlib

import numpy as np

TERMS = ("decode_pass", "per_decode_row", "per_chunk", "per_prefill_row")


def load(path: pathlib.Path, skip: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows.sort(key=lambda r: (r["model"], r["step"]))
    return [r for r in rows if r["step"] >= skip and r["device_us"] > 0]


def prefill_rows(record: dict, padded: bool = True) -> int:
    """A step's prefill rows: its chunks' graph rows when recorded (and `padded`), else tokens."""
    return sum(record["chunk_rows"] if padded and "chunk_rows" in record else record["chunks"])


def design(records: list[dict], padded: bool = True) -> np.ndarray:
    return np.array([[float(r["decode_rows"] > 0), r["decode_rows"], len(r["chunks"]),
                      prefill_rows(r, padded)] for r in records], np.float64)


def fit(records: list[dict], padded: bool = True) -> tuple[np.ndarray, float]:
    """The terms' coefficients (µs) and the fit's R² (`padded`: on graph rows, when recorded)."""
    x, y = design(records, padded), np.array([r["device_us"] for r in records], np.float64)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    resid = y - x @ coef
    return coef, 1.0 - float(resid @ resid) / float(((y - y.mean()) ** 2).sum())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", type=pathlib.Path)
    ap.add_argument("--skip", type=int, default=50, help="leave out the first steps (warm-up)")
    args = ap.parse_args()
    records = load(args.trace, args.skip)
    if len(records) < 8:
        print(f"{args.trace}: {len(records)} steps after --skip {args.skip}: too few to fit")
        return 1
    coef, r2 = fit(records)
    x = design(records)
    mean = x.mean(axis=0)
    device = np.mean([r["device_us"] for r in records])
    print(f"{len(records)} steps; mean device span {device / 1e3:.2f} ms, host "
          f"{np.mean([r['host_us'] for r in records]) / 1e3:.2f} ms, wait "
          f"{np.mean([r['wait_us'] for r in records]) / 1e3:.2f} ms")
    rows = "graph rows" if all("chunk_rows" in r for r in records) else "tokens"
    print(f"fit on prefill {rows} (R² {r2:.3f}"
          + (f"; on tokens {fit(records, padded=False)[1]:.3f}" if rows == "graph rows" else "")
          + "):")
    for name, c, m in zip(TERMS, coef, mean, strict=True):
        print(f"  {name:18s} {c:9.1f} µs x mean {m:7.2f} = {c * m / 1e3:6.2f} ms of the mean step")
    print("steps by prefill chunks: count, mean decode rows, mean prefill tokens, mean device ms")
    groups: dict[int, list[dict]] = collections.defaultdict(list)
    for r in records:
        groups[len(r["chunks"])].append(r)
    for k in sorted(groups):
        g = groups[k]
        print(f"  {k} chunks: {len(g):5d} steps, {np.mean([r['decode_rows'] for r in g]):5.1f} "
              f"decode, {np.mean([sum(r['chunks']) for r in g]):7.1f} prefill, "
              f"{np.mean([r['device_us'] for r in g]) / 1e3:6.2f} ms")
    rungs: dict[int, list[int]] = collections.defaultdict(list)
    for r in records:
        if r["decode_rows"] and not r["chunks"]:
            rungs[r.get("decode_graph_rows", r["decode_rows"])].append(r["device_us"])
    if rungs:
        print("decode-only steps by decode graph rows: steps, median device ms")
        for rows in sorted(rungs):
            print(f"  {rows:3d} rows: {len(rungs[rows]):5d} steps, "
                  f"{np.median(rungs[rows]) / 1e3:6.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
