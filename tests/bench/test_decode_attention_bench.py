"""bench/decode_attention_bench.py without a GPU: its flags (`--record` as every bench has it) and
the record lines its printed rows become (the ctx-8192 fraction of copy carries the target and the
limit it was divided by; every other row is a plain figure)."""
from __future__ import annotations

import json

import pytest

from bench import decode_attention_bench as dab
from bench.limits import L2_BYTES, SameBytes, same_bytes
from bench.record import FIELDS, RESULTS, Recorder
from bench.targets import DECODE_ATTENTION_CTX, DECODE_ATTENTION_OF_COPY, Targets

ARGV = ["bench/decode_attention_bench.py", "--reps", "20", "--trials", "5", "--record", "/tmp/o"]


def row(section, batch, ctx, us, of_copy, table=dab.TABLE):
    return {"section": section, "batch": batch, "ctx": ctx, "span": 128, "table": table,
            "us": us, "GBps": of_copy * 4250.0, "of_copy": of_copy}


def recorded(tmp_path, rows, copy_gbs=4250.0, same=None):
    t = Targets("decode_attention_bench",
                record=Recorder("decode_attention_bench", tmp_path, device="test-gpu", argv=ARGV))
    dab.record_rows(t, rows, copy_gbs, same)
    lines = [json.loads(x) for x in (tmp_path / "test-gpu.jsonl").read_text().splitlines()]
    return t, {x["metric"]: x for x in lines}


def test_record_takes_a_directory_or_defaults_to_bench_results_and_is_off_without_the_flag():
    assert dab.parse_args([]).record is None, "no --record: nothing is appended"
    assert dab.parse_args(["--record"]).record == str(RESULTS)
    args = dab.parse_args(["--record", "/tmp/out", "--reps", "3", "--trials", "2"])
    assert (args.record, args.reps, args.trials, args.backend) == ("/tmp/out", 3, 2, "cuda")


def test_the_8k_fraction_of_copy_is_a_target_with_its_limit_and_1k_is_a_plain_figure(tmp_path):
    rows = [row("new", 32, DECODE_ATTENTION_CTX, 312.1, 0.81), row("new", 1, 1024, 10.6, 0.09),
            row("new", 8, DECODE_ATTENTION_CTX, 94.4, 0.67)]
    t, lines = recorded(tmp_path, rows)
    for line in lines.values():
        assert set(FIELDS) <= set(line), f"a line lacks {set(FIELDS) - set(line)}"
        assert line["bench"] == "decode_attention_bench"
        assert line["command"] == "python bench/decode_attention_bench.py --reps 20 --trials 5", \
            "the recorded command re-runs the bench without --record"
    met = lines[f"paged decode batch 32, {DECODE_ATTENTION_CTX} keys: fraction of copy"]
    assert (met["value"], met["limit"], met["unit"]) == (0.81, 4250.0, "fraction")
    assert met["target"] == f">= {DECODE_ATTENTION_OF_COPY:g}" and met["met"] is True
    missed = lines[f"paged decode batch 8, {DECODE_ATTENTION_CTX} keys: fraction of copy"]
    assert missed["met"] is False, "0.67 of copy misses the 0.8 target"
    short = lines["paged decode batch 1, 1024 keys: fraction of copy"]
    assert short["target"] is None and short["met"] is None and short["limit"] == 4250.0
    assert lines["paged decode batch 1, 1024 keys: time"]["unit"] == "us"
    assert t.exit_code() == 1, "a missed target makes the bench exit 1"


def test_old_rule_ratio_and_empty_block_cost_are_recorded_and_the_sweep_is_not(tmp_path):
    rows = [row("new", 8, 1024, 24.0, 0.33), row("old", 8, 1024, 44.4, 0.18),
            row("span", 8, 1024, 19.5, 0.4),
            row("empty", 64, 1024, 82.6, 0.75), row("empty", 64, 1024, 82.2, 0.75, table=1024)]
    _, lines = recorded(tmp_path, rows)
    ratio = lines["paged decode batch 8, 1024 keys: span rule / old rule time"]
    assert abs(ratio["value"] - 24.0 / 44.4) < 1e-9 and ratio["unit"] == "ratio"
    empty = lines[f"empty blocks: batch 64, 1024 keys, table {dab.TABLE} - table 1024"]
    assert abs(empty["value"] - 0.4) < 1e-9 and empty["unit"] == "us"
    assert len(lines) == 4, f"the span sweep is printed, not recorded: {sorted(lines)}"


def test_the_lane_group_block_is_recorded_as_its_time_over_the_librarys_other_builds_are_not(tmp_path):
    rows = [row("new", 1, 1024, 7.8, 0.18), row("lanes", 1, 1024, 10.4, 0.13),
            row("late", 1, 1024, 8.7, 0.16), row("late-span", 1, 1024, 8.4, 0.17)]
    _, lines = recorded(tmp_path, rows)
    ratio = lines["paged decode batch 1, 1024 keys: lane-group block / tensor-core block time"]
    assert abs(ratio["value"] - 10.4 / 7.8) < 1e-9 and ratio["unit"] == "ratio"
    assert len(lines) == 3, f"only the library's rows and the lane-group ratio: {sorted(lines)}"


def test_builds_are_named_macro_lists_and_a_malformed_one_stops_the_run():
    args = dab.parse_args(["--cuda-core", "--no-sweep", "--build", "late=GP_FD_EARLY:0",
                           "--build", "x=GP_FD_MMA:1,GP_FD_EARLY:0"])
    assert args.cuda_core and args.no_sweep
    assert args.build == [("late", {"GP_FD_EARLY": 0}), ("x", {"GP_FD_MMA": 1, "GP_FD_EARLY": 0})]
    refused(dab.parse_build, ("late", "late=GP_FD_EARLY", "late=GP_FD_EARLY:x"), "NAME=MACRO:INT")


def refused(parse, values, hint: str) -> None:
    """Every one of `values` stops the run with a message naming the form it wants."""
    for bad in values:
        try:
            parse(bad)
        except SystemExit as e:
            assert hint in str(e)
        else:
            raise AssertionError(f"{bad!r} was accepted")


def test_the_carveout_rows_are_recorded_as_their_time_over_the_librarys(tmp_path):
    both = dict(row("carveout", 1, DECODE_ATTENTION_CTX, 19.0, 0.58), carveout=(100, "both"))
    split = dict(row("carveout", 1, DECODE_ATTENTION_CTX, 21.0, 0.52), carveout=(100, "split"))
    _, lines = recorded(tmp_path, [row("new", 1, DECODE_ATTENTION_CTX, 23.0, 0.48), both, split])
    name = f"paged decode batch 1, {DECODE_ATTENTION_CTX} keys"
    ratio = lines[f"{name}: carveout 100 % / no preference time"]
    assert abs(ratio["value"] - 19.0 / 23.0) < 1e-9 and ratio["unit"] == "ratio"
    ratio = lines[f"{name}: carveout 100 % on the split / no preference time"]
    assert abs(ratio["value"] - 21.0 / 23.0) < 1e-9


def test_carveouts_are_a_percent_and_the_kernels_they_apply_to():
    args = dab.parse_args(["--carveout", "100", "--carveout", "44:combine"])
    assert args.carveout == [(100, "both"), (44, "combine")]
    assert dab.parse_args([]).carveout == []
    refused(dab.parse_carveout, ("x", "101", "-1", "100:both2"), "PCT[:split|combine]")


def test_the_target_is_checked_where_the_kv_is_larger_than_the_l2(tmp_path):
    """Batch 1 at 8192 keys reads 33.5 MB, under the L2: a figure; its target row is the smallest
    power of two above 8192 whose KV is larger (16384 keys, 67 MB). From batch 8 it is 8192."""
    assert dab.kv_bytes(1, DECODE_ATTENTION_CTX) < L2_BYTES < dab.kv_bytes(1, 16384)
    assert dab.target_ctx(1) == 16384
    assert [dab.target_ctx(b) for b in (8, 32, 64)] == [DECODE_ATTENTION_CTX] * 3
    assert dab.contexts(1) == (1024, DECODE_ATTENTION_CTX, 16384)
    assert dab.contexts(8) == (1024, DECODE_ATTENTION_CTX)
    rows = [row("new", 1, DECODE_ATTENTION_CTX, 23.0, 0.48),
            row("new", 1, 16384, 30.0, 0.83, table=16384)]
    t, lines = recorded(tmp_path, rows)
    short = lines[f"paged decode batch 1, {DECODE_ATTENTION_CTX} keys: fraction of copy"]
    assert short["target"] is None and short["met"] is None, "under the L2: a figure"
    long = lines["paged decode batch 1, 16384 keys: fraction of copy"]
    assert long["target"] == f">= {DECODE_ATTENTION_OF_COPY:g}" and long["met"] is True
    assert t.exit_code() == 0


def test_with_a_copy_of_the_same_bytes_the_target_divides_by_it_and_the_1gib_fraction_is_a_figure(
        tmp_path):
    """A launch moving 67 MB copies at ~0.8 of the 1 GiB copy's rate: the target row divides by
    the copy of its own bytes; its fraction of the 1 GiB copy is recorded without a target."""
    nbytes = dab.kv_bytes(1, 16384)
    same = {nbytes: SameBytes(nbytes, memcpy_gbs=3400.0, kernel_gbs=3100.0, sum_gbs=2900.0)}
    rows = [row("new", 1, 16384, 30.0, 0.70, table=16384)]       # 2975 GB/s: 0.875 of 3400
    t, lines = recorded(tmp_path, rows, same=same)
    name = "paged decode batch 1, 16384 keys"
    of_same = lines[f"{name}: fraction of a copy of the same bytes"]
    assert of_same["met"] is True and of_same["limit"] == 3400.0
    assert abs(of_same["value"] - 0.70 * 4250.0 / 3400.0) < 1e-9
    whole = lines[f"{name}: fraction of copy"]
    assert (whole["target"], whole["met"], whole["limit"]) == (None, None, 4250.0)
    assert lines[f"{name}: copy of the same bytes"]["value"] == 3400.0
    assert lines[f"{name}: torch.sum of the same bytes"]["value"] == 2900.0
    assert t.exit_code() == 0


def test_a_decode_under_0_8_of_the_copy_of_its_bytes_misses(tmp_path):
    nbytes = dab.kv_bytes(8, DECODE_ATTENTION_CTX)
    same = {nbytes: SameBytes(nbytes, memcpy_gbs=3700.0, kernel_gbs=4000.0, sum_gbs=3900.0)}
    t, lines = recorded(tmp_path, [row("new", 8, DECODE_ATTENTION_CTX, 94.4, 0.74)], same=same)
    assert lines[f"paged decode batch 8, {DECODE_ATTENTION_CTX} keys: fraction of a copy of the "
                 "same bytes"]["met"] is False, "3145 GB/s is 0.79 of the faster copy's 4000 GB/s"
    assert t.exit_code() == 1


def test_without_a_device_there_is_no_copy_of_the_same_bytes():
    from bench import peer
    if peer.available():
        pytest.skip("a CUDA device is present: the copy is measured")
    assert same_bytes(dab.kv_bytes(1, 16384)) is None, "no device: never a default figure"


def test_the_read_in_the_decodes_order_is_recorded_at_batch_1_only_and_never_invented(
        tmp_path, monkeypatch, capsys):
    """[7]: at each batch-1 row, the read in the decode's order at the cluster decode's 64 CTAs
    and at 2 CTAs an SM, recorded with the decode's fraction of each (figures, no target);
    without a device nothing is printed or recorded."""
    asked = []

    def fake(nbytes, grids, heads, trials):
        asked.append((nbytes, grids, heads))
        return {ranks: 2000.0 + ranks for ranks in grids}
    monkeypatch.setattr(dab, "head_order_read", fake)
    t = Targets("decode_attention_bench",
                record=Recorder("decode_attention_bench", tmp_path, device="test-gpu", argv=ARGV))
    rows = [row("new", 1, 16384, 30.0, 0.5, table=16384), row("new", 8, 8192, 90.0, 0.8),
            row("old", 1, 16384, 31.0, 0.5, table=16384)]
    dab.head_order_limits(rows, 3, 132, t)
    assert asked == [(dab.kv_bytes(1, 16384), (8, 33), dab.KVH)], "batch 1's library row only"
    lines = {x["metric"]: x for x in map(json.loads,
                                         (tmp_path / "test-gpu.jsonl").read_text().splitlines())}
    name = "paged decode batch 1, 16384 keys: a read in the decode's order"
    assert lines[f"{name}, 64 CTAs"]["value"] == 2008.0 and lines[f"{name}, 64 CTAs"]["target"] is None
    assert abs(lines[f"{name}, 264 CTAs, the decode's fraction"]["value"] - 2125.0 / 2033.0) < 1e-9
    assert "[7] batch 1" in capsys.readouterr().out
    monkeypatch.setattr(dab, "head_order_read", lambda *a: None)
    dab.head_order_limits(rows, 3, 132, Targets("decode_attention_bench"))
    assert "[7]" not in capsys.readouterr().out, "no device: nothing printed"


def test_profile_only_launches_the_library_decode_and_records_nothing(tmp_path, capsys):
    """--profile is ncu's target: eager launches at each context, no timing, no record."""
    assert dab.main(["--backend", "sim", "--profile", "48,80", "--record", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "ctx 48, 8 times" in out and "ctx 80, 8 times" in out
    assert not list(tmp_path.iterdir()), "a profile run must not write figures"


def test_a_row_over_several_placements_records_their_spread_and_one_placement_does_not(tmp_path):
    placed = {**row("new", 1, 16384, 30.7, 0.72), "placements_us": [29.5, 30.7, 31.8]}
    single = {**row("new", 8, 1024, 18.4, 0.6), "placements_us": [18.4]}
    _, lines = recorded(tmp_path, [placed, single])
    spread = lines["paged decode batch 1, 16384 keys: slowest / fastest of 3 placements"]
    assert spread["value"] == pytest.approx(31.8 / 29.5) and spread["unit"] == "ratio"
    assert lines["paged decode batch 1, 16384 keys: time"]["value"] == 30.7, "the median's time"
    assert not any("placements" in m for m in lines if "batch 8" in m)


def test_placements_default_to_three_and_fewer_than_one_is_refused():
    assert dab.parse_args([]).placements == 3
    with pytest.raises(SystemExit, match="--placements 0: want 1 or more"):
        dab.main(["--placements", "0"])


def test_the_placement_check_records_times_spread_within_a_pool_and_across_pools(tmp_path):
    runs = iter([(30e-6, [30.3e-6, 29.7e-6]), (31.8e-6, [31.5e-6, 31.8e-6])])

    class Scripted:
        def decode(self, batch, ctx, span, table, library=False, again=0):
            assert (batch, ctx, library, again) == (1, dab.target_ctx(1), True, 2)
            first, retimed = next(runs)
            return first, dab.kv_bytes(batch, ctx), None, retimed
    t = Targets("decode_attention_bench",
                record=Recorder("decode_attention_bench", tmp_path, device="test-gpu", argv=ARGV))
    dab.placement_check(Scripted(), t, pools=2)
    lines = {json.loads(x)["metric"]: json.loads(x)
             for x in (tmp_path / "test-gpu.jsonl").read_text().splitlines()}
    name = f"paged decode batch 1, {dab.target_ctx(1)} keys"
    within = lines[f"{name}: slowest / fastest of one pool's graph timed 3 times (the widest of 2 pools)"]
    across = lines[f"{name}: slowest / fastest of 2 pools' first figures"]
    assert within["value"] == pytest.approx(30.3 / 29.7) and within["target"] is None
    assert across["value"] == pytest.approx(31.8 / 30.0)
