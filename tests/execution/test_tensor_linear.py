"""The prefill linear on tensor cores, through the executor on the sim: one bounded dequantization
tile per model shared by every linear node, each GEMM shape warmed up once before any capture."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.execution import ops
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models import reference as R
from gpu_worker.models import weights as W
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.encoder import EncoderModel

ATOL = 1e-3   # fp16 operand rounding (see tests/execution/test_executor.py)


def seqs(batch, seq):
    return [[(b * 131 + t * 17) % 1024 for t in range(seq)] for b in range(batch)]


def test_tile_rows_split_a_weight_that_exceeds_the_tile_into_64_row_multiples():
    assert ops.tile_rows(1024, 4096, 32 << 20) == 1024, "a weight that fits is one tile"
    rows = ops.tile_rows(14336, 4096, 32 << 20)
    assert rows == 4096 and -(-14336 // rows) == 4, "8b's MLP weight: 4 tiles of 32 MiB"
    assert ops.tile_rows(4096, 14336, 32 << 20) % 64 == 0
    with pytest.raises(ValueError, match="--dequant-tile-bytes"):
        ops.tile_rows(4096, 14336, 1 << 20)


def test_every_linear_shares_one_bounded_tile_and_results_match_the_reference(device, compiler,
                                                                              monkeypatch):
    monkeypatch.setattr(ops, "DEQUANT_TILE_BYTES", 256 << 10)   # w_up: 5 tiles, w_down: 6
    cfg = CONFIGS["small-encoder"]
    ex = ModelExecutor(device, compiler)
    model = EncoderModel(ex, cfg, 1)
    model.load()
    ref = R.EncoderReference(cfg, W.load_host(cfg, 1))
    for batch, seq in ((2, 40), (3, 33)):     # > 64 rows: the tensor-core path
        got = model.embed(seqs(batch, seq))
        assert np.allclose(got, ref.embed(np.array(seqs(batch, seq))), atol=ATOL), (batch, seq)
        assert ex.tile.size == 256 << 10, "the tile is bounded by the limit, not by the weight"
        assert ex.kernels.stats()["workspace_bytes"] == 0, "no per-variant dequant workspace"
    ex.close()
    assert device.blas_stats()["workspace_bytes"] == 0, "the last model gave the BLAS back"


def test_a_gemm_shape_is_warmed_up_once_before_the_capture_that_records_it(device, compiler):
    cfg = CONFIGS["tiny-encoder"]
    ex = ModelExecutor(device, compiler, max_plans=1)
    model = EncoderModel(ex, cfg, 1)
    model.load()
    model.embed(seqs(2, 40))
    blas = device.blas
    warm, calls = blas.stats()["warm_shapes"], blas.stats()["calls"]
    assert warm > 0, "the first plan's GEMM shapes were warmed up"
    model.embed(seqs(4, 17))           # another plan; rows 68: new shapes, warmed, then captured
    model.embed(seqs(2, 40))          # the first shape again (plan rebuilt): nothing to warm
    assert blas.stats()["warm_shapes"] > warm
    per_run = sum(len(ops.OPS[n.op].gemms(n, p.graph, ex.tile.size))
                  for p in [ex.plans.get(("encode", 2, 40))] for n in p.graph.nodes)
    # (2, 40) rebuilt: its capture records GEMMs but runs no eager warm-up; a replay runs on the
    # device without calling the library from the host
    assert blas.stats()["calls"] - calls == 2 * per_run + per_run, \
        "warm-up + capture for (4, 17), capture only for the rebuilt (2, 40)"
    ex.close()


def test_every_int4_linear_reads_fp16_x_whatever_its_path():
    from gpu_worker.models.graph import GraphBuilder, GraphError

    def build(rows, dtype):
        g = GraphBuilder()
        g.tensor("x", (rows, 64), dtype, "input")
        g.linear_int4("lin", "x", "y", rows, 32, 64)
        return [(nd.op, nd.inputs) for nd in g.nodes]

    # every int4 path (GEMV, int4_mma, dequant tile + cuBLAS) reads fp16: f32 x is cast, fp16 x
    # is read as it is
    for rows in (1, 17, 64, 65):
        assert build(rows, "f32") == [("to_f16", ("x",)), ("linear_int4", ("lin.x16",))]
        assert build(rows, "f16") == [("linear_int4", ("x",))]
    with pytest.raises(GraphError, match="i32"):
        build(65, "i32")


def test_an_embedding_does_not_depend_on_the_batch_that_carried_it(device, compiler):
    """Every int4 path computes one contract (reference.int4_matmul: fp16 x, fp16-rounded
    weights, f32 sums): a 20-token sequence alone runs its linears at 20 rows (the fused path),
    in a batch of four at 80 (dequant tile + GEMM), and its embedding is the same bits."""
    cfg = CONFIGS["tiny-encoder"]
    ex = ModelExecutor(device, compiler)
    model = EncoderModel(ex, cfg, 1)
    model.load()
    batch = seqs(4, 20)
    alone = model.embed(batch[:1])
    together = model.embed(batch)
    keys = list(ex.plans.keys())
    assert {k[1] * k[2] for k in keys if k[0] == "encode"} >= {20, 80}, keys
    assert np.array_equal(alone[0], together[0]), np.abs(alone[0] - together[0]).max()
    ex.close()


@pytest.mark.parametrize("tiled", [False, True], ids=["reference layout", "16-row tiles"])
@pytest.mark.parametrize(("rows", "out_dim", "entry"), [
    (64, 28672, "gp_int4_wgmma"),        # 40..64 rows on sm_90 (the sim's): warpgroup MMA
    (40, 28672, "gp_int4_wgmma"),
    (40, 4096, "gp_int4_wgmma"),         # K = 128: no split (one k-group)
    (39, 4096, "gp_int4_mma_xa"),        # 9..39 rows: x as the mma's A operand
    (24, 28672, "gp_int4_mma_xa"),
    (17, 4096, "gp_int4_mma_xa"),
    (16, 28672, "gp_int4_mma_xa"),       # 9..16 rows: one 16-row x tile
    (9, 4096, "gp_int4_mma_xa"),
    (8, 6144, "gp_int4_mma_rows"),       # 1..8 rows: the rows kernel of one x tile
    (1, 128256, "gp_int4_mma_rows"),     # the batch-1 decode linear
])
def test_a_decode_batch_linear_runs_on_the_kernel_its_rule_names(rows, out_dim, entry,
                                                                 tiled) -> None:
    """ops.py's int4 linear through its binding on the sim: the kernel int4_batched.mma_kernel
    names is launched (its sim twin checks the grid covers every row), its `_tiled` entry where
    the executor stored the weight in the 16-row tile layout, and y is the reference."""
    launched, got, want = _run_int4_linear(rows, out_dim, tiled)
    assert launched == [entry + ("_tiled" if tiled else "")]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_a_linear_whose_weight_and_scales_are_in_different_layouts_is_refused() -> None:
    with pytest.raises(RuntimeError, match="different layouts"):
        _run_int4_linear(1, 4096, lambda name: name == "w.packed")


def test_only_int4_weights_of_whole_tiles_are_stored_tiled_and_untiling_gives_them_back() -> None:
    """ops.device_weight: an int4 linear's `.q` and `.s` of N % 16 == 0 and K % 128 == 0 take
    the 16-row tile layout (the same bytes, permuted, as a view of the host array: no copy);
    other weights, shapes and dtypes are stored as given."""
    from gpu_worker.kernels import int4_batched
    from gpu_worker.kernels import reference as kref

    rng = np.random.default_rng(5)
    packed, scales = kref.int4_quantize(rng.standard_normal((48, 256)).astype(np.float32))
    q, q_tiled = ops.device_weight("layers.0.wqkv.q", packed)
    s, s_tiled = ops.device_weight("layers.0.wqkv.s", scales)
    assert q_tiled and s_tiled and q.nbytes == packed.nbytes and s.nbytes == scales.nbytes
    assert np.shares_memory(q, packed) and np.shares_memory(s, scales), "a copy was made"
    assert np.array_equal(np.ascontiguousarray(q).view(np.uint8).reshape(packed.shape),
                          int4_batched.tile_packed(packed))
    back = int4_batched.rows_untiled(q, s, 48, 256)
    assert np.array_equal(back[0], packed) and np.array_equal(back[1], scales)
    assert not np.array_equal(np.ascontiguousarray(q).view(np.uint8).reshape(packed.shape),
                              packed), "the layout moved nothing"
    odd_n, _ = kref.int4_quantize(rng.standard_normal((40, 256)).astype(np.float32))
    odd_k, _ = kref.int4_quantize(rng.standard_normal((48, 160)).astype(np.float32))
    for key, host in (("layers.0.wqkv.q", odd_n), ("layers.0.wqkv.q", odd_k),
                      ("layers.0.wqkv.h", rng.standard_normal((48, 256)).astype(np.float16)),
                      ("embed", rng.standard_normal((48, 256)).astype(np.float16)),
                      ("layers.0.attn_norm.w", np.ones(256, np.float32))):
        stored, tiled = ops.device_weight(key, host)
        assert not tiled and stored is host, key


def _run_int4_linear(rows: int, out_dim: int, tiled):
    """(entries launched, y, the reference) of one linear_int4 node through ops.OPS on the sim,
    K = 128; `tiled`: whether (or, a function of the weight name, which of) the weights are
    stored in the 16-row tile layout."""
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device
    from gpu_worker.kernels import int4_batched
    from gpu_worker.kernels import reference as kref
    from gpu_worker.kernels.selfcheck import KernelHarness
    from gpu_worker.models.graph import GraphBuilder

    k = 128
    rng = np.random.default_rng(rows + out_dim)
    x = rng.standard_normal((rows, k)).astype(np.float16)
    packed, scales = kref.int4_quantize(rng.standard_normal((out_dim, k)).astype(np.float32) / 16)
    g = GraphBuilder()
    g.tensor("x", (rows, k), "f16", "input")
    g.tensor("w.packed", packed.shape, "u8", "weight")
    g.tensor("w.scales", scales.shape, "f16", "weight")
    g.node("lin", "linear_int4", ("x",), (g.tensor("y", (rows, out_dim)),),
           ("w.packed", "w.scales"))
    graph = g.build(("y",))
    node = graph.nodes[0]
    device = open_device("sim")
    launched: list[str] = []
    with KernelHarness(device, KernelCompiler(device.info.arch)) as h:
        layout = tiled if callable(tiled) else (lambda name: tiled)
        stored = {"w.packed": int4_batched.tile_packed(packed) if layout("w.packed") else packed,
                  "w.scales": int4_batched.tile_scales(scales) if layout("w.scales") else scales}
        ptrs = {"x": h.put(x), "w.packed": h.put(stored["w.packed"]),
                "w.scales": h.put(stored["w.scales"]),
                "y": h.put(np.zeros((rows, out_dim), np.float32))}
        binding = ops.OPS["linear_int4"]
        functions = {kd.name: h.function(kd) for kd in binding.kernels}
        entries = {id(functions[kd.name]): kd.entry for kd in binding.kernels}
        real_launch = device.launch

        def recording_launch(function, *a, **kw):
            launched.append(entries[id(function)])
            return real_launch(function, *a, **kw)

        device.launch = recording_launch
        variant = type("V", (), {"function": functions, "workspace_ptr": lambda self, n: 0})()
        try:
            binding.launch(ops.LaunchContext(device, node, graph, variant, ptrs.__getitem__,
                                             None, tiled=layout))
            got = h.get(ptrs["y"], (rows, out_dim))
        finally:
            device.launch = real_launch
    device.close()
    return launched, got, kref.int4_matmul(x, packed, scales)
