"""bench/int4_batched_bench.py's --xk on the sim at a small shape: every K-over-warps build is
checked against the default kernel, then timed at every row count; a result that differs stops
the run (WrongBuild) instead of timing. (The tuning builds' sweeps compile a module a build,
~7 s each with NVRTC: `python bench/int4_batched_bench.py --backend sim --small --rows-sweep
--xk` runs them all, 2 minutes.)"""
from __future__ import annotations

import pathlib
import tempfile

import numpy as np
import pytest

from bench import int4_batched_bench as bench
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.int4_batched import XK_BUILDS
from gpu_worker.kernels.selfcheck import KernelHarness

N, K = 96, 384


@pytest.fixture
def setup():
    dev = open_device("sim")
    h = KernelHarness(dev, KernelCompiler(dev.info.arch, cache_dir=pathlib.Path(tempfile.mkdtemp())))
    rng = np.random.default_rng(3)
    packed, scales = ref.int4_quantize(rng.standard_normal((N, K)).astype(np.float32) / 16)
    weights = [(h.put(packed), h.put(scales))]
    x = h.put(rng.standard_normal((64, K)).astype(np.float16))
    y = h.put(np.zeros((64, N), np.float32))
    yield dev, h, weights, x, y
    h.close()
    dev.close()


def every_second_read_off(h, monkeypatch) -> None:
    """From now on every second read of a result from the device is off by 1: the build
    checked against the default kernel reads second."""
    real, calls = h.get, iter(range(1 << 30))

    def get(p, shape, *a, **kw):
        out = real(p, shape, *a, **kw)
        return out + 1.0 if next(calls) % 2 else out
    monkeypatch.setattr(h, "get", get)


def test_the_xk_times_cover_both_entries_and_a_wrong_result_stops_them(setup, monkeypatch) -> None:
    dev, h, weights, x, y = setup
    times = bench.xk_times(dev, h, weights, x, y, N, K, 1, 1)
    assert set(times) == {(b, build) for b in bench.XK_BATCHES for build in XK_BUILDS}
    every_second_read_off(h, monkeypatch)   # an xk result's, not the default's
    with pytest.raises(bench.WrongBuild):
        bench.xk_times(dev, h, weights, x, y, N, K, 1, 1)


def one_row_lines(tmp_path, step1_s, launches, copy_gbs, same):
    import json

    from bench.record import Recorder
    from bench.targets import Targets
    t = Targets("int4_batched_bench", record=Recorder("int4_batched_bench", tmp_path,
                                                      device="test-gpu", argv=["x"]))
    bench.record_one_row(t, step1_s, launches, copy_gbs, same)
    lines = [json.loads(x) for x in (tmp_path / "test-gpu.jsonl").read_text().splitlines()]
    return t, {x["metric"]: x for x in lines}


def test_the_one_row_target_divides_by_a_copy_of_each_launchs_bytes(tmp_path) -> None:
    """Two shapes, 10 MB used 32 times and 200 MB once: the step's limit is the sum of each
    launch's bytes over the copy of those bytes; the 1 GiB fraction is recorded without a target."""
    from bench.limits import SameBytes
    same = {10_000_000: SameBytes(10_000_000, 2000.0, 2500.0, 1800.0),
            200_000_000: SameBytes(200_000_000, 2900.0, 2800.0, 2700.0)}
    launches = [(10_000_000, 32), (200_000_000, 1)]
    limit_s = 32 * 10e6 / 2500e9 + 200e6 / 2900e9
    t, lines = one_row_lines(tmp_path, limit_s / 0.75, launches, 3000.0, same)
    target = lines["decode step int4 linears at 1 row, fraction of a copy of the same bytes"]
    assert target["met"] is True and abs(target["value"] - 0.75) < 1e-9
    assert abs(target["limit"] - 520e6 / limit_s / 1e9) < 1e-6
    whole = lines["decode step int4 linears at 1 row, fraction of copy"]
    assert whole["target"] is None and whole["limit"] == 3000.0
    assert abs(whole["value"] - 520e6 / (limit_s / 0.75) / 3000e9) < 1e-9
    assert t.exit_code() == 0
    t, lines = one_row_lines(tmp_path / "slow", limit_s / 0.65, launches, 3000.0, same)
    assert lines["decode step int4 linears at 1 row, fraction of a copy of the same bytes"][
        "met"] is False
    assert t.exit_code() == 1


def test_without_every_shapes_copy_the_one_row_target_is_on_the_1gib_copy(tmp_path) -> None:
    from bench.limits import SameBytes
    same = {10_000_000: SameBytes(10_000_000, 2000.0, 2500.0, 1800.0)}   # 200 MB unmeasured
    t, lines = one_row_lines(tmp_path, 1e-3, [(10_000_000, 32), (200_000_000, 1)], 1000.0, same)
    assert set(lines) == {"decode step int4 linears at 1 row, fraction of copy"}
    assert lines["decode step int4 linears at 1 row, fraction of copy"]["met"] is False  # 0.52
    assert t.exit_code() == 1


def test_the_ablation_bits_are_the_kernels_own() -> None:
    import re

    from gpu_worker.kernels.int4_batched import SOURCE_XA
    cu = (pathlib.Path(bench.__file__).resolve().parents[1] / "gpu_worker" / "kernels" / "cu"
          / "int4_xa.cu").read_text()
    bits = {int(v) for v in re.findall(r"#define GP_XA_DROP_\w+ (\d+)", cu)}
    assert sorted(bench.XA_DROP.values()) == sorted(bits)
    assert all(p in bench.XA_DROP for _, parts in bench.XA_ABLATION_BUILDS for p in parts)
    kdef = bench.xa_ablation(("x loads", "dequantize"), tiled=True)
    assert kdef.entry == "gp_int4_mma_xa_tiled" and "-DGP_XA_DROP=20" in kdef.source.options
    assert kdef.source.module_name != SOURCE_XA.module_name   # never the library's module


def test_the_ablation_times_cover_xa_and_every_build(setup, monkeypatch) -> None:
    dev, h, weights, x, y = setup
    monkeypatch.setattr(bench, "XA_ABLATION_BUILDS", (("no x loads", ("x loads",)),))
    times = bench.xa_ablation_times(dev, h, weights, x, y, N, K, 1, 1)
    assert set(times) == {"xa", "no x loads"} and all(t > 0 for t in times.values())


def test_the_mma_only_build_keeps_the_mmas_and_drops_what_it_says() -> None:
    """The ablation removes the work it names from the code the GPU runs, and only that: the
    "mma only" build of xa's tiled entry keeps every mma.sync of the library's and has no
    ldmatrix and no PRMT (a build that kept them would time the same work under another name)."""
    nvrtc = pytest.importorskip("gpu_worker.compile.nvrtc")
    from gpu_worker.kernels.int4_batched import INT4_MMA_XA_TILED

    def counts(kdef) -> dict[str, int]:
        src = kdef.source
        ptx = nvrtc.compile_program(src.module_name, src.source, dict(src.headers), "sm_90",
                                    src.options).ptx
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        body = ptx.split(f".entry {kdef.entry}(")[1].split(".entry")[0]
        return {op: body.count(op) for op in ("mma.sync", "ldmatrix", "prmt")}
    library = counts(INT4_MMA_XA_TILED)
    mma_only = counts(bench.xa_ablation(tuple(bench.XA_DROP), tiled=True))
    assert library["ldmatrix"] and library["prmt"], library
    assert mma_only["mma.sync"] == library["mma.sync"], (library, mma_only)
    assert mma_only["ldmatrix"] == 0 and mma_only["prmt"] == 0, mma_only


def test_the_wgmma_times_run_on_the_models_tiled_layout(setup, monkeypatch) -> None:
    """--wgmma times the tiled entry over the weights as the model stores them, each row count
    checked first against xa's tiled entry on the same copies; --wgmma-wtma its build that
    takes the weights' and scales' tensor maps too (the sim checks they describe them)."""
    from gpu_worker.kernels.int4_batched import tile_packed, tile_scales
    dev, h, _, x, y = setup
    rng = np.random.default_rng(5)
    packed, scales = ref.int4_quantize(rng.standard_normal((N, K)).astype(np.float32) / 16)
    tiled = [(h.put(tile_packed(packed)), h.put(tile_scales(scales)))]
    monkeypatch.setattr(bench, "WGMMA_BATCHES", (64,))
    times = bench.wgmma_times(dev, h, tiled, x, y, N, K, 1, 1, tiled=True)
    assert set(times) == {64} and times[64] > 0
    assert bench.wgmma_times(dev, h, tiled, x, y, N, K, 1, 1, tiled=True, wtma=True)[64] > 0
    monkeypatch.setattr(bench, "WGMMA_BATCHES_N32", (32,))
    assert set(bench.wgmma_times(dev, h, tiled, x, y, N, K, 1, 1, tiled=True, x_rows=32)) == {32}
    every_second_read_off(h, monkeypatch)   # the wgmma result's, not the default's
    with pytest.raises(bench.WrongBuild):
        bench.wgmma_times(dev, h, tiled, x, y, N, K, 1, 1, tiled=True)


def test_the_wgmma_split_sweep_times_every_split_its_launcher_takes(setup, monkeypatch) -> None:
    """--wgmma-split-sweep: K = 384 is 3 k-groups, so splits 1, 2 and 3, each checked against
    wgmma_plan's split first; a wrong result stops the sweep."""
    dev, h, weights, x, y = setup
    monkeypatch.setattr(bench, "WGMMA_SPLIT_BATCHES", (64,))
    times = bench.wgmma_split_times(dev, h, weights, x, y, N, K, 1, 1, tiled=False)
    assert set(times) == {(64, 1), (64, 2), (64, 3)} and all(t > 0 for t in times.values())
    every_second_read_off(h, monkeypatch)   # a split's result, not the plan's
    with pytest.raises(bench.WrongBuild):
        bench.wgmma_split_times(dev, h, weights, x, y, N, K, 1, 1, tiled=False)
