"""The batched-decode kernels on a real device: the shared cases (gpu_worker.kernels.selfcheck.paged)
plus production shapes (8b: 32 heads, 8 KV heads, head_dim 128; contexts to 8192; batch 1..64;
prefill chunks of 2048; vocab 128256), and the sampler's batch independence on the device.

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_paged_kernels.py -v
    compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_paged_kernels.py -q \
        -k "not model_shapes"
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels.sampling import SAMPLE, launch_sample
from gpu_worker.kernels.selfcheck import Case, KernelHarness
from gpu_worker.kernels.selfcheck.paged import (
    APPEND,
    CLUSTER,
    COMBINE,
    DECODE,
    PAGED_CASES,
    PREFILL,
    kv_append_paged_case,
    paged_decode_case,
    paged_decode_cluster_case,
    paged_prefill_case,
    sample_case,
)

pytestmark = pytest.mark.gpu

LLAMA = {"heads": 32, "kv_heads": 8, "head_dim": 128, "layers": 1, "layer": 0}
_rng = np.random.default_rng(2026)
_B32 = [int(x) for x in _rng.integers(0, 8192, 32)]
_B32[5] = _B32[17] = -1
_B64 = [int(x) for x in _rng.integers(0, 2048, 64)]
_B64[63] = -1
# split by the actual length: batch 8 and 64 in an 8192-token table, lengths 1..8192
# (positions 0..8191) at span edges and odd values, and batch 64 of short rows (most of the
# grid's splits past their rows: those blocks must write nothing)
_B8 = [0, 254, 255, 256, 1000, 4097, 8191, -1]
_B64L = [int(x) | 1 for x in _rng.integers(0, 8191, 64)]
_B64L[:6] = [0, 1, 255, 511, 8191, -1]
_B64S = [int(x) for x in _rng.integers(0, 300, 64)]
_T8K = {"block_tokens": 16, "max_blocks": 512}
_SAMPLE64 = [(int(_rng.integers(0, 8000)), float(t), float(p), int(k), int(s))
             for t, p, k, s in zip(_rng.choice([0.0, 0.6, 1.0], 64), _rng.choice([1.0, 0.9, 0.5], 64),
                                   _rng.choice([0, 1, 50, 1000], 64), _rng.integers(0, 2**31 - 1, 64))]

MODEL_CASES: list[Case] = [
    Case(APPEND, kv_append_paged_case, {"positions": [p % 128 if p >= 0 else p for p in _B64],
                                        "table_rows": 64, "kv_heads": 8,
                                        "head_dim": 128, "block_tokens": 16, "max_blocks": 8,
                                        "layers": 2, "layer": 1}),
    Case(APPEND, kv_append_paged_case, {"positions": list(range(100, 2148)), "table_rows": 1,
                                        "kv_heads": 8, "head_dim": 128, "block_tokens": 64,
                                        "max_blocks": 40, "layers": 1, "layer": 0}),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": [8191], "block_tokens": 16}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B32, "block_tokens": 64,
                                     "max_blocks": 128, "capacity": 512}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B64, "block_tokens": 16,
                                     "max_blocks": 128, "capacity": 1024}, COMBINE),
    Case(DECODE, paged_decode_case, {"heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 1,
                                     "layer": 0, "positions": [0, 999, 4000, 8191],
                                     "block_tokens": 128}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": [1023, 7], "block_tokens": 32,
                                     "max_blocks": 256, "replay_positions": [[4095, -1], [8191, 8]]},
         COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B8, **_T8K, "capacity": 1024}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B64L, **_T8K, "capacity": 2048}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B64S, **_T8K, "capacity": 512}, COMBINE),
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": [8191, 0, 300, 7], "block_tokens": 64,
                                     "max_blocks": 128, "span": 512}, COMBINE),
    # one captured graph replayed as the rows' lengths change: short, long, mixed, shrunk
    Case(DECODE, paged_decode_case, {**LLAMA, "positions": _B8[::-1], **_T8K, "capacity": 1024,
                                     "replay_positions": [[4] * 8, [8191] * 8, _B8,
                                                          [300, -1, 2, 9, 8000, 1, 511, 77]]},
         COMBINE),
    # the one-kernel decode at Llama-3-8B shapes: batch 1 at 8192 / 4097 / 1 keys, batch 2 with
    # a padding row, head_dim 64, and a captured graph replayed at other lengths
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [8191]}),
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [4096], "block_tokens": 64}),
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [0, -1]}),
    Case(CLUSTER, paged_decode_cluster_case, {"heads": 32, "kv_heads": 8, "head_dim": 64,
                                              "positions": [2999, 130]}),
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [5000],
                                              "replay_positions": [[17], [8000], [-1], [128]]}),
    # a row and head block over 2-4 clusters (cluster_decode_shape's parts): the last part to
    # finish merges, every counter is back at zero after each launch and replay
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [8191], "parts": 2}),
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [16383], "block_tokens": 64,
                                              "parts": 3}),
    Case(CLUSTER, paged_decode_cluster_case, {"heads": 32, "kv_heads": 8, "head_dim": 64,
                                              "positions": [2999, 130], "parts": 2}),
    Case(CLUSTER, paged_decode_cluster_case, {**LLAMA, "positions": [5000], "parts": 4,
                                              "replay_positions": [[17], [8000], [-1], [128]]}),
    Case(PREFILL, paged_prefill_case, {**LLAMA, "tokens": 2048, "start": 0, "chunk_len": 2048,
                                       "block_tokens": 16, "rows": 64}),
    Case(PREFILL, paged_prefill_case, {**LLAMA, "tokens": 512, "start": 1536, "chunk_len": 512,
                                       "block_tokens": 128, "rows": 64}),
    Case(PREFILL, paged_prefill_case, {**LLAMA, "tokens": 2048, "start": 6144, "chunk_len": 2000,
                                       "block_tokens": 64, "rows": 64}),
    Case(PREFILL, paged_prefill_case, {"heads": 32, "kv_heads": 8, "head_dim": 64, "layers": 2,
                                       "layer": 1, "tokens": 2048, "start": 100,
                                       "chunk_len": 2048, "block_tokens": 32, "rows": 64}),
    Case("sample", sample_case, {"vocab": 128256, "params": _SAMPLE64}),
]


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


def _check(harness, case) -> None:
    failure = case.run(harness, np.random.default_rng(sum(map(ord, case.id)))).failure()
    assert failure is None, f"{case.id[:120]}: device result differs from the reference: {failure}"


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c.id for c in PAGED_CASES])
def test_cuda_paged_kernel_matches_its_numpy_reference(harness, case) -> None:
    _check(harness, case)


@pytest.mark.parametrize("case", MODEL_CASES, ids=[c.id[:100] for c in MODEL_CASES])
def test_cuda_paged_kernel_at_model_shapes_matches_its_numpy_reference(harness, case) -> None:
    _check(harness, case)


def test_a_rows_sampled_token_does_not_depend_on_the_batch_it_shares(harness) -> None:
    """Row (logits, seed, position) sampled alone, then inside two different batches at other
    indices: the same token every time."""
    rng = np.random.default_rng(9)
    vocab = 128256
    row = rng.standard_normal(vocab, dtype=np.float32) * 2
    params = (41, 0.8, 0.9, 100, 1234)

    def run(index: int, batch: int) -> int:
        logits = rng.standard_normal((batch, vocab), dtype=np.float32) * 3
        logits[index] = row
        cols = [rng.integers(0, 5000, batch).astype(np.int32), np.full(batch, 1.0, np.float32),
                np.full(batch, 0.95, np.float32), np.full(batch, 40, np.int32),
                rng.integers(0, 1000, batch).astype(np.int32)]
        for c, v in zip(cols, params):
            c[index] = v
        out = harness.put(np.full(batch, -7, np.int32))
        launch_sample(harness.device, harness.function(SAMPLE), out, harness.put(logits),
                      *(harness.put(c) for c in cols), batch, vocab)
        return int(harness.get(out, (batch,), np.int32)[index])

    alone = run(0, 1)
    assert run(5, 16) == alone and run(40, 64) == alone


# the cluster kernel's build before the TMA ring: 16 warps, each loading its tiles (16-byte loads)
LOADS = {"GP_FDC_WARPS": 16, "GP_FDC_RING": 0, "GP_FDC_TMA": 0}


def _same_bits(harness, seed: int, params: dict, *builds) -> None:
    """Each build's cluster decode of the same inputs within the oracle's tolerance, and all of
    them the same fp16 bits."""
    outs = [paged_decode_cluster_case(harness, np.random.default_rng(seed), **params, build=b)
            for b in builds]
    for o in outs:
        assert o.failure() is None, o.failure()
    assert all(np.array_equal(outs[0].got, o.got) for o in outs[1:])


@pytest.mark.parametrize("params", [{**LLAMA, "positions": [8191]},
                                    {**LLAMA, "positions": [4096], "block_tokens": 64},
                                    {"heads": 32, "kv_heads": 8, "head_dim": 64, "positions": [2999, 130]}],
                         ids=["8192 keys", "4097 keys in blocks of 64", "head_dim 64, batch 2"])
def test_the_cluster_decodes_one_lookup_a_tile_gives_the_bits_of_one_lookup_a_row(harness, params) -> None:
    """GP_FDC_TILE_ROWS (the library's: a 16-key tile's rows from one table lookup) changes which
    instructions address a row, never which row: the same inputs give the same fp16 bits as the
    build that looks every row up."""
    from gpu_worker.kernels.paged_attention import decode_cluster_build

    _same_bits(harness, 24, params, decode_cluster_build(**LOADS), decode_cluster_build(**LOADS, GP_FDC_TILE_ROWS=0))


@pytest.mark.parametrize("params", [{**LLAMA, "positions": [8191]},
                                    {**LLAMA, "positions": [16383]},
                                    {**LLAMA, "positions": [4096], "block_tokens": 64},
                                    {"heads": 32, "kv_heads": 8, "head_dim": 64, "positions": [2999, 130]}],
                         ids=["8192 keys", "16384 keys", "4097 keys in blocks of 64", "head_dim 64, batch 2"])
@pytest.mark.parametrize("ring,loads", [({**LOADS, "GP_FDC_RING": 1}, LOADS),
                                        ({"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 0},
                                         {"GP_FDC_WARPS": 8, "GP_FDC_RING": 0, "GP_FDC_TMA": 0})],
                         ids=["16 warps, ring 1", "8 warps, ring 2"])
def test_the_cluster_decodes_ring_of_bulk_copies_gives_the_bits_of_its_loads(harness, params, ring,
                                                                             loads) -> None:
    """GP_FDC_RING brings each warp's tiles through shared memory by bulk copies (the newest key's
    rows after the dependent-launch wait, V rows past the row's end zeroed) instead of 16-byte
    loads: the same values reach the same registers, so the same inputs give the same fp16 bits
    as the build with the same warps that loads them."""
    from gpu_worker.kernels.paged_attention import decode_cluster_build

    _same_bits(harness, 25, params, decode_cluster_build(**ring), decode_cluster_build(**loads))


@pytest.mark.parametrize("params", [{**LLAMA, "positions": [8191]},
                                    {**LLAMA, "positions": [16383]},
                                    {**LLAMA, "positions": [4096], "block_tokens": 64},
                                    {"heads": 32, "kv_heads": 8, "head_dim": 64, "positions": [2999, 130]},
                                    {**LLAMA, "positions": [0, 17, -1]}],
                         ids=["8192 keys", "16384 keys", "4097 keys in blocks of 64", "head_dim 64, batch 2",
                              "1 and 18 keys and a padding row"])
@pytest.mark.parametrize("defines", [{"GP_FDC_WARPS": 16, "GP_FDC_RING": 1, "GP_FDC_TMA": 1},
                                     {"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 1},
                                     {"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 1,
                                      "GP_FDC_PAIR": 1},
                                     {"GP_FDC_WARPS": 4, "GP_FDC_RING": 4, "GP_FDC_TMA": 1,
                                      "GP_FDC_PAIR": 1},
                                     {"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 1,
                                      "GP_FDC_PAIR": 1, "GP_FD_QK_CHAINS": 2},
                                     {"GP_FDC_WARPS": 6, "GP_FDC_RING": 3, "GP_FDC_TMA": 1},
                                     {"GP_FDC_WARPS": 10, "GP_FDC_RING": 2, "GP_FDC_TMA": 1}],
                         ids=["16 warps, ring 1", "8 warps, ring 2 (the library's)",
                              "8 warps, ring 2, tile pairs", "4 warps, ring 4, tile pairs",
                              "tile pairs, two S chains", "6 warps, ring 3", "10 warps, ring 2"])
def test_the_cluster_decodes_ring_by_the_tma_unit_matches_the_oracle(harness, params, defines) -> None:
    """GP_FDC_TMA fills the ring from the pool's 5-D tensor map, a 16-key tile as 64-dim boxes
    (the newest key's tile after the dependent-launch wait), and reads its own dims order: the
    oracle's output within the kernels' tolerance, partial tiles and padding rows included."""
    from gpu_worker.kernels.paged_attention import decode_cluster_build

    o = paged_decode_cluster_case(harness, np.random.default_rng(27), **params,
                                  build=decode_cluster_build(**defines))
    assert o.failure() is None, o.failure()


@pytest.mark.parametrize("defines", [{**LOADS, "GP_FDC_RING": 1}, {"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 1},
                                     {"GP_FDC_WARPS": 8, "GP_FDC_RING": 2, "GP_FDC_TMA": 1, "GP_FDC_PAIR": 1}],
                         ids=["bulk copies", "tma (the library's)", "tma, tile pairs"])
def test_the_cluster_decodes_ring_keeps_to_the_oracle_over_a_replayed_graph(harness, defines) -> None:
    """A captured ring build replayed as rows grow (the split, the ring's partial last tile and
    the newest key's tile read from the device positions every launch) equals the oracle each
    time."""
    from gpu_worker.kernels.paged_attention import decode_cluster_build

    o = paged_decode_cluster_case(harness, np.random.default_rng(26), **LLAMA, positions=[1000],
                                  replay_positions=[[1001], [1016], [4099]],
                                  build=decode_cluster_build(**defines))
    assert o.failure() is None, o.failure()


@pytest.mark.parametrize("parts", [2, 4])
def test_a_decode_over_several_clusters_gives_the_same_bits_whichever_part_finishes_last(harness, parts) -> None:
    """The last part to arrive merges the parts' slots in part order, so the arrival order,
    which changes from launch to launch, never reaches the output's bits."""
    outs = [paged_decode_cluster_case(harness, np.random.default_rng(7), **LLAMA, positions=[16383],
                                      block_tokens=64, parts=parts) for _ in range(4)]
    for o in outs:
        assert o.failure() is None, o.failure()
    assert all(np.array_equal(outs[0].got, o.got) for o in outs[1:])


@pytest.mark.parametrize("position,ran", [(2999, 1), (8191, 2), (16383, 4)])
def test_a_row_runs_in_the_parts_its_length_asks_and_one_part_gives_the_one_part_decodes_bits(
        harness, position, ran) -> None:
    """part_keys 4096 over a launch of 4 parts: 3,000 keys run in one part (its bits those of
    the one-part launch: the same spans, no merge through the workspace), 8,192 in two, 16,384
    in four; each keeps to the oracle and leaves every counter at zero."""
    def case(parts, part_keys=None):
        return paged_decode_cluster_case(harness, np.random.default_rng(11), **LLAMA,
                                         positions=[position], parts=parts, part_keys=part_keys)
    fewer = case(4, 4096)
    assert fewer.failure() is None, fewer.failure()
    if ran == 1:
        one = case(1)
        assert np.array_equal(fewer.got[:one.got.size], one.got.reshape(-1))
    else:
        alike = case(ran)   # the same spans: a launch of exactly the parts the row ran in
        assert np.array_equal(fewer.got, alike.got)
