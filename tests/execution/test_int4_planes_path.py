"""Where the decode graph's int4 linear splits x once (int4_batched.use_planes): the launch
context's tile holds the planes, the executor allocates the tile for such a node, and a tile
too small for a node's planes sends it back to the per-block split (the same bits: tests/gpu)."""
from __future__ import annotations

from types import SimpleNamespace

from gpu_worker.execution import ops
from gpu_worker.kernels import int4_batched
from gpu_worker.models.graph import GraphBuilder


def _linear_node(rows: int, k: int, dtype: str = "f32"):
    b = GraphBuilder()
    b.tensor("x", (rows, k), dtype)
    b.tensor("y", (rows, 512), "f32")
    b.node("l", "linear_int4", ("x",), ("y",), ())
    return SimpleNamespace(nodes=b.nodes, tensors=b.tensors), b.nodes[0]


def test_rows_from_the_threshold_on_the_mma_path_split_x_once() -> None:
    lo = int4_batched.PLANES_MIN_ROWS
    for rows, dtype, k, want in ((lo, "f32", 4096, True), (64, "f32", 14336, True),
                                 (lo - 1, "f32", 4096, False), (lo, "f16", 4096, False),
                                 (lo, "f32", 4160, False), (65, "f32", 4096, False)):
        graph, node = _linear_node(rows, k, dtype)
        assert ops.OPS["linear_int4"].tile(node, graph) is want, (rows, dtype, k)


def test_the_tile_holds_the_widest_linears_planes_within_its_limit() -> None:
    need = int4_batched.planes_bytes(int4_batched.MMA_MAX_ROWS, 14336)
    assert ops.tile_bytes_for([1 << 10], 64 << 20, 14336) == need, "planes beyond the weights"
    assert ops.tile_bytes_for([1 << 10], 1 << 20, 14336) == 1 << 20, "bounded by the limit"
    assert ops.tile_bytes_for([1 << 10], 64 << 20, 0) == 1 << 10, "no int4 linear: no planes"


def test_a_tile_too_small_for_the_planes_leaves_the_split_to_each_block() -> None:
    m, k = 32, 4096
    ctx = SimpleNamespace(tile=SimpleNamespace(ptr=0, size=int4_batched.planes_bytes(m, k) - 16))
    assert not ops._planes_fit(ctx, m, k)
    ctx.tile.size += 16
    assert ops._planes_fit(ctx, m, k)
    assert not ops._planes_fit(SimpleNamespace(tile=None), m, k)
