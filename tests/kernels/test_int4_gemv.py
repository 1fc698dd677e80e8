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


def test_int4_mma_tiles_give_every_sm_a_block_and_stay_in_registers() -> None:
    from gpu_worker.kernels.common import SIM_SM_COUNT as SM_COUNT
    from gpu_worker.kernels.int4_batched import SM_FILL, mma_tiles

    assert mma_tiles(16, 128256) == (2, 4), "lm_head: 64 rows per block, 2004 blocks"
    assert mma_tiles(16, 14336) == (2, 4)
    assert mma_tiles(16, 4096) == (2, 2), "wq: 128 blocks of 32 rows, not 64 blocks"
    assert mma_tiles(8, 1024) == (1, 1)
    # the H200's 132 SMs at Llama-3-8B shapes (int4_batched_bench --mt-sweep, docs/kernels.md)
    assert mma_tiles(8, 6144, 132) == (1, 4), "qkv: 96 blocks of 64 rows"
    assert mma_tiles(32, 28672, 132) == (4, 4), "gate/up at 32 rows: 448 blocks of 64 rows"
    assert mma_tiles(64, 28672, 132) == (8, 2), "gate/up at 64 rows: MT 2 is the most built"
    assert mma_tiles(64, 4096, 132) == (8, 2), "wo / w_down: 128 blocks, one wave"
    assert mma_tiles(32, 4096, 132) == (4, 2), "64 blocks of 64 rows would idle half the SMs"
    for m in (2, 9, 17, 33):
        for n in (1024, 4096, 14336):
            mt = mma_tiles(m, n)[1]
            assert mt == 1 or -(-n // (16 * mt)) >= SM_FILL * SM_COUNT


def test_int4_mma_refuses_a_tile_count_it_is_not_built_for() -> None:
    from gpu_worker.kernels.common import InvalidArgument
    from gpu_worker.kernels.int4_batched import MT_CHOICES, launch_int4_mma, mma_tiles

    calls: list = []

    class Recorder:
        def launch(self, fn, grid, block, args, stream=None):
            calls.append(grid)

    with pytest.raises(InvalidArgument, match="mt=4 not built for m=64"):
        launch_int4_mma(Recorder(), None, 0, 0, 0, 0, 0, 64, 4096, 4096, mt=4)
    assert not calls, "a refused launch launches nothing"
    for nt, choices in MT_CHOICES.items():
        assert all(mt * nt <= 16 for mt in choices), "the reduction buffer holds MT * NT <= 16"
        assert mma_tiles(8 * nt, 1 << 20, 132)[1] in choices, "the default is built"


def test_each_decode_batch_linear_runs_on_the_kernel_measured_fastest_for_its_rows() -> None:
    """mma_kernel's rule (int4_batched_bench --rows-sweep, --xa-sweep and --wgmma, docs/kernels.md):
    the rows kernel up to 8 rows, gp_int4_mma_xa from 9, gp_int4_wgmma from 40 on sm_90 (xa
    where the arch has no wgmma); and xa_plan at the H200's 132 SMs and
    Llama-3-8B shapes: gate/up unsplit on 224 CTAs of 128 weight rows, lm_head on 256-row CTAs,
    QKV split 4 and the 4096-row linears split 6 (192 CTAs: 0.7 of 2 CTA slots per SM)."""
    from gpu_worker.kernels.int4_batched import mma_kernel, xa_plan, xa_tile

    assert [mma_kernel(m) for m in (1, 8, 9, 16, 17, 33, 39, 40, 48, 64)] == \
        ["rows", "rows", "xa", "xa", "xa", "xa", "xa", "wgmma", "wgmma", "wgmma"]
    assert [mma_kernel(m, "sm_80") for m in (8, 40, 64)] == ["rows", "xa", "xa"]
    for m in (9, 16, 17, 32, 33, 64):
        assert xa_plan(m, 28672, 4096, 132) == (2, 1) and xa_tile(m, 2)[0] == 128
        assert xa_plan(m, 128256, 4096, 132) == ((4, 1) if m <= 32 else (2, 1))
        assert xa_plan(m, 6144, 4096, 132) == (2, 4)
        assert xa_plan(m, 4096, 4096, 132) == xa_plan(m, 4096, 14336, 132) == (2, 6)


def test_the_xa_plan_never_depends_on_the_row_count_and_keeps_two_k_groups_a_cta() -> None:
    """gp_int4_mma_xa's K order is fixed by its split (the weight tile changes no output's
    summation order), so a split of N and K alone keeps a row's result the same bits at every
    row count from 17 to 64; a split never leaves a CTA fewer than 2 k-groups and never exceeds
    a portable cluster."""
    from gpu_worker.kernels.int4_batched import MAX_SPLIT, MMA_K_ALIGN, xa_plan

    for n, k in ((28672, 4096), (128256, 4096), (6144, 4096), (4096, 14336), (1000, 4224),
                 (16, 256), (48, 128)):
        plans = {xa_plan(m, n, k, 132) for m in range(17, 65)}
        splits = {split for _, split in plans}
        assert len(splits) == 1, (n, k, plans)
        assert all(nt in (2, 4) for nt, _ in plans)
        split, = splits
        assert 1 <= split <= MAX_SPLIT and (split == 1 or k // MMA_K_ALIGN // split >= 2), (n, k)


def test_the_wgmma_split_follows_xa_s_rule_and_keeps_two_k_groups_a_cta() -> None:
    """wgmma_plan splits K where N alone fills less than XA_FILL of the CTA slots, as xa_plan
    does (Llama-3-8B on 132 SMs: gate/up and lm_head unsplit, QKV 4, wo and w_down 6; at 4
    warpgroups a CTA, one an SM, the slots halve and so do the tiles); a split never leaves a CTA
    fewer than 2 k-groups or exceeds a portable cluster, and it reads no row count."""
    from gpu_worker.kernels.int4_batched import MAX_SPLIT, MMA_K_ALIGN, wgmma_plan

    assert [wgmma_plan(n, k, 132) for n, k in ((28672, 4096), (128256, 4096), (6144, 4096),
                                               (4096, 4096), (4096, 14336))] == [1, 1, 4, 6, 6]
    assert wgmma_plan(28672, 4096, 132, groups=4) == 1 and wgmma_plan(6144, 4096, 132, groups=4) == 4
    for n, k in ((1000, 4224), (16, 256), (48, 128), (4096, 14336)):
        split = wgmma_plan(n, k, 132)
        assert 1 <= split <= MAX_SPLIT and (split == 1 or k // MMA_K_ALIGN // split >= 2), (n, k)


def test_the_wgmma_launch_takes_its_grid_and_cluster_from_the_plan() -> None:
    from gpu_worker.kernels.common import InvalidArgument
    from gpu_worker.kernels.int4_batched import (
        launch_int4_wgmma,
        launch_int4_wgmma_tiled,
        wgmma_shared_bytes,
    )

    class Recorder:
        info = type("Info", (), {"ordinal": 0})()
        name = "sim"   # sm_count: SIM_SM_COUNT, the H200's 132

        def launch(self, fn, grid, block, args, stream=None, shared_bytes=0, cluster=None,
                   pdl=False):
            self.call = (grid, block, shared_bytes, cluster)
            self.last_arg = args[-1]
            assert pdl, "the wgmma kernel waits for its inputs itself (gp_pdl_wait)"

        def tensor_map_2d(self, address, inner, outer, row_bytes, box):
            self.map = (address, inner, outer, row_bytes, box)
            return bytes(128)

    dev = Recorder()
    launch_int4_wgmma(dev, None, 16, 16, 16, 8, 0, 48, 6144, 4096)
    assert dev.call == ((4, 48, 1), (256, 1, 1), wgmma_shared_bytes(), (4, 1, 1))
    # x (at 16) by the TMA unit: its 48 rows of 4096 fp16, in boxes of 64 k x 64 rows
    assert dev.map == (16, 4096, 48, 8192, (64, 64)) and dev.last_arg.kind == "tmap"
    launch_int4_wgmma(dev, None, 16, 16, 16, 8, 0, 64, 28672, 4096, groups=4, stages=6)
    assert dev.call == ((1, 112, 1), (512, 1, 1), wgmma_shared_bytes(6, 4), None)
    with pytest.raises(InvalidArgument, match="split"):
        launch_int4_wgmma(dev, None, 16, 16, 16, 8, 0, 64, 4096, 256, split=3)
    launch_int4_wgmma(dev, None, 16, 16, 16, 8, 0, 32, 4096, 4096, x_rows=32)   # the n32 build
    assert dev.map[4] == (64, 32) and dev.call[2] == wgmma_shared_bytes(x_rows=32)
    with pytest.raises(InvalidArgument, match="the 32 rows of x"):
        launch_int4_wgmma(dev, None, 16, 16, 16, 8, 0, 33, 4096, 4096, x_rows=32)
    with pytest.raises(InvalidArgument, match="tiled layout"):
        launch_int4_wgmma_tiled(dev, None, 16, 16, 16, 8, 0, 64, 4100, 4096)


def test_the_xa_launch_takes_its_cluster_and_shared_memory_from_the_plan() -> None:
    from gpu_worker.kernels.common import InvalidArgument
    from gpu_worker.kernels.int4_batched import launch_int4_mma_xa, xa_shared_bytes

    calls: list = []

    class Recorder:
        info = type("Info", (), {"ordinal": 0})()
        name = "sim"

        def launch(self, fn, grid, block, args, stream=None, shared_bytes=0, cluster=None,
                   pdl=False):
            calls.append((grid, block, shared_bytes, cluster))
            assert pdl, "the xa kernel waits for its inputs itself (gp_pdl_wait)"

    launch_int4_mma_xa(Recorder(), None, 0, 0, 0, 0, 0, 64, 4096, 4096)
    grid, block, shared, cluster = calls[-1]
    assert grid == (6, 32, 1) and cluster == (6, 1, 1) and block == (256, 1, 1)
    assert shared == xa_shared_bytes(64, 2) and 2 * (shared + 1024) <= 228 << 10, "2 CTAs an SM"
    launch_int4_mma_xa(Recorder(), None, 0, 0, 0, 0, 0, 24, 28672, 4096)
    assert calls[-1][0] == (1, 224, 1) and calls[-1][3] is None, "no split, no cluster"
    assert calls[-1][2] == xa_shared_bytes(24, 2) < shared, "32 rows of x staged, not 64"
    launch_int4_mma_xa(Recorder(), None, 0, 0, 0, 0, 0, 40, 4096, 4096)
    assert xa_shared_bytes(24, 2) < calls[-1][2] == xa_shared_bytes(40, 2) < shared, \
        "33..48 rows: 48 rows of x staged (3 x tiles), not 64"
    launch_int4_mma_xa(Recorder(), None, 0, 0, 0, 0, 0, 16, 4096, 4096)
    assert calls[-1][2] == xa_shared_bytes(16, 2) < xa_shared_bytes(24, 2), \
        "up to 16 rows: one x tile staged"
    for bad, kw in (("split=9", {"split": 9}), ("nt=3", {"nt": 3}), ("m=65", {})):
        with pytest.raises(InvalidArgument, match=bad):
            launch_int4_mma_xa(Recorder(), None, 0, 0, 0, 0, 0, 65 if bad == "m=65" else 64,
                               4096, 4096, **kw)
    assert len(calls) == 4, "a refused launch launches nothing"


def test_a_rows_blocks_warps_come_from_n_and_the_device_so_a_rows_bits_never_depend_on_the_batch(
        ) -> None:
    """rows_warps: the fewest of 4 / 8 / 16 warps whose grid holds ROW_FILL of the SMs'
    resident warps (at 8b shapes on 132 SMs: gate/up and lm_head 4, QKV 8, wo and the down
    projection 16; rows16, two x tiles, at least 8). A launch's block follows it for every row
    count of the entry, and a warp count not built is refused before anything launches."""
    from gpu_worker.kernels.common import InvalidArgument
    from gpu_worker.kernels.int4_batched import (
        ROW_CTAS,
        ROW_FILL,
        launch_int4_mma_rows,
        launch_int4_mma_rows16,
        launch_int4_mma_rows_tiled,
        rows_warps,
    )

    shapes = {"qkv": 6144, "wo": 4096, "gate_up": 28672, "w_down": 4096, "lm_head": 128256}
    assert {k: rows_warps(n, 132) for k, n in shapes.items()} == {
        "qkv": 8, "wo": 16, "gate_up": 4, "w_down": 16, "lm_head": 4}
    assert {k: rows_warps(n, 132, 16) for k, n in shapes.items()} == {
        "qkv": 8, "wo": 16, "gate_up": 8, "w_down": 16, "lm_head": 8}
    for n in (16, 1009, 6144, 28672):
        w = rows_warps(n, 132)
        assert w == 16 or -(-n // 16) * w >= ROW_FILL * 132 * ROW_CTAS * 8
        assert w == 4 or -(-n // 16) * (w // 2) < ROW_FILL * 132 * ROW_CTAS * 8
    blocks: list = []

    class Recorder:
        class info:
            ordinal = 0

        def launch(self, fn, grid, block, args, stream=None, pdl=False):
            blocks.append(block)

    for n in (4096, 28672):
        for m in (1, 8):
            launch_int4_mma_rows(Recorder(), None, 0, 0, 0, 0, 0, m, n, 4096)
            launch_int4_mma_rows_tiled(Recorder(), None, 0, 0, 0, 0, 0, m, n, 4096)
        for m in (9, 16):
            launch_int4_mma_rows16(Recorder(), None, 0, 0, 0, 0, 0, m, n, 4096)
    assert blocks == [(512, 1, 1)] * 6 + [(128, 1, 1)] * 4 + [(256, 1, 1)] * 2
    with pytest.raises(InvalidArgument, match="warps=12 not built"):
        launch_int4_mma_rows(Recorder(), None, 0, 0, 0, 0, 0, 1, 4096, 4096, warps=12)
    with pytest.raises(InvalidArgument, match="warps=4 not built"):
        launch_int4_mma_rows16(Recorder(), None, 0, 0, 0, 0, 0, 9, 4096, 4096, warps=4)
    assert len(blocks) == 12, "a refused launch launches nothing"


def test_every_xk_build_fits_its_blocks_per_sm_and_its_split_depends_on_n_and_k_only() -> None:
    """gp_int4_mma_xk's K order is fixed by its build and split, so xk_plan reads N, K and the
    build alone (a row's bits are the same at 17..64 rows); each build's shared memory lets the
    blocks per SM its registers are bounded for (XK_CTAS) be resident at once."""
    from gpu_worker.device.sim_backend import SIM_MAX_SHARED_BYTES
    from gpu_worker.kernels.int4_batched import (
        MAX_SPLIT,
        MMA_K_ALIGN,
        SM_SHARED_BYTES,
        XK_BUILDS,
        XK_CTAS,
        xk_plan,
        xk_shared_bytes,
    )

    for nt, wk in XK_BUILDS:
        for n, k in ((28672, 4096), (128256, 4096), (6144, 4096), (4096, 14336), (1000, 4224)):
            splits = {xk_plan(m, n, k, nt, wk, 132) for m in range(17, 65)}
            assert len(splits) == 1, (nt, wk, n, k, splits)
            split, = splits
            assert 1 <= split <= MAX_SPLIT and (split == 1 or k // MMA_K_ALIGN // split >= 2)
        for m in (17, 33, 64):
            smem = xk_shared_bytes(m, nt, wk)
            assert smem <= SIM_MAX_SHARED_BYTES
            assert XK_CTAS[nt] * (smem + 1024) <= SM_SHARED_BYTES, (nt, wk, m, smem)


def test_the_async_rows_grid_is_what_is_resident_at_once_and_at_most_a_block_a_tile() -> None:
    """rows_async_grid: a persistent grid of the blocks the SMs hold at once (registers bounded
    for ROW_ASYNC_CTAS blocks of 8 warps, threads, shared memory), never more than the 16-row
    tiles; any grid gives the same bits (the GPU cases force 1..9 blocks)."""
    from gpu_worker.kernels.int4_batched import (
        SM_SHARED_BYTES,
        row_warps,
        rows_async_grid,
        rows_async_shared_bytes,
    )

    for n, k in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (48, 128)):
        warps = row_warps(k)
        for m in (1, 8, 9, 16):
            grid = rows_async_grid(m, n, warps, 132)
            tiles = -(-n // 16)
            assert 1 <= grid <= tiles
            per_sm = -(-grid // 132)
            assert grid == tiles or per_sm * (rows_async_shared_bytes(m, warps) + 1024) \
                <= SM_SHARED_BYTES, (n, k, m, grid)


def test_the_tile_layout_puts_each_quant_block_and_scale_where_the_tiled_kernels_read_it() -> None:
    """int4_batched.rows_tiled: quant block 4 kg + t of row 16 tile + 8 h + g (16 bytes) and its
    scale at index (tile * KG + kg) * 64 + 32 h + 4 g + t, the formula of the `_tiled` entries'
    sources (cu/int4_batched.cu, cu/int4_xa.cu, cu/half.cu); rows padded to whole tiles with
    weight 0 (nibble 8, scale 0); rows_untiled gives the reference layout back."""
    import numpy as np

    from gpu_worker.kernels.int4_batched import rows_tiled, rows_untiled

    rng = np.random.default_rng(3)
    n, k = 37, 384
    kb, kg_count = k // 32, k // 128
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    scales = rng.random((n, kb)).astype(np.float16)
    tp, ts = rows_tiled(packed, scales)
    assert tp.shape == (48 * k // 2,) and ts.shape == (48 * kb,)
    for r in range(48):
        for qb in range(kb):
            tile, h, g, kg, t = r // 16, r % 16 // 8, r % 8, qb // 4, qb % 4
            i = (tile * kg_count + kg) * 64 + 32 * h + 4 * g + t
            block, scale = tp[16 * i:16 * i + 16], ts[i]
            if r < n:
                assert np.array_equal(block, packed[r, 16 * qb:16 * qb + 16]) and \
                    scale == scales[r, qb], (r, qb)
            else:
                assert (block == 0x88).all() and scale == 0, (r, qb)
    back = rows_untiled(tp, ts, n, k)
    assert np.array_equal(back[0], packed) and np.array_equal(back[1], scales)
