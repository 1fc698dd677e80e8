"""The batched tensor-core int4 linear (gpu_worker.kernels.int4_batched) on a real device against
reference.int4_matmul at 8b-int4 shapes (wq 4096x4096, w_gate 14336x4096, w_down 4096x14336, a
slice of lm_head) and batch 1..64, plus the small shared cases (selfcheck.CASES' int4_mma*).

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_int4_batched.py -v
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.int4_batched import (
    MT_CHOICES,
    ROW_ASYNC_BUILDS,
    XA_NT,
    XK_BUILDS,
    rows_async_build,
    x_tiles,
)
from gpu_worker.kernels.selfcheck import (
    CASES,
    Case,
    KernelHarness,
    int4_mma_case,
    int4_mma_rows_async_case,
    int4_mma_rows_case,
    int4_mma_xa_case,
    int4_mma_xk_case,
    int4_wgmma_case,
)

pytestmark = pytest.mark.gpu

SHARED = [c for c in CASES if c.kernel.startswith("int4_mma")]
MODEL: list[Case] = [
    Case("int4_mma", int4_mma_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((2, 4096, 4096, {}), (16, 14336, 4096, {"bias": True}),
                           (16, 4096, 14336, {"accumulate": True}), (8, 4096, 4096, {}),
                           (32, 4096, 14336, {}), (64, 16032, 4096, {}), (64, 4096, 4096, {}),
                           (5, 1024, 4096, {}), (64, 28672, 4096, {}),
                           (33, 6144, 4096, {"bias": True, "accumulate": True}),
                           (64, 4096, 14336, {}), (24, 1000, 4224, {}))
]
# every 16-row-tile count per warp the kernel is built for, forced, at odd N (a partial last
# block) and K not a power of two: each (NT, MT) instantiation and its row guards
FORCED: list[Case] = [
    Case("int4_mma", int4_mma_case, {"m": m, "n": 1000 + m, "k": 4224, "mt": mt,
                                     "accumulate": m % 2 == 1})
    for m in (5, 16, 24, 64) for mt in MT_CHOICES[x_tiles(m)]
]

# the x-as-A kernel at the decode step's shapes on its default plan (17..64 rows: every x tile
# count), then every weight tile forced with K split over 1, 3 and 8 CTAs, odd N and K
XA: list[Case] = [
    Case("int4_mma_xa", int4_mma_xa_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((17, 6144, 4096, {"bias": True}), (32, 4096, 4096, {}),
                           (33, 28672, 4096, {"accumulate": True}), (64, 4096, 14336, {}),
                           (64, 6144, 4096, {"bias": True, "accumulate": True}),
                           (64, 128256, 4096, {}), (48, 1000, 4224, {}), (64, 28672, 4096, {}))
] + [
    Case("int4_mma_xa", int4_mma_xa_case, {"m": m, "n": 1000 + m, "k": 4224, "nt": nt,
                                           "split": split, "accumulate": m % 2 == 1})
    for m in (9, 16, 24, 40, 63) for nt in XA_NT for split in (1, 3, 8)
]
# the rows kernels at the decode step's shapes (1, 2, 8 rows on gp_int4_mma_rows, 9 and 16 on
# rows16), odd N (a partial last block) and K not a power of two
ROWS: list[Case] = [
    Case("int4_mma_rows", int4_mma_rows_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((1, 6144, 4096, {}), (1, 4096, 14336, {"accumulate": True}),
                           (1, 16032, 4096, {"bias": True}), (2, 28672, 4096, {}),
                           (8, 4096, 4096, {"bias": True, "accumulate": True}),
                           (1, 1001, 4224, {}), (7, 1001, 4224, {"accumulate": True}),
                           (9, 6144, 4096, {}), (16, 4096, 14336, {"accumulate": True}),
                           (16, 1009, 4224, {"bias": True}))
]
# the K-over-warps kernels at the decode step's shapes on their plan (every x tile count), then
# every build with K split over 1, 3 and 8 CTAs at odd N and K, and stages builds
XK: list[Case] = [
    Case("int4_mma_xk", int4_mma_xk_case, {"m": m, "n": n, "k": k, "nt": nt, "wk": wk, **extra})
    for nt, wk in XK_BUILDS
    for m, n, k, extra in ((17, 6144, 4096, {"bias": True}), (32, 4096, 4096, {}),
                           (33, 28672, 4096, {"accumulate": True}), (64, 4096, 14336, {}),
                           (64, 6144, 4096, {"bias": True, "accumulate": True}),
                           (64, 128256, 4096, {}), (48, 1000, 4224, {}))
] + [
    Case("int4_mma_xk", int4_mma_xk_case, {"m": m, "n": 1000 + m, "k": 4224, "nt": nt, "wk": wk,
                                           "split": split, "accumulate": m % 2 == 1})
    for m in (24, 40, 63) for nt, wk in XK_BUILDS for split in (1, 3, 8)
] + [
    Case("int4_mma_xk", int4_mma_xk_case, {"m": 64, "n": 1009, "k": 4224, "nt": nt, "wk": wk,
                                           "stages": stages})
    for nt, wk in XK_BUILDS for stages in (3, 6)
]
# the rows kernels' split with cp.async weights on a persistent grid: the decode step's shapes
# on its default grid, then few blocks (many tiles a block: the rings run on across tiles) and
# every tuning build
ROWS_ASYNC: list[Case] = [
    Case("int4_mma_rows_async", int4_mma_rows_async_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((1, 6144, 4096, {}), (1, 4096, 14336, {"accumulate": True}),
                           (1, 128256, 4096, {"bias": True}), (2, 28672, 4096, {}),
                           (8, 4096, 4096, {"bias": True, "accumulate": True}),
                           (1, 1001, 4224, {"grid": 7}), (7, 1001, 4224, {"grid": 1}),
                           (9, 6144, 4096, {"grid": 5}), (16, 4096, 14336, {"accumulate": True}),
                           (16, 1009, 4224, {"bias": True, "grid": 3}), (3, 128, 128, {}))
] + [
    Case("int4_mma_rows_async", int4_mma_rows_async_case,
         {"m": m, "n": 1001, "k": 4224, "grid": 9, "stages": stages, "ctas": ctas})
    for stages, ctas in ROW_ASYNC_BUILDS for m in (1, 16)
]
# the warpgroup-MMA kernel at the decode step's shapes from 17 to 64 rows, odd N and K
WGMMA: list[Case] = [
    Case("int4_wgmma", int4_wgmma_case, {"m": m, "n": n, "k": k, **extra})
    for m, n, k, extra in ((64, 28672, 4096, {}), (64, 128256, 4096, {"bias": True}),
                           (33, 6144, 4096, {"accumulate": True}), (48, 4096, 14336, {}),
                           (17, 1009, 4224, {"bias": True, "accumulate": True}), (1, 100, 128, {}))
] + [
    Case("int4_wgmma_tiled", int4_wgmma_case, {"m": m, "n": n, "k": k, "tiled": True, **extra})
    for m, n, k, extra in ((64, 28672, 4096, {}), (40, 4096, 14336, {"accumulate": True}),
                           (23, 1008, 4224, {"bias": True}))
]
ALL = SHARED + MODEL + FORCED + XA + XK + ROWS + ROWS_ASYNC + WGMMA


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device

    device = open_device("cuda")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", ALL, ids=[c.id for c in ALL])
def test_cuda_int4_mma_matches_the_f32_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    harness.close()
    assert failure is None, f"{case.id}: device result differs from the reference: {failure}"


def test_int4_mma_is_deterministic_run_to_run(harness) -> None:
    """The split-K sum is in warp order (no atomics): two runs give identical bits."""
    for m in (16, 64):
        outs = [int4_mma_case(harness, np.random.default_rng(1), m, 4096, 4096).got for _ in range(2)]
        assert np.array_equal(outs[0], outs[1]), m
    for split in (1, 8):   # the xa kernel's cluster sum is in rank order
        outs = [int4_mma_xa_case(harness, np.random.default_rng(1), 64, 4096, 4096,
                                 split=split).got for _ in range(2)]
        assert np.array_equal(outs[0], outs[1]), ("xa", split)



def _weights_and_x(harness, seed: int, n: int, k: int, rows: int):
    """Device copies of a quantized n x k weight and `rows` rows of fp16 x."""
    from gpu_worker.kernels import reference as ref

    rng = np.random.default_rng(seed)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32) / 16)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    return harness.put(packed), harness.put(scales), harness.put(x)


def _rows_result(harness, kdef, pk: int, sc: int, xd: int, m: int, n: int, k: int, **kw):
    y = harness.put(np.zeros((m, n), np.float32))
    kdef.launcher(harness.device, harness.function(kdef), y, xd, pk, sc, 0, m, n, k, **kw)
    return harness.get(y, (m, n))


def test_the_rows_kernels_give_int4_mma_bits_and_a_row_the_same_bits_at_any_batch_up_to_16(
        harness) -> None:
    """gp_int4_mma_rows and rows16 keep gp_int4_mma's K slices and warp order (at QKV's N both
    run 8 warps a block: rows_warps), so their result is gp_int4_mma's bit for bit; each mma
    output element sums only its own row's products, so a row's bits do not depend on how many
    rows share the call (1..16)."""
    from gpu_worker.kernels.int4_batched import INT4_MMA, INT4_MMA_ROWS, INT4_MMA_ROWS16

    n, k = 6144, 4096
    pk, sc, xd = _weights_and_x(harness, 7, n, k, 16)
    firsts = []
    for m in (1, 2, 8, 9, 16):
        got = _rows_result(harness, INT4_MMA_ROWS if m <= 8 else INT4_MMA_ROWS16, pk, sc, xd, m, n, k)
        want = _rows_result(harness, INT4_MMA, pk, sc, xd, m, n, k)
        assert np.array_equal(got, want), (m, np.abs(got - want).max())
        firsts.append(got[0])
    harness.close()
    for m, first in zip((2, 8, 9, 16), firsts[1:]):
        assert np.array_equal(first, firsts[0]), m


def test_a_rows_bits_do_not_depend_on_the_batch_at_4_and_16_warps_a_block(harness) -> None:
    """rows_warps reads N and the device only: where the down projection's blocks run 16 warps
    and gate/up's rows blocks 4, a row's bits are the same at 1..8 rows (and, at 16 warps, on
    rows16 at 9..16), and each sum agrees with the 8-warp one within the contract's tolerance."""
    from gpu_worker.kernels.common import sm_count
    from gpu_worker.kernels.int4_batched import INT4_MMA_ROWS, INT4_MMA_ROWS16, rows_warps

    for n, k, warps in ((4096, 14336, 16), (28672, 4096, 4)):
        assert rows_warps(n, sm_count(harness.device)) == warps
        pk, sc, xd = _weights_and_x(harness, 11, n, k, 16)
        rows = (1, 2, 8, 9, 16) if warps == 16 else (1, 2, 8)
        firsts = [_rows_result(harness, INT4_MMA_ROWS if m <= 8 else INT4_MMA_ROWS16, pk, sc, xd,
                               m, n, k)[0] for m in rows]
        eight = _rows_result(harness, INT4_MMA_ROWS, pk, sc, xd, 1, n, k, warps=8)[0]
        harness.close()
        for m, first in zip(rows[1:], firsts[1:]):
            assert np.array_equal(first, firsts[0]), (n, m)
        assert np.allclose(firsts[0], eight, rtol=1e-4, atol=1e-4 * np.abs(eight).max()), n


@pytest.mark.parametrize("nt,wk", XK_BUILDS)
def test_a_rows_bits_on_the_xk_kernels_do_not_depend_on_the_batch_and_repeat(harness, nt,
                                                                             wk) -> None:
    """gp_int4_mma_xk's summation order (each warp's k16 steps, a group's fixed tree, the
    cluster's ranks) depends on N, K and the build only: a row's bits are the same at 17..64
    rows (every x tile count), and two runs give the same bits."""
    from gpu_worker.kernels.int4_batched import XK_KERNELS

    for n, k in ((6144, 4096), (4096, 14336)):
        pk, sc, xd = _weights_and_x(harness, 17, n, k, 64)
        firsts = [_rows_result(harness, XK_KERNELS[nt], pk, sc, xd, m, n, k, wk=wk)[0]
                  for m in (17, 32, 33, 48, 49, 64)]
        again = _rows_result(harness, XK_KERNELS[nt], pk, sc, xd, 64, n, k, wk=wk)[0]
        harness.close()
        for m, first in zip((32, 33, 48, 49, 64), firsts[1:]):
            assert np.array_equal(first, firsts[0]), (n, k, m)
        assert np.array_equal(again, firsts[-1]), (n, k, "run to run")


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1009, 4224)])
def test_the_async_rows_kernels_give_the_rows_kernels_bits_on_any_grid_and_build(harness, n,
                                                                                   k) -> None:
    """gp_int4_mma_rows(16)_async keep the rows kernels' warps, K slices, mma order and warp-order
    sums; only how the weights arrive and which block takes a tile change. So at 1..16 rows,
    on the default grid, on a grid of 3 blocks (each many tiles, the ring running on across
    them) and in every tuning build, the result is the rows kernels' bit for bit."""
    from gpu_worker.kernels.int4_batched import INT4_MMA_ROWS, INT4_MMA_ROWS16, row_warps

    pk, sc, xd = _weights_and_x(harness, 13, n, k, 16)
    for m in (1, 2, 8, 9, 16):   # the async builds' warps: row_warps(k)
        want = _rows_result(harness, INT4_MMA_ROWS if m <= 8 else INT4_MMA_ROWS16, pk, sc, xd, m,
                            n, k, warps=row_warps(k))
        for stages, ctas in ROW_ASYNC_BUILDS:   # the library's build among them
            kdef = rows_async_build(stages, ctas)[0 if m <= 8 else 1]
            for grid in (None, 3):
                got = _rows_result(harness, kdef, pk, sc, xd, m, n, k, grid=grid)
                assert np.array_equal(got, want), (m, stages, ctas, grid,
                                                   np.abs(got - want).max())
    harness.close()


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1009, 4224)])
def test_the_tiled_rows_kernels_give_the_rows_kernels_bits(harness, n, k) -> None:
    """gp_int4_mma_rows(16)_tiled read each lane's quant blocks from the 16-row tile layout
    (int4_batched.rows_tiled) and keep everything else: at 1..16 rows, 8 and 16 warps a block,
    and a partial last tile (N = 1009), the result is the rows kernels' bit for bit."""
    from gpu_worker.kernels import reference as ref
    from gpu_worker.kernels.int4_batched import (
        INT4_MMA_ROWS,
        INT4_MMA_ROWS16,
        INT4_MMA_ROWS16_TILED,
        INT4_MMA_ROWS_TILED,
        rows_tiled,
    )

    rng = np.random.default_rng(19)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32) / 16)
    xd = harness.put(rng.standard_normal((16, k)).astype(np.float16))
    pk, sc = harness.put(packed), harness.put(scales)
    tpk, tsc = (harness.put(a) for a in rows_tiled(packed, scales))
    for m in (1, 2, 8, 9, 16):
        rows, tiled = ((INT4_MMA_ROWS, INT4_MMA_ROWS_TILED) if m <= 8
                       else (INT4_MMA_ROWS16, INT4_MMA_ROWS16_TILED))
        for warps in (4, 8, 16) if m <= 8 else (8, 16):
            want = _rows_result(harness, rows, pk, sc, xd, m, n, k, warps=warps)
            got = _rows_result(harness, tiled, tpk, tsc, xd, m, n, k, warps=warps)
            assert np.array_equal(got, want), (m, warps, np.abs(got - want).max())
    harness.close()


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1009, 4224)])
def test_the_tiled_xa_kernel_gives_the_xa_kernels_bits(harness, n, k) -> None:
    """gp_int4_mma_xa_tiled moves only its copies' sources (the 16-row tile layout): at 9..64
    rows (every x tile count), both weight tiles and K split over 1, 3 and 8 CTAs, and a partial
    last tile, the result is gp_int4_mma_xa's bit for bit."""
    from gpu_worker.kernels import reference as ref
    from gpu_worker.kernels.int4_batched import INT4_MMA_XA, INT4_MMA_XA_TILED, rows_tiled

    rng = np.random.default_rng(23)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32) / 16)
    xd = harness.put(rng.standard_normal((64, k)).astype(np.float16))
    pk, sc = harness.put(packed), harness.put(scales)
    tpk, tsc = (harness.put(a) for a in rows_tiled(packed, scales))
    for m in (9, 17, 33, 64):
        for nt, split in ((None, None), *((nt, s) for nt in XA_NT for s in (1, 3, 8))):
            want = _rows_result(harness, INT4_MMA_XA, pk, sc, xd, m, n, k, nt=nt, split=split)
            got = _rows_result(harness, INT4_MMA_XA_TILED, tpk, tsc, xd, m, n, k, nt=nt,
                               split=split)
            assert np.array_equal(got, want), (m, nt, split, np.abs(got - want).max())
    harness.close()


@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336), (1008, 4224)])
def test_the_tiled_wgmma_kernel_gives_the_wgmma_kernels_bits(harness, n, k) -> None:
    """gp_int4_wgmma_tiled moves only its copies' sources (the 16-row tile layout), so at 1..64
    rows and with a partial last CTA its result is gp_int4_wgmma's bit for bit."""
    from gpu_worker.kernels import reference as ref
    from gpu_worker.kernels.int4_batched import INT4_WGMMA, INT4_WGMMA_TILED, rows_tiled

    rng = np.random.default_rng(29)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32) / 16)
    xd = harness.put(rng.standard_normal((64, k)).astype(np.float16))
    pk, sc = harness.put(packed), harness.put(scales)
    tpk, tsc = (harness.put(a) for a in rows_tiled(packed, scales))
    for m in (1, 17, 64):
        want = _rows_result(harness, INT4_WGMMA, pk, sc, xd, m, n, k)
        got = _rows_result(harness, INT4_WGMMA_TILED, tpk, tsc, xd, m, n, k)
        assert np.array_equal(got, want), (m, np.abs(got - want).max())
    harness.close()


def test_a_rows_bits_on_the_wgmma_kernel_do_not_depend_on_the_batch(harness) -> None:
    """gp_int4_wgmma always multiplies 64 rows of x (zeros past M), and its K split (4 at this
    N) depends on N and K only, so a row's result is the same bits at any row count."""
    from gpu_worker.kernels.int4_batched import INT4_WGMMA

    n, k = 6144, 4096
    pk, sc, xd = _weights_and_x(harness, 5, n, k, 64)
    firsts = [_rows_result(harness, INT4_WGMMA, pk, sc, xd, m, n, k)[0] for m in (1, 17, 33, 64)]
    harness.close()
    for m, first in zip((17, 33, 64), firsts[1:]):
        assert np.array_equal(first, firsts[0]), m


def test_a_rows_bits_on_the_xa_kernel_do_not_depend_on_the_batch_from_1_to_64(harness) -> None:
    """gp_int4_mma_xa's split depends on N and K only, its weight tile changes no summation
    order, and an mma output element sums only its own row's products, so a row's bits are the
    same at every row count it takes (1..64: mma_kernel routes it 17..64, the sweep times its
    1-x-tile build against rows16), split or not."""
    from gpu_worker.kernels.common import sm_count
    from gpu_worker.kernels.int4_batched import INT4_MMA_XA, xa_plan

    for n, k in ((6144, 4096), (128256, 4096)):
        assert len({xa_plan(m, n, k, sm_count(harness.device))[1] for m in range(17, 65)}) == 1
        pk, sc, xd = _weights_and_x(harness, 13, n, k, 64)
        firsts = [_rows_result(harness, INT4_MMA_XA, pk, sc, xd, m, n, k)[0]
                  for m in (17, 1, 9, 16, 24, 32, 33, 48, 49, 64)]
        harness.close()
        for m, first in zip((1, 9, 16, 24, 32, 33, 48, 49, 64), firsts[1:]):
            assert np.array_equal(first, firsts[0]), (n, m)


@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336), (1008, 4224)],
                         ids=["gate/up", "down: split over a cluster", "a partial last CTA"])
@pytest.mark.parametrize("groups,stages", [(2, 4), (4, 6)])
def test_the_wgmma_kernels_tma_weights_give_its_cp_async_bits(harness, n, k, groups, stages) -> None:
    """GP_WG_WTMA moves only how the tiled entry's weights and scales reach shared memory (a TMA
    box of the CTA's tiles on the stage's mbarrier, landing without the block swizzle; tiles
    past N read zeros), so at 1..64 rows its result is the cp.async build's bit for bit."""
    from gpu_worker.kernels import reference as ref
    from gpu_worker.kernels.int4_batched import rows_tiled, wgmma_build

    rng = np.random.default_rng(31)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32) / 16)
    xd = harness.put(rng.standard_normal((64, k)).astype(np.float16))
    tpk, tsc = (harness.put(a) for a in rows_tiled(packed, scales))
    plain = wgmma_build(stages, groups, tiled=True)
    wtma = wgmma_build(stages, groups, wtma=True, tiled=True)
    for m in (1, 17, 64):
        want = _rows_result(harness, plain, tpk, tsc, xd, m, n, k)
        got = _rows_result(harness, wtma, tpk, tsc, xd, m, n, k)
        assert np.array_equal(got, want), (m, np.abs(got - want).max())
    harness.close()


@pytest.mark.parametrize("n,k", [(28672, 4096), (4096, 14336), (1008, 4224)],
                         ids=["gate/up", "down: split over a cluster", "a partial last CTA"])
@pytest.mark.parametrize("tiled", [False, True], ids=["reference layout", "16-row tiles"])
def test_the_32_row_wgmma_build_keeps_the_contract_and_a_rows_bits_at_any_batch(harness, n, k,
                                                                                tiled) -> None:
    """wgmma_build(x_rows=32): m64n32k16 wgmmas over 32 rows of x (two 4 KiB TMA boxes a stage).
    At 1 / 17 / 32 rows it meets the contract's tolerance, and a row's bits do not depend on
    how many rows share the call."""
    from gpu_worker.kernels.int4_batched import wgmma_build

    kdef = wgmma_build(4, 2, tiled=tiled, x_rows=32)
    firsts = []
    for m in (32, 1, 17):
        outcome = int4_wgmma_case(harness, np.random.default_rng(41), m, n, k, tiled=tiled,
                                  kernel=kdef)
        assert outcome.failure() is None, (m, outcome.failure())
        firsts.append(outcome.got[0])
    harness.close()
    assert all(np.array_equal(f, firsts[0]) for f in firsts[1:])



def test_a_chain_of_wgmma_linears_with_dependent_launch_gives_the_serialized_chains_bits(
        harness) -> None:
    """The decode step's pattern at 64 rows: an rmsnorm writes x (fp16), the wgmma linear reads
    it and accumulates into the residual the next rmsnorm reads, eight times over. With
    dependent launch a wgmma launch may start while its norm still runs (its first weights are
    issued before gp_pdl_wait, x after), and the next norm while it runs: the residual must be
    the serialized chain's bit for bit, eager and replayed from a captured graph."""
    from gpu_worker.kernels import reference as ref
    from gpu_worker.kernels.int4_batched import INT4_WGMMA_TILED, mma_kernel, rows_tiled
    from gpu_worker.kernels.norm import RMSNORM_F16, launch_rmsnorm_f16

    dev = harness.device
    m, n = 64, 4096   # wo's shape: square, so the chain closes; K split over a cluster of 6
    assert mma_kernel(m, dev.info.arch) == "wgmma"
    rng = np.random.default_rng(37)
    packed, scales = ref.int4_quantize(rng.standard_normal((n, n)).astype(np.float32) / 16)
    tpk, tsc = (harness.put(a) for a in rows_tiled(packed, scales))
    h0 = rng.standard_normal((m, n)).astype(np.float32)
    hd, xd = harness.put(h0), harness.put(np.zeros((m, n), np.float16))
    wd = harness.put(rng.uniform(0.5, 1.5, n).astype(np.float32))
    norm, linear = harness.function(RMSNORM_F16), harness.function(INT4_WGMMA_TILED)

    def chain(stream=None) -> None:
        for _ in range(8):
            launch_rmsnorm_f16(dev, norm, xd, hd, wd, m, n, 1e-5, stream=stream)
            INT4_WGMMA_TILED.launcher(dev, linear, hd, xd, tpk, tsc, 0, m, n, n, accumulate=True,
                                      stream=stream)

    def run(launch) -> np.ndarray:
        dev.synchronize()
        dev.to_device(hd, h0)
        launch()
        return harness.get(hd, (m, n))

    on = dev.dependent_launch
    try:
        dev.dependent_launch = False
        want = run(chain)
        dev.dependent_launch = True
        eager = [run(chain) for _ in range(3)]
        with dev.capture() as cap:
            chain(cap.stream)
        try:
            replayed = [run(lambda: dev.replay(cap.graph_exec)) for _ in range(3)]
        finally:
            dev.synchronize()
            dev.destroy_graph_exec(cap.graph_exec)
    finally:
        dev.dependent_launch = on
    harness.close()
    assert np.isfinite(want).all() and not np.array_equal(want, h0), "the chain did nothing"
    for i, got in enumerate(eager + replayed):
        assert np.array_equal(got, want), (i, np.abs(got - want).max())
