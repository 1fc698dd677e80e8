"""bench/prefill_linear_bench.py on the sim at smoke sizes: it times only the dequantization
builds that are bit-exact, records each build per weight and one layer's linears per row count,
and a wrong build is a printed requirement that fails the run."""
from __future__ import annotations

import json

from bench import prefill_linear_bench as plb
from gpu_worker.kernels.half import DEQUANT_WORDS_CHOICES
from gpu_worker.kernels.selfcheck import Outcome

ARGV = ["--backend", "sim", "--small", "--reps", "1", "--trials", "1"]


def run(tmp_path, monkeypatch) -> tuple[int, dict]:
    monkeypatch.setenv("GPUPLANE_BENCH_DEVICE", "test-gpu")
    rc = plb.main([*ARGV, "--record", str(tmp_path)])
    lines = [json.loads(x) for x in (tmp_path / "test-gpu.jsonl").read_text().splitlines()]
    return rc, {x["metric"]: x for x in lines}


def test_every_exact_build_is_timed_on_every_weight_and_each_row_count_gives_a_layer(tmp_path,
                                                                                    monkeypatch):
    rc, lines = run(tmp_path, monkeypatch)
    assert rc == 0
    for words in DEQUANT_WORDS_CHOICES:
        assert lines[f"int4_dequant_f16 with {words} words a thread is bit-exact"]["met"] is True
        timed = [m for m in lines if m.startswith("int4_dequant_f16 ")
                 and m.endswith(f", {words} words a thread")]
        assert len(timed) == len(plb.SHAPES), f"build {words}: {timed}"
        assert all(lines[m]["value"] > 0 for m in timed)
    layers = [m for m in lines if m.startswith("prefill linears of one layer")]
    assert len(layers) == len(plb.ROWS), layers


def test_a_build_that_differs_from_the_reference_is_missed_and_not_timed(tmp_path, monkeypatch):
    real = plb.int4_dequant_f16_case

    def case(h, rng, *a, words=None, **kw):
        out = real(h, rng, *a, words=words, **kw)
        if words == 4:   # as if the 4-word build wrote one wrong half
            got = out.got.copy()
            got.flat[0] ^= 1
            return Outcome(got, out.want)
        return out
    monkeypatch.setattr(plb, "int4_dequant_f16_case", case)
    rc, lines = run(tmp_path, monkeypatch)
    assert rc == 1, "a wrong build fails the run"
    assert lines["int4_dequant_f16 with 4 words a thread is bit-exact"]["met"] is False
    assert not [m for m in lines if m.endswith(", 4 words a thread")], "the wrong build was timed"
