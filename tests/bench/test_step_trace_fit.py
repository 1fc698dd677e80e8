"""bench/step_trace_fit.py: the fit recovers the costs a trace was made with."""
from __future__ import annotations

import json
import random

import numpy as np

from bench.step_trace_fit import fit, load, main


def test_the_fit_recovers_known_per_pass_and_per_token_costs(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "steps.jsonl"
    truth = (1500.0, 60.0, 2500.0, 20.0)    # decode pass, per row, per chunk, per prefill token
    with path.open("w") as f:
        for step in range(400):
            decode = rng.choice([0, 8, 36, 64])
            chunks = [rng.randint(16, 600) for _ in range(rng.randint(0 if decode else 1, 3))]
            us = (truth[0] * (decode > 0) + truth[1] * decode + truth[2] * len(chunks)
                  + truth[3] * sum(chunks) + rng.uniform(-50, 50))
            f.write(json.dumps({"model": "m", "step": step, "decode_rows": decode,
                                "decode_graph_rows": decode, "chunks": chunks, "device_us": round(us), "host_us": 900,
                                "wait_us": 100}) + "\n")
    records = load(path, skip=10)
    assert len(records) == 390, "the first --skip steps (warm-up) are left out"
    coef, r2 = fit(records)
    assert np.allclose(coef, truth, rtol=0.05), coef
    assert r2 > 0.99


def test_the_report_splits_the_mean_step_and_lists_decode_steps_by_graph_rows(tmp_path, capsys,
                                                                             monkeypatch):
    path = tmp_path / "steps.jsonl"
    with path.open("w") as f:
        for step in range(40):
            decode, chunks = (8, []) if step % 4 else (16, [300])
            f.write(json.dumps({"model": "m", "step": step, "decode_rows": decode,
                                "decode_graph_rows": decode, "chunks": chunks,
                                "device_us": 3000 + 100 * decode + 9000 * len(chunks)
                                + 25 * sum(chunks) + step % 3, "host_us": 900,
                                "wait_us": 100}) + "\n")
    monkeypatch.setattr("sys.argv", ["step_trace_fit.py", str(path), "--skip", "0"])
    assert main() == 0
    out = capsys.readouterr().out
    assert "40 steps; mean device span" in out
    assert "  8 rows:    30 steps" in out, out


def test_with_graph_rows_recorded_the_fit_charges_a_chunks_padding_rows(tmp_path, capsys,
                                                                       monkeypatch):
    """Steps whose cost follows each chunk's bucket (its graph rows), not its tokens: the fit
    on `chunk_rows` recovers the per-row cost exactly; on tokens it cannot."""
    rng = random.Random(5)
    path = tmp_path / "steps.jsonl"
    with path.open("w") as f:
        for step in range(200):
            decode = rng.choice([0, 8, 64])
            chunks = [rng.randint(20, 1000) for _ in range(rng.randint(0 if decode else 1, 2))]
            rows = [1 << (n - 1).bit_length() for n in chunks]
            us = 1500 * (decode > 0) + 60 * decode + 2500 * len(chunks) + 20 * sum(rows)
            f.write(json.dumps({"model": "m", "step": step, "decode_rows": decode,
                                "decode_graph_rows": decode, "chunks": chunks,
                                "chunk_rows": rows, "device_us": us, "host_us": 900,
                                "wait_us": 100}) + "\n")
    records = load(path, skip=0)
    coef, r2 = fit(records)
    assert np.allclose(coef[2:], (2500.0, 20.0), rtol=1e-6) and r2 > 0.9999
    assert fit(records, padded=False)[1] < r2
    monkeypatch.setattr("sys.argv", ["step_trace_fit.py", str(path), "--skip", "0"])
    assert main() == 0
    assert "fit on prefill graph rows (R² 1.000; on tokens" in capsys.readouterr().out
