"""The fp16 attention kernels (flash_attention.py) without a GPU: real NVRTC for sm_90 (tensor-core
mma, ldmatrix, cp.async, no register spills), the sim backend against the NumPy reference over
the shared cases, the launchers' refusals, and the split policy."""
from __future__ import annotations

import re

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.compile.nvrtc import compile_program
from gpu_worker.device import open_device
from gpu_worker.kernels import (
    flash_decode_splits,
    flash_decode_workspace_bytes,
    launch_flash_attention_combine,
    launch_flash_attention_decode_split,
    launch_flash_attention_prefill,
    launch_flash_combine_paged,
)
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.flash_attention import (
    FLASH_MAX_SPLITS,
    SOURCE,
    attention_f16,
    attention_partial_f16,
    decode_combine_shared_bytes,
)
from gpu_worker.kernels.selfcheck import KernelHarness, Outcome
from gpu_worker.kernels.selfcheck.flash import ATOL, FLASH_CASES, RTOL, sample_rows
from services.common.errors import InvalidArgument

ENTRIES = ("gp_flash_prefill_f16", "gp_flash_decode_split_f16", "gp_flash_combine_f16")


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.fixture(scope="module")
def compiled():
    return compile_program(SOURCE.module_name, SOURCE.source, SOURCE.headers, "sm_90",
                           SOURCE.options + ("--ptxas-options=-v",))


@pytest.mark.parametrize("case", FLASH_CASES, ids=[c.id for c in FLASH_CASES])
def test_sim_flash_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: sim result differs from the reference: {failure}"


def test_prefill_runs_on_tensor_cores_with_async_copies(compiled) -> None:
    ptx = compiled.ptx.decode(errors="replace")
    for needle in ("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32", "ldmatrix.sync.aligned",
                   ".trans", "cp.async.cg.shared.global", "ex2.approx"):
        assert needle in ptx, f"{needle} missing from the PTX: the design's instruction is gone"


def test_every_entry_compiles_without_register_spills(compiled) -> None:
    log = compiled.log if isinstance(compiled.log, str) else compiled.log.decode()
    for entry in ENTRIES:
        section = log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        assert "0 bytes spill stores, 0 bytes spill loads" in section, \
            f"{entry} spills registers to local memory:\n{section}"


def test_register_budgets_keep_the_designed_occupancy(compiled) -> None:
    """Prefill: <= 168 registers = 3 blocks of 4 warps per SM; decode: <= 128 = 4 blocks (one
    wave of flash_decode_splits' grid at 8k context)."""
    log = compiled.log if isinstance(compiled.log, str) else compiled.log.decode()
    for entry, budget in (("gp_flash_prefill_f16", 168), ("gp_flash_decode_split_f16", 128)):
        section = log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        used = int(re.search(r"Used (\d+) registers", section).group(1))
        assert used <= budget, f"{entry} uses {used} registers > {budget}: occupancy drops a block"


def test_the_tolerance_fails_an_off_by_one_in_the_causal_mask() -> None:
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s, dtype=np.float32).astype(np.float16)
               for s in ((200, 4, 128), (200, 2, 128), (200, 2, 128)))
    pos = np.arange(200)
    right = attention_f16(q, k, v, pos, True).astype(np.float32)
    off_by_one = attention_f16(q, k, v, pos + 1, True).astype(np.float32)
    assert Outcome(right.copy(), right, RTOL, ATOL).failure() is None
    assert Outcome(off_by_one, right, RTOL, ATOL).failure() is not None, \
        "negative control: a mask one key too wide must fail the fp16 tolerance"


def test_split_states_combine_to_the_whole_attention() -> None:
    rng = np.random.default_rng(4)
    q = rng.standard_normal((8, 64), dtype=np.float32).astype(np.float16)
    k, v = (rng.standard_normal((300, 2, 64), dtype=np.float32).astype(np.float16) for _ in "kv")
    parts = np.stack([attention_partial_f16(q, k[a:b], v[a:b]) for a, b in
                      ((0, 100), (100, 100), (100, 299), (299, 300))])
    whole = attention_f16(q[None], k, v, np.array([299]), False)[0].astype(np.float32)
    np.testing.assert_allclose(ref.attention_combine(parts), whole, rtol=RTOL, atol=ATOL)


def test_sampled_rows_keep_both_mask_edges() -> None:
    rows = sample_rows(5502, 64, np.random.default_rng(0))
    assert rows.size == 64 and rows[0] == 0 and rows[-1] == 5501 and {7, 5494} <= set(rows)
    assert np.array_equal(sample_rows(30, 64, np.random.default_rng(0)), np.arange(30))


def test_decode_workspace_holds_max_sum_and_acc_per_sequence_head_and_split() -> None:
    for splits in (1, 2, 9, 64):   # reference.attention_partial's (max, sum, acc[head_dim])
        assert flash_decode_workspace_bytes(batch=3, heads=32, head_dim=128, splits=splits) == \
            4 * 3 * 32 * splits * (128 + 2)


def test_contiguous_decode_splits_are_spans_of_128_keys_of_max_len_at_any_batch() -> None:
    """No SM-count constant: the split count is max_len / 128 (at most 64), the batch aside."""
    assert flash_decode_splits(100) == 1, "a cache shorter than one split's keys is not split"
    assert flash_decode_splits(8192, batch=1, heads=32, kv_heads=8) == 64, \
        "8 KV heads x 64 splits = 512 blocks, ~4 per SM"
    assert flash_decode_splits(2048) == 16
    assert flash_decode_splits(8192, batch=64) == flash_decode_splits(8192, batch=1)
    assert all(1 <= flash_decode_splits(n, b) <= FLASH_MAX_SPLITS
               for n in (1, 999, 10**6) for b in (1, 3, 1000))


class _Recorder:
    def __init__(self) -> None:
        self.launched: list = []

    def launch(self, *a, **kw) -> None:
        self.launched.append(a)


PREFILL_OK = {"out": 0x1000, "q": 0x2000, "k": 0x3000, "v": 0x4000, "lens": 0, "past": 0,
              "batch": 1, "tokens": 8, "heads": 4, "kv_heads": 2, "head_dim": 128,
              "q_row_stride": 512, "kv_row_stride": 256, "kv_batch_stride": 256 * 8}


@pytest.mark.parametrize("bad, match", [
    ({"head_dim": 96}, "head_dim"),
    ({"head_dim": 256}, "head_dim"),
    ({"heads": 6, "kv_heads": 4}, "multiple of kv_heads"),
    ({"k": 0x3008}, "16-byte aligned"),
    ({"q_row_stride": 516}, "multiple of 8"),
    ({"kv_batch_stride": 2052}, "multiple of 8"),
    ({"tokens": -1}, "tokens"),
])
def test_prefill_launcher_refuses_bad_inputs_before_the_device(bad, match) -> None:
    rec = _Recorder()
    with pytest.raises(InvalidArgument, match=match):
        launch_flash_attention_prefill(rec, None, **{**PREFILL_OK, **bad})
    assert not rec.launched, "a refused launch reached the device"


DECODE_OK = {"workspace": 0x1000, "q": 0x2000, "k_cache": 0x3000, "v_cache": 0x4000,
             "lens": 0x5000, "batch": 1, "heads": 32, "kv_heads": 8, "head_dim": 128,
             "q_row_stride": 4096, "kv_row_stride": 1024, "kv_batch_stride": 1024 * 64,
             "len_add": 1, "max_len": 64, "splits": 4}


@pytest.mark.parametrize("bad, match", [
    ({"splits": 0}, "splits"),
    ({"splits": FLASH_MAX_SPLITS + 1}, "splits"),
    ({"lens": 0}, "lens"),
    ({"workspace": 0}, "workspace"),
    ({"head_dim": 80}, "head_dim"),
    ({"v_cache": 0x4004}, "16-byte aligned"),
    ({"kv_row_stride": 1028}, "multiple of 8"),
])
def test_decode_launcher_refuses_bad_inputs_before_the_device(bad, match) -> None:
    rec = _Recorder()
    with pytest.raises(InvalidArgument, match=match):
        launch_flash_attention_decode_split(rec, None, **{**DECODE_OK, **bad})
    with pytest.raises(InvalidArgument, match="splits"):
        launch_flash_attention_combine(rec, None, 0x1000, 0x2000, 1, 32, 128, 0)
    assert not rec.launched, "a refused launch reached the device"


def test_combines_refuse_a_workspace_not_8_byte_aligned_and_size_their_shared_states() -> None:
    """gp_fd_combine stages the states by 8-byte copies: a 4-byte aligned workspace is refused
    with the reason, and an accepted launch asks for every slot's state and the weights."""
    class Recorder:
        def __init__(self) -> None:
            self.launched: list[dict] = []

        def launch(self, *a, **kw) -> None:
            self.launched.append(kw)

    rec = Recorder()
    with pytest.raises(InvalidArgument, match="8-byte aligned"):
        launch_flash_attention_combine(rec, None, 0x1000, 0x2004, 1, 32, 128, 4)
    with pytest.raises(InvalidArgument, match="8-byte aligned"):
        launch_flash_combine_paged(rec, None, 0x1000, 0x2004, 0x3000, 1, 32, 128, 16, 512,
                                   span=128)
    assert not rec.launched, "a refused launch reached the device"
    launch_flash_combine_paged(rec, None, 0x1000, 0x2008, 0x3000, 1, 32, 128, 16, 512, span=128)
    assert rec.launched[-1]["shared_bytes"] == decode_combine_shared_bytes(64, 128) == \
        4 * (64 * 130 + 128)


def test_empty_launches_are_no_ops_not_zero_sized_grids() -> None:
    rec = _Recorder()
    launch_flash_attention_prefill(rec, None, **{**PREFILL_OK, "tokens": 0})
    launch_flash_attention_decode_split(rec, None, **{**DECODE_OK, "batch": 0})
    launch_flash_attention_combine(rec, None, 0x1000, 0x2000, 0, 32, 128, 4)
    assert not rec.launched, "a launch over nothing must not reach the driver (grid 0 is invalid)"
