"""bench/prefix_cache_bench.py: both sides get one trace in which the shared prefix is the only
thing a request can hit, the token comparison names the first stream that differs, and a sim run
prints and records every target."""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys

import pytest

from bench import prefix_cache_bench as pcb

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCK = 16


def trace_args(**kw) -> argparse.Namespace:
    base = {"streams": 6, "prefix": 200, "suffix": 40, "warmup_rounds": 1, "trials": 3}
    return argparse.Namespace(**{**base, **kw})


def test_every_prompt_is_the_shared_prefix_and_a_suffix_of_its_own_per_round_and_stream():
    warmup, rounds = pcb.prompts(trace_args(), 1000)
    assert (warmup, rounds) == pcb.prompts(trace_args(), 1000), "both sides must get one trace"
    assert len(rounds) == 4 and all(len(r) == 6 for r in rounds), "warm-up rounds + trials"
    prompts = warmup + [p for r in rounds for p in r]
    prefix = prompts[0][:200]
    assert all(p[:200] == prefix and len(p) == 240 for p in prompts)
    # the block holding the prefix's end and every later block differ between any two prompts
    tails = {tuple(p[200 // BLOCK * BLOCK:]) for p in prompts}
    assert len(tails) == len(prompts), "two prompts share a block past the prefix: a hit the " \
                                       "shared prefix does not explain"


def _side(*streams):
    return {"runs": [{"results": [None if s is None else {"tokens": s} for s in streams]}]}


def test_the_token_comparison_names_the_first_stream_that_differs_or_was_lost():
    assert pcb.identical(_side([1, 2], [3]), _side([1, 2], [3]))[0]
    same, detail = pcb.identical(_side([1, 2], [3]), _side([1, 2], [4]))
    assert not same and "stream 1" in detail
    assert not pcb.identical(_side([1], None), _side([1], None))[0], "a lost stream is no match"


@pytest.mark.slow
def test_a_sim_run_meets_and_records_every_target(tmp_path):
    env = {**os.environ, "GPUPLANE_BENCH_DEVICE": "sim"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "prefix_cache_bench.py"), "--backend", "sim",
         "--config", "tiny", "--streams", "4", "--prefix", "320", "--suffix", "16", "--new", "2",
         "--trials", "1", "--warmup-rounds", "0", "--record", str(tmp_path)], cwd=ROOT, env=env,
        capture_output=True, text=True, timeout=300, check=False)
    assert "prefix_cache_bench:" in proc.stdout and "Traceback" not in proc.stderr, \
        proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "changed from the default: --no-prefix-cache" in proc.stdout
    rows = [json.loads(x) for x in (tmp_path / "sim.jsonl").read_text().splitlines()]
    met = {r["metric"]: r["met"] for r in rows if r["met"] is not None}
    ttft = "4 streams: TTFT p50 uncached / cached"
    assert len(met) == 7 and ttft in met, met
    # the sim's timings say nothing about the product (and drift on a loaded host): only the
    # TTFT ratio may miss here; the prefill-token, identity, loss and ledger targets may not
    assert all(ok for name, ok in met.items() if name != ttft), met
    assert proc.returncode == (0 if met[ttft] else 1)
    hits = next(r["value"] for r in rows if r["metric"] == "cached: prefix cache hit tokens")
    assert hits == 4 * 320, "every stream should reuse the prefix's 20 full blocks"
