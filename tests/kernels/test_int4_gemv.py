"""The fused int4 GEMV's host-side geometry agrees with its kernel source, and the source compiles
(NVRTC, no GPU needed) in every variant the tuning sweep builds."""
from __future__ import annotations

import re

import pytest

from gpu_worker.kernels import linear
from gpu_worker.kernels.linear import SOURCE


def _macro(name: str) -> int:
    m = re.search(rf"#define {name} (\d+)", SOURCE.source)
    assert m, f"{name} has no default in gp_linear"
    return int(m.group(1))


def test_launch_geometry_matches_the_kernel_macros() -> None:
    assert _macro("GP_I4_WARPS") == linear.FUSED_WARPS
    assert _macro("GP_I4_NC") == linear.FUSED_WARP_COLS
    assert _macro("GP_I4_ROWS") == linear.FUSED_ROWS
    assert linear.FUSED_COLS == linear.FUSED_WARPS * linear.FUSED_WARP_COLS


def test_launch_uses_the_kernels_block_and_column_tiling() -> None:
    calls: list = []

    class Recorder:
        def launch(self, fn, grid, block, args, stream=None):
            calls.append((grid, block))

    linear.launch_int4_matmul(Recorder(), None, 0, 0, 0, 0, 0, 5, 4097, 64)
    grid, block = calls[0]
    assert block == (32 * linear.FUSED_WARPS, 1, 1)
    assert grid == (-(-4097 // linear.FUSED_COLS), 2, 1), "every column and row covered once"


def test_every_sweep_variant_compiles_without_spills() -> None:
    nvrtc = pytest.importorskip("gpu_worker.compile.nvrtc")
    try:
        nvrtc.nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - no NVRTC on this machine: nothing to compile with
        pytest.skip(f"NVRTC unavailable: {exc}")
    from bench.int4_gemv_sweep import VARIANTS, variant_source

    for v in VARIANTS:
        src = variant_source(v)
        out = nvrtc.compile_program(src.module_name, src.source, dict(src.headers), "sm_90",
                                    [*src.options, "--ptxas-options=-v"])
        log = out.log
        spills = re.findall(r"(\d+) bytes spill stores", log)
        assert spills and all(s == "0" for s in spills), f"{v}: register spills\n{log}"


def test_int4_mma_tiles_fill_the_sms_and_fit_the_entries() -> None:
    from gpu_worker.kernels.common import SIM_SM_COUNT as SMS
    from gpu_worker.kernels.int4_batched import MAX_CLUSTER, mma_shared_bytes, mma_tiles

    assert mma_tiles(16, 4096, 4096) == (2, 2, 8), "wo: 16 row blocks x 8 K splits = 128 CTAs"
    assert mma_tiles(64, 128256, 4096)[1:] == (1, 1), "lm_head: rows enough, no split"
    assert mma_tiles(64, 4096, 4096)[1] == 1, "64 rows: one 16-row tile per warp (registers)"
    for m in (1, 2, 9, 17, 33, 64):
        for n, k in ((1024, 4096), (4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336),
                     (48, 128), (100, 1024)):
            nt, mt, s = mma_tiles(m, n, k)
            ctas = -(-n // (128 * mt)) * s
            assert nt * 8 >= m and mt in (1, 2) and 1 <= s <= min(MAX_CLUSTER, k // 128)
            assert mma_shared_bytes(nt, mt, s) <= 227 << 10
            if n * k >= 4096 * 4096:   # big linears keep >= 70 % of the SMs busy in their waves
                assert ctas / (-(-ctas // SMS) * SMS) >= 0.7, (m, n, k, nt, mt, s)


def test_int4_mma_entries_compile_without_spills() -> None:
    nvrtc = pytest.importorskip("gpu_worker.compile.nvrtc")
    try:
        nvrtc.nvrtc_version()
    except Exception as exc:  # noqa: BLE001 - no NVRTC on this machine: nothing to compile with
        pytest.skip(f"NVRTC unavailable: {exc}")
    from gpu_worker.kernels.int4_batched import SOURCE as MMA

    out = nvrtc.compile_program(MMA.module_name, MMA.source, dict(MMA.headers), "sm_90",
                                [*MMA.options, "--ptxas-options=-v"])
    spills = re.findall(r"(\d+) bytes spill stores", out.log)
    assert len(spills) == 4 and all(s == "0" for s in spills), out.log
