"""The batched-decode kernels (paged KV append / decode / prefill, rotary per row, sampling)
without a GPU: real NVRTC for sm_90 (no spills, the flash kernels' register budgets), the sim
backend against the NumPy references over the shared cases, the launchers' refusals, and the
sampler's distribution and reproducibility."""
from __future__ import annotations

import re

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.compile.nvrtc import compile_program
from gpu_worker.device import open_device
from gpu_worker.kernels import paged_attention as pa
from gpu_worker.kernels import reference, sampling
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.kernels.selfcheck.paged import PAGED_CASES, paged_decode_case, paged_prefill_case
from services.common.errors import InvalidArgument


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


def _log(source) -> str:
    c = compile_program(source.module_name, source.source, source.headers, "sm_90",
                        source.options + ("--ptxas-options=-v",))
    return c.log if isinstance(c.log, str) else c.log.decode()


@pytest.fixture(scope="module")
def paged_log() -> str:
    return _log(pa.SOURCE)


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c.id for c in PAGED_CASES])
def test_sim_paged_kernel_matches_its_numpy_reference(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id}: sim result differs from the reference: {failure}"


def test_paged_entries_compile_without_spills_within_the_flash_register_budgets(paged_log) -> None:
    """Prefill <= 168 registers (3 blocks of 4 warps per SM), decode <= 128 (4 blocks): the
    paged addresser must not cost the flash kernels their occupancy; the combine (its split
    states staged in shared memory, not registers) <= 32, 16 blocks of 4 warps per SM at
    batch 64."""
    for entry, budget in (("gp_flash_prefill_paged", 168), ("gp_flash_decode_split_paged", 128),
                          ("gp_kv_append_paged", 255), ("gp_flash_combine_paged", 32)):
        section = paged_log.split(f"Compiling entry function '{entry}'")[1].split("Compile time")[0]
        assert "0 bytes spill stores, 0 bytes spill loads" in section, f"{entry} spills:\n{section}"
        used = int(re.search(r"Used (\d+) registers", section).group(1))
        assert used <= budget, f"{entry} uses {used} registers > {budget}"


@pytest.mark.parametrize("defines", [{"GP_FD_MMA": 0}, {"GP_FD_EARLY": 0}, {"GP_FD_PLO": 0},
                                     {"GP_FD_TILE_ROWS": 1}],
                         ids=["lane-group block", "first tile after the wait", "P in one fp16 term",
                              "one table lookup a tile"])
def test_every_decode_split_build_compiles_without_spills_at_four_blocks_per_sm(defines) -> None:
    """The builds decode_attention_bench times beside the library's keep its occupancy, so a
    timing difference is the block's, not a spill's; the library's build has the tensor-core
    block and the dependent-launch early loads (their PTX instructions present)."""
    build = pa.decode_split_build(**defines)
    assert build.source.module_name != pa.SOURCE.module_name
    for source in (build.source, pa.SOURCE):
        log = _log(source)
        section = log.split("Compiling entry function 'gp_flash_decode_split_paged'")[1]
        section = section.split("Compile time")[0]
        assert "0 bytes spill stores, 0 bytes spill loads" in section, section
        assert int(re.search(r"Used (\d+) registers", section).group(1)) <= 128
    ptx = compile_program(pa.SOURCE.module_name, pa.SOURCE.source, pa.SOURCE.headers, "sm_90",
                          pa.SOURCE.options).ptx
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    split = ptx.split(".entry gp_flash_decode_split_paged")[1].split(".entry")[0]
    assert "mma.sync.aligned.m16n8k16" in split and "griddepcontrol.wait" in split


# the cluster kernel's build before the TMA ring: 16 warps, each loading its tiles (16-byte loads)
LOADS = {"GP_FDC_WARPS": 16, "GP_FDC_RING": 0, "GP_FDC_TMA": 0}


def test_decode_builds_take_gp_fd_and_gp_fdc_macros_only() -> None:
    assert pa.decode_split_build() is pa.FLASH_DECODE_SPLIT_PAGED
    assert pa.decode_cluster_build() == pa.ClusterBuild(pa.FLASH_DECODE_PAGED_CLUSTER, 256, 8, 1, 2, True)
    for build in (pa.decode_split_build, pa.decode_cluster_build):
        with pytest.raises(InvalidArgument, match="GP_FD_"):
            build(NDEBUG=1)
        with pytest.raises(InvalidArgument, match="GP_FD_"):
            build(**{"GP_FD_X;rm": 1})
    with pytest.raises(InvalidArgument, match="GP_FDC_WARPS"):
        pa.decode_cluster_build(GP_FDC_WARPS=33)
    with pytest.raises(InvalidArgument, match="GP_FDC_CTAS"):
        pa.decode_cluster_build(GP_FDC_CTAS=17)


def test_the_p_in_one_term_build_drops_the_second_pv_product_and_its_shuffles() -> None:
    """GP_FD_PLO=0 is what its name says in the code the GPU runs: of the library's PV products
    and shuffles, the lo term's are gone (a build that kept them would time the same work)."""
    def counts(source) -> tuple[int, int]:
        ptx = compile_program(source.module_name, source.source, source.headers, "sm_90",
                              source.options).ptx
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        body = ptx.split(".entry gp_flash_decode_paged_cluster")[1].split(".entry")[0]
        return body.count("mma.sync"), body.count("shfl.sync")
    library = counts(pa.SOURCE)
    one_term = counts(pa.decode_cluster_build(GP_FD_PLO=0).kernel.source)
    assert one_term[0] < library[0] and one_term[1] < library[1], (library, one_term)


def test_a_cluster_build_launches_the_threads_and_ctas_its_macros_name() -> None:
    build = pa.decode_cluster_build(GP_FDC_WARPS=8, GP_FDC_CTAS=16)
    assert (build.threads, build.ctas) == (256, 16)
    other = pa.decode_cluster_build(GP_FDC_WARPS=8).kernel.source.module_name
    assert build.kernel.source.module_name not in (pa.SOURCE.module_name, other)
    options = build.kernel.source.options
    assert {"-DGP_FDC_WARPS=8", "-DGP_FDC_CTAS=16"} <= set(options)


def test_the_keys_a_part_are_a_launch_argument_not_a_build() -> None:
    """GP_FDC_PART_KEYS, like GP_FDC_PARTS, changes the launch only: the library's module,
    its part_keys on the build; a negative count is refused before anything compiles."""
    build = pa.decode_cluster_build(GP_FDC_PARTS=2, GP_FDC_PART_KEYS=4096)
    assert build.kernel is pa.FLASH_DECODE_PAGED_CLUSTER and (build.parts, build.part_keys) == (2, 4096)
    assert pa.decode_cluster_build().part_keys == pa.CLUSTER_PART_KEYS == 0, "every part runs"
    with pytest.raises(InvalidArgument, match="GP_FDC_PART_KEYS"):
        pa.decode_cluster_build(GP_FDC_PART_KEYS=-16)


def test_a_short_row_in_fewer_parts_moves_no_counter(harness) -> None:
    """With part_keys 256 a 40-key row runs in one part of the launch's two: it merges in its
    cluster alone, so even a counter that is not zero is left as it was and every output is
    written; a 400-key row runs in both and meets through the counters as before."""
    h, dev = harness, harness.device
    heads, kv_heads, hd, parts = 4, 1, 128, 2
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((32, 2, 2, 16, kv_heads, hd), dtype=np.float32).astype(np.float16)
    q = h.put(rng.standard_normal(heads * hd, dtype=np.float32).astype(np.float16))
    pool_d, table = h.put(pool), h.put(np.arange(32, dtype=np.int32)[None])
    for position, moved in ((39, 0), (399, parts)):
        out = h.put(np.full(heads * hd, np.nan, np.float16))
        ws_host = np.zeros(pa.cluster_decode_workspace_bytes(batch=1, heads=heads, kv_heads=kv_heads,
                                                             parts=parts) // 4, np.uint32)
        ws_host[3] = 5   # rank 3's counter
        ws = h.put(ws_host)
        pa.launch_flash_decode_paged_cluster(
            dev, h.function(pa.FLASH_DECODE_PAGED_CLUSTER), out, q, pool_d,
            h.put(np.array([position], np.int32)), table, 1, heads, kv_heads, hd, 1, 2, 16, 32,
            parts=parts, workspace=ws, pool_blocks=32, part_keys=256)
        got = h.get(out, (heads * hd,), np.float16)
        left = h.get(ws, (pa.CLUSTER_COUNTERS,), np.uint32)
        assert left[3] == 5 + moved and not left[:3].any() and not left[4:].any(), (position, left)
        assert np.isnan(got).any() == bool(moved), position


def test_sampler_compiles_without_spills() -> None:
    log = _log(sampling.SOURCE)
    section = log.split("Compiling entry function 'gp_sample'")[1].split("Compile time")[0]
    assert "0 bytes spill stores, 0 bytes spill loads" in section, section


def test_an_off_by_one_in_the_decode_length_fails_the_tolerance(harness, monkeypatch) -> None:
    """Negative control: the reference shifted by one position is caught by the comparison."""
    real = pa.flash_decode_paged

    def shifted(q, pool, positions, table, layer, heads):
        return real(q, pool, np.where(positions >= 0, positions - 1, positions), table, layer, heads)

    monkeypatch.setattr("gpu_worker.kernels.selfcheck.paged.flash_decode_paged", shifted)
    out = paged_decode_case(harness, np.random.default_rng(3), 4, 2, 64, [40, 9])
    assert out.failure() is not None, "a one-position shift must not pass the tolerance"


def test_prefill_padding_rows_are_zero_not_attended(harness, monkeypatch) -> None:
    """Negative control: a reference that computes rows past chunk_len too is caught."""
    real = pa.flash_prefill_paged
    monkeypatch.setattr("gpu_worker.kernels.selfcheck.paged.flash_prefill_paged",
                        lambda q, pool, start, n, table, layer, heads:
                        real(q, pool, start, n, table, layer, heads) + np.float16(0.5))
    out = paged_prefill_case(harness, np.random.default_rng(4), 20, 2, 1, 16, 3, 10)
    assert out.failure() is not None


@pytest.mark.parametrize("kwargs, match", [
    ({"head_dim": 32}, "head_dim"),
    ({"block_tokens": 24}, "block_tokens"),
    ({"layer": 2}, "layer"),
    ({"heads": 6, "kv_heads": 4}, "multiple"),
    ({"span": 24}, "span"),
    ({"span": 16, "max_blocks": 129}, "splits"),
])
def test_paged_decode_launcher_refuses_bad_shapes_before_the_device(harness, kwargs, match) -> None:
    args = {"batch": 1, "heads": 4, "kv_heads": 2, "head_dim": 64, "layer": 0, "layers": 2,
            "block_tokens": 16, "max_blocks": 4, "span": 16, **kwargs}
    with pytest.raises(InvalidArgument, match=match):
        pa.launch_flash_decode_split_paged(harness.device, None, 256, 256, 256, 256, 256, **args)


def test_a_split_is_a_fixed_span_of_keys_so_every_batch_splits_by_its_rows_lengths() -> None:
    """The regression: the split count came from the maximum context and the batch (at
    batch 8 and an 8192-token table, 9 splits of 911 keys: a 1000-key row got 2). Now a row of n
    keys has ceil(n / span) splits, the span a function of the graph's shape (batch, heads, the
    table), never of the current lengths."""
    llama = {"heads": 32, "kv_heads": 8}
    spans = {b: pa.paged_decode_span(512, 16, b, **llama) for b in (1, 8, 32, 64)}
    assert spans == {1: 128, 8: 256, 32: 512, 64: 1024}, spans
    assert -(-1000 // spans[8]) == 4, "a 1000-key row at batch 8: 4 splits, not 2"
    assert pa.paged_decode_splits(512, 16, spans[1]) == 64   # the workspace covers the longest row
    assert pa.paged_decode_span(2048, 16, 1, **llama) == 256  # 32768 tokens: <= 128 splits
    assert pa.paged_decode_span(4096, 16, 1, **llama) == 512
    assert all(pa.paged_decode_splits(mb, 16, pa.paged_decode_span(mb, 16, b, **llama))
               <= pa.MAX_DECODE_SPLITS for mb in (1, 100, 512, 8192) for b in (1, 8, 64, 300))


def test_a_split_kernel_that_writes_slots_past_a_rows_length_is_caught(monkeypatch, tmp_path) -> None:
    """Negative control: a split kernel that also writes the (empty) state of the splits past a
    row's length leaves no NaN there, and the case reports it."""
    from gpu_worker.device import sim_kernels

    real = sim_kernels.lookup_sim_kernel("gp_flash_decode_split_paged")

    def writes_every_slot(mem, grid, block, args) -> None:
        vals = [a.value for a in args]
        ws, batch, heads, head_dim = vals[0], vals[5], vals[6], vals[8]
        empty = reference.attention_partial_f16(np.zeros((heads, head_dim), np.float16),
                                                np.zeros((0, 1, head_dim), np.float16),
                                                np.zeros((0, 1, head_dim), np.float16))
        part = mem.view(ws, 4 * batch * heads * grid[2] * (head_dim + 2)).view(np.float32)
        part.reshape(batch, heads, grid[2], head_dim + 2)[:] = empty[None, :, None]
        real(mem, grid, block, args)

    monkeypatch.setitem(sim_kernels._REGISTRY, "gp_flash_decode_split_paged", writes_every_slot)
    device = open_device("sim")   # a fresh harness: functions bind their sim kernel when looked up
    h = KernelHarness(device, KernelCompiler(device.info.arch, cache_dir=tmp_path))
    try:
        rng = np.random.default_rng(5)
        assert paged_decode_case(h, rng, 4, 2, 16, [40, 3], span=16).failure() is not None, \
            "a write past a row's length must not pass"
    finally:
        h.close()
        device.close()


def test_kv_append_launcher_refuses_a_table_of_the_wrong_row_count(harness) -> None:
    with pytest.raises(InvalidArgument, match="table_rows"):
        pa.launch_kv_append_paged(harness.device, None, 256, 256, 256, 256, 256, 4, 2, 0, 1, 16,
                                  2, 16, 4)


def test_sampling_hash_is_a_function_of_seed_position_and_token_only() -> None:
    u = reference.uniform(7, 12, np.arange(1000))
    assert np.all((u > 0) & (u < 1))
    assert np.array_equal(u[500:], reference.uniform(7, 12, np.arange(500, 1000)))
    assert not np.array_equal(u, reference.uniform(8, 12, np.arange(1000)))
    assert not np.array_equal(u, reference.uniform(7, 13, np.arange(1000)))


def test_seeded_sampling_draws_from_the_softmax_of_the_kept_tokens() -> None:
    """Over 4000 seeds the Gumbel-max choice follows softmax(z / T); top-k and top-p never pick
    outside their sets (frequencies within 4 sigma of the probabilities)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0], np.float32)
    n = 4000

    def freq(**kw):
        picks = [reference.sample_row(logits, 3, kw.get("t", 1.0), kw.get("p", 1.0),
                                     kw.get("k", 0), s) for s in range(n)]
        return np.bincount(picks, minlength=logits.size) / n

    p = np.exp(logits / 0.7) / np.exp(logits / 0.7).sum()
    f = freq(t=0.7)
    assert np.all(np.abs(f - p) <= 4 * np.sqrt(p * (1 - p) / n) + 1e-9), (f, p)
    assert np.all(freq(k=2)[2:] == 0), "top_k = 2 keeps two tokens"
    pt = np.exp(logits) / np.exp(logits).sum()      # 0.56, 0.21, 0.12, ...: top_p 0.75 keeps 2
    assert pt[0] < 0.75 <= pt[0] + pt[1]
    fp = freq(p=0.75)
    assert np.all(fp[2:] == 0) and fp[1] > 0.2, fp


def test_sampling_a_row_does_not_depend_on_the_rest_of_the_batch() -> None:
    rng = np.random.default_rng(5)
    logits = rng.standard_normal((6, 500), dtype=np.float32) * 2
    args = [np.arange(6, dtype=np.int32), np.full(6, 0.9, np.float32), np.full(6, 0.95, np.float32),
            np.full(6, 50, np.int32), np.arange(6, dtype=np.int32) + 100]
    whole = reference.sample(logits, *args)
    for r in range(6):
        alone = reference.sample(logits[r:r + 1], *(a[r:r + 1] for a in args))
        assert alone[0] == whole[r]


def test_the_one_kernel_decode_takes_a_batch_whose_ctas_fill_at_most_half_the_sms() -> None:
    """cluster_decode: Llama-3-8B's batch 1 (64 CTAs of 256 threads) on a 132-SM part runs the
    cluster decode; batch 2 (128 CTAs, measured slower), head_dim 16 (no tensor-core block) and
    a part with fewer than 128 SMs do not. A shape rule: the batch and the device only."""
    assert pa.cluster_decode(1, 32, 8, 128, 132) and pa.cluster_decode(1, 32, 8, 64, 132)
    assert not pa.cluster_decode(2, 32, 8, 128, 132), "batch 2: 128 CTAs, slower than split"
    assert not pa.cluster_decode(1, 32, 8, 16, 132), "head_dim 16: the lane-group block only"
    assert not pa.cluster_decode(1, 32, 8, 128, 127), "64 CTAs on fewer than 128 SMs"
    assert pa.cluster_decode(1, 12, 2, 64, 132), "GQA of 6: two head blocks a KV head, 32 CTAs"


def test_the_one_kernel_decode_keeps_its_ring_and_registers_in_one_sm(paged_log) -> None:
    """The library's cluster kernel (8 warps, a TMA ring of 2 tiles a warp) fits one block an SM:
    no spill, its registers within 256 threads' share, its ring and static shared memory within
    a block's 227 KiB."""
    section = paged_log.split("Compiling entry function 'gp_flash_decode_paged_cluster'")[1] \
        .split("Compile time")[0]
    used = int(re.search(r"Used (\d+) registers", section).group(1))
    static = int(re.search(r"(\d+) bytes smem", section).group(1))
    assert "0 bytes spill stores" in section and used <= 255, section
    ring = pa.cluster_decode_ring_bytes(pa.CLUSTER_DECODE_THREADS // 32, pa.CLUSTER_DECODE_RING, 128,
                                        pa.CLUSTER_DECODE_TMA)
    assert static + ring <= 227 << 10, (static, ring)


@pytest.mark.parametrize("defines", [{"GP_FDC_PAIR": 1},
                                     {"GP_FDC_PAIR": 1, "GP_FDC_WARPS": 4, "GP_FDC_RING": 4}])
def test_a_tile_pair_build_keeps_its_second_tile_in_registers_without_a_spill(defines) -> None:
    """GP_FDC_PAIR (two tiles a softmax step) holds a second tile's K and V fragments: more
    registers than the library's build, still no spill and within 256 threads' share; an odd ring
    or none is refused (a pair is two slots of one ring round)."""
    log = _log(pa.decode_cluster_build(**defines).kernel.source)
    section = log.split("Compiling entry function 'gp_flash_decode_paged_cluster'")[1] \
        .split("Compile time")[0]
    used = int(re.search(r"Used (\d+) registers", section).group(1))
    assert "0 bytes spill stores" in section and used <= 255, section
    for ring in (0, 1, 3):
        with pytest.raises(InvalidArgument, match="GP_FDC_PAIR"):
            pa.decode_cluster_build(GP_FDC_PAIR=1, GP_FDC_WARPS=4, GP_FDC_RING=ring,
                                    GP_FDC_TMA=int(ring > 0))


@pytest.mark.parametrize("warps,ring", [(6, 3), (10, 2)])
def test_a_deeper_ring_build_fits_one_sm_without_a_spill(warps, ring) -> None:
    """More of a CTA's tiles in flight than the library's 8 warps x 2 (6 warps x 3 slots, 10 x
    2): no spill, the warps' registers within an SM's 64 K, the ring and the static shared memory
    within a block's 227 KiB; 12 warps x 2 slots is refused (the ring would not fit)."""
    log = _log(pa.decode_cluster_build(GP_FDC_WARPS=warps, GP_FDC_RING=ring).kernel.source)
    section = log.split("Compiling entry function 'gp_flash_decode_paged_cluster'")[1] \
        .split("Compile time")[0]
    used = int(re.search(r"Used (\d+) registers", section).group(1))
    static = int(re.search(r"(\d+) bytes smem", section).group(1))
    assert "0 bytes spill stores" in section and used * 32 * warps <= 64 << 10, section
    assert static + pa.cluster_decode_ring_bytes(warps, ring, 128, True) <= 227 << 10
    with pytest.raises(InvalidArgument, match="shared memory"):
        pa.decode_cluster_build(GP_FDC_WARPS=12, GP_FDC_RING=2)


def test_the_cluster_decode_looks_a_tiles_rows_up_once() -> None:
    """The loads build of the cluster kernel (GP_FDC_TILE_ROWS=1) reads the block table once a
    16-key tile, not once a row: fewer 4-byte global loads in the code the GPU runs than the build
    that looks every row up, the same 16-byte K/V loads."""
    def loads(source) -> tuple[int, int]:
        ptx = compile_program(source.module_name, source.source, source.headers, "sm_90",
                              source.options).ptx
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        body = ptx.split(".entry gp_flash_decode_paged_cluster")[1].split(".entry")[0]
        return (len(re.findall(r"^\s*ld\.global\.nc\.u32", body, re.MULTILINE)),
                len(re.findall(r"^\s*ld\.global\.nc\.v4\.u32", body, re.MULTILINE)))
    library = loads(pa.decode_cluster_build(**LOADS).kernel.source)
    per_row = loads(pa.decode_cluster_build(**LOADS, GP_FDC_TILE_ROWS=0).kernel.source)
    with pytest.raises(InvalidArgument, match="GP_FDC_TILE_ROWS=0 needs GP_FDC_RING=0"):
        pa.decode_cluster_build(GP_FDC_TILE_ROWS=0)
    assert library[0] < per_row[0] and library[1] == per_row[1], (library, per_row)


def _cluster_ptx(source) -> str:
    ptx = compile_program(source.module_name, source.source, source.headers, "sm_90", source.options).ptx
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    return ptx.split(".entry gp_flash_decode_paged_cluster")[1].split(".entry")[0]


def test_the_cluster_decodes_ring_reads_k_and_v_by_bulk_copies_only() -> None:
    """GP_FDC_RING: every K/V row reaches shared memory by a 1-D bulk copy on a slot's mbarrier
    (one a lane a tile, plus the newest key's after the wait), read back as 16-byte shared loads;
    the only 16-byte global loads left are Q's (4 at head_dim 128, 2 at 64), against the loads
    build's 78. The slot is fenced before it is refilled."""
    ring = _cluster_ptx(pa.decode_cluster_build(GP_FDC_WARPS=16, GP_FDC_RING=1, GP_FDC_TMA=0).kernel.source)
    loads = _cluster_ptx(pa.decode_cluster_build(**LOADS).kernel.source)
    count = lambda pattern, body: len(re.findall(pattern, body, re.MULTILINE))
    assert count(r"^\s*cp\.async\.bulk\.shared::cluster\.global\.mbarrier", ring) >= 4
    assert count(r"^\s*ld\.global\.nc\.v4\.u32", ring) == 6
    assert count(r"^\s*ld\.global\.nc\.v4\.u32", loads) == 78
    assert count(r"^\s*fence\.proxy\.async\.shared::cta", ring) >= 2
    assert count(r"^\s*cp\.async\.bulk", loads) == 0


def test_a_ring_build_is_launched_with_its_slots_and_refused_past_shared_memory() -> None:
    """The launch gives a ring build its slots as dynamic shared memory (the kernel traps on
    less); a ring whose slots pass what a block may hold beside the kernel's own is refused at
    build time, with the way out."""
    build = pa.decode_cluster_build(GP_FDC_WARPS=8, GP_FDC_RING=2)
    assert (build.threads, build.ring) == (256, 2)
    assert pa.cluster_decode_ring_bytes(16, 1, 128) == 16 * (16 * (320 + 288) + 8)
    assert pa.cluster_decode_ring_bytes(16, 1, 64) < pa.cluster_decode_ring_bytes(16, 1, 128)
    with pytest.raises(InvalidArgument, match="fewer warps or a shorter ring"):
        pa.decode_cluster_build(GP_FDC_WARPS=16, GP_FDC_RING=2)
    with pytest.raises(InvalidArgument, match="GP_FDC_RING=5"):
        pa.decode_cluster_build(GP_FDC_WARPS=2, GP_FDC_RING=5)
    with pytest.raises(InvalidArgument, match="GP_FDC_TMA=1 must be 0 or 1, and 1 needs GP_FDC_RING"):
        pa.decode_cluster_build(GP_FDC_RING=0, GP_FDC_TMA=1)
    tma = pa.decode_cluster_build(GP_FDC_WARPS=16, GP_FDC_RING=1, GP_FDC_TMA=1)
    assert tma.tma and pa.cluster_decode_ring_bytes(16, 1, 128, True) == 16 * (8192 + 8) + 1024


def test_the_tma_ring_reads_the_pool_by_5d_boxes_of_a_tensor_map_it_is_given() -> None:
    """GP_FDC_TMA: the tile's K and V as 5-D tensor boxes (two of each at head_dim 128) from a
    __grid_constant__ map, no per-row bulk copy and Q's 16-byte loads only; the map the launch
    makes describes the pool's layout, and a launch without the pool's size is refused."""
    body = _cluster_ptx(pa.decode_cluster_build(GP_FDC_RING=1, GP_FDC_TMA=1).kernel.source)
    assert len(re.findall(r"^\s*cp\.async\.bulk\.tensor\.5d", body, re.MULTILINE)) >= 4
    assert not re.findall(r"^\s*cp\.async\.bulk\.shared::cluster\.global\.mbarrier", body, re.MULTILINE)
    assert len(re.findall(r"^\s*ld\.global\.nc\.v4\.u32", body, re.MULTILINE)) == 6
    from gpu_worker.device.sim_kernels import SimTensorMap, sim_tensor_map
    device = open_device("sim")
    m = pa.pool_tensor_map(device, 4096, blocks=100, layers=32, block_tokens=16, kv_heads=8, head_dim=128)
    assert sim_tensor_map(m) == SimTensorMap(4096, (128, 8, 16, 64, 100), (256, 2048, 32768, 64 * 32768),
                                             (64, 1, 16, 1, 1), 2, 128)
    with pytest.raises(InvalidArgument, match="pool_blocks=0"):
        pa.launch_flash_decode_paged_cluster(device, None, 16, 16, 16, 16, 16, 1, 32, 8, 128, 0, 1, 16,
                                             4, ring=1, tma=True)
    device.close()


def test_the_cluster_decode_takes_the_most_ctas_one_wave_holds() -> None:
    """cluster_decode_shape: (CTAs a cluster, parts) with the most CTAs whose clusters all fit
    one wave, the bigger cluster on a tie, never below one part of the full cluster."""
    def gpcs(s: int) -> int:   # 132 SMs in GPCs of 18 x 6, 16 and 8: 15 clusters of 8, as on the H100
        return sum(n // s for n in (18, 18, 18, 18, 18, 18, 16, 8))
    assert gpcs(8) == 15
    assert pa.cluster_decode_shape(8, gpcs) == (6, 2), "batch 1: 2 parts of 6 (96 CTAs), not 1 of 8"
    assert pa.cluster_decode_shape(8, lambda s: 132 // s) == (8, 2), "the sim's model: 16 of 8 fit"
    assert pa.cluster_decode_shape(16, gpcs) == (2, 4), "16 units: 16 clusters of 8 are 2 waves"
    assert pa.cluster_decode_shape(8, gpcs, parts=1) == (8, 1), "GP_FDC_PARTS:1, the one-part decode"
    assert pa.cluster_decode_shape(1, gpcs) == (8, 4), "one unit: at most MAX_DECODE_PARTS parts"
    assert pa.cluster_decode_shape(8, gpcs, ctas=16) == (6, 2), "a non-portable build still splits"
    assert pa.cluster_decode_shape(8, lambda s: 7, ctas=16) == (16, 1), "none fits: the build's cluster"


def test_the_cluster_decode_refuses_parts_without_a_workspace() -> None:
    """More than one part needs the counters: a launch without a workspace is refused before
    anything runs, and parts past MAX_DECODE_PARTS (the merge's unrolled slots) too."""
    class NoLaunch:
        def launch(self, *a, **k):
            raise AssertionError("launched")
    args = (NoLaunch(), None, 16, 16, 16, 8, 8, 1, 32, 8, 128, 0, 1, 16, 4)
    with pytest.raises(InvalidArgument, match="needs a 4-byte aligned workspace"):
        pa.launch_flash_decode_paged_cluster(*args, parts=2, pool_blocks=100)
    with pytest.raises(InvalidArgument, match="parts=5"):
        pa.launch_flash_decode_paged_cluster(*args, parts=5, workspace=64, pool_blocks=100)


def test_a_part_whose_counter_is_not_zero_at_launch_writes_nothing(harness) -> None:
    """The sim keeps the device's contract: a (row, head block, rank) whose counter is not zero
    at launch has no last part, so its outputs stay unwritten (NaN here) and the counter moves
    on by the parts; which is why the cluster workspace must be zeroed when allocated."""
    h, dev = harness, harness.device
    heads, kv_heads, hd, parts = 4, 1, 128, 2
    rng = np.random.default_rng(3)
    pool = rng.standard_normal((4, 2, 2, 16, kv_heads, hd), dtype=np.float32).astype(np.float16)
    out = h.put(np.full(heads * hd, np.nan, np.float16))
    ws_host = np.zeros(pa.cluster_decode_workspace_bytes(batch=1, heads=heads, kv_heads=kv_heads,
                                                         parts=parts) // 4, np.uint32)
    ws_host[3] = 5   # rank 3's counter
    ws = h.put(ws_host)
    q = rng.standard_normal(heads * hd, dtype=np.float32).astype(np.float16)
    pa.launch_flash_decode_paged_cluster(
        dev, h.function(pa.FLASH_DECODE_PAGED_CLUSTER), out, h.put(q), h.put(pool),
        h.put(np.array([40], np.int32)), h.put(np.array([[0, 1, 2, 3]], np.int32)), 1, heads,
        kv_heads, hd, 1, 2, 16, 4, parts=parts, workspace=ws, pool_blocks=4)
    got = h.get(out, (heads * hd,), np.float16)
    left = h.get(ws, (pa.CLUSTER_COUNTERS,), np.uint32)
    slice3 = slice(heads * hd * 3 // 8, heads * hd * 4 // 8)
    assert np.isnan(got[slice3]).all() and not np.isnan(np.delete(got, np.r_[slice3])).any()
    assert left[3] == 5 + parts and not left[:3].any() and not left[4:].any()


def test_the_cluster_decodes_parts_meet_through_one_counter_and_l2_reads() -> None:
    """The parts' merge in the code the GPU runs: one atomic add a CTA on its counter, the
    other parts' slots read through L2 (ld.global.cg: never a stale L1 line), and the fence
    that orders a slot's stores before the arrival is counted."""
    ptx = compile_program(pa.SOURCE.module_name, pa.SOURCE.source, pa.SOURCE.headers, "sm_90",
                          pa.SOURCE.options).ptx
    ptx = ptx if isinstance(ptx, str) else ptx.decode()
    entry = ptx.split(".entry gp_flash_decode_paged_cluster")[1].split(".entry")[0]
    finish = ptx.split(".func _Z13gp_fdc_finish")[1].split(".func")[0].split(".entry")[0]
    assert "gp_fdc_finish" in entry
    arrivals = len(re.findall(r"atom\.global\.add\.u32", finish))
    assert arrivals == 2, f"one arrival a CTA in each head_dim's merge (64, 128), not {arrivals}"
    assert re.search(r"ld\.global\.cg\.f32", finish) and re.search(r"membar\.gl|fence\.sc\.gpu|fence\.acq_rel\.gpu", finish)
