"""The issue-13 graph ops (rotary_rows, kv_append_paged, flash_attention_{decode,prefill}_paged,
sample) through their OPS bindings on the sim: a decode step and a prefill chunk built as graphs
with the contract's tensor names and attrs, launched node by node, against the references."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.execution.ops import OPS, LaunchContext
from gpu_worker.kernels import paged_attention as pa
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.selfcheck import KernelHarness
from gpu_worker.models.graph import GraphBuilder

HEADS, KVH, HD, LAYERS, LAYER, BT, MAXB, CAP = 4, 2, 16, 2, 1, 16, 4, 14
THETA = 10000.0


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    device = open_device("sim")
    h = KernelHarness(device, KernelCompiler(device.info.arch,
                                             cache_dir=tmp_path_factory.mktemp("kernels")))
    yield h
    h.close()
    device.close()


class _Variant:
    """What a launcher sees of a kernel-cache variant: entry functions and workspaces."""

    def __init__(self, h: KernelHarness, node, graph) -> None:
        b = OPS[node.op]
        self.function = {k.name: h.function(k) for k in b.kernels}
        # zeroed, as the kernel cache's are (the cluster decode's counters start at zero)
        self._ws = {n: h.put(np.zeros(nb // 4, np.float32)) if nb > 0 else 0
                    for n, nb in b.workspace(node, graph).items()}

    def workspace_ptr(self, name: str) -> int:
        return self._ws[name]


def _run(h: KernelHarness, graph, ptrs: dict[str, int]) -> None:
    for node in graph.nodes:
        c = LaunchContext(h.device, node, graph, _Variant(h, node, graph), ptrs.__getitem__, None)
        OPS[node.op].launch(c)


def _pool_tensor(g: GraphBuilder) -> str:
    return g.tensor("kv.pool", (CAP, LAYERS, 2, BT, KVH, HD), "f16", "state")


def _attrs() -> dict:
    return {"layer": LAYER, "layers": LAYERS, "block_tokens": BT, "kv_heads": KVH,
            "head_dim": HD, "max_blocks": MAXB}


def test_a_paged_decode_step_through_the_op_bindings_matches_the_references(harness) -> None:
    rng = np.random.default_rng(0)
    rows, vocab = 3, 50
    positions = np.array([5, -1, 37], np.int32)          # row 1 pads the batch
    table = rng.permutation(CAP)[:rows * MAXB].reshape(rows, MAXB).astype(np.int32)
    pool = rng.standard_normal((CAP, LAYERS, 2, BT, KVH, HD), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((rows, HEADS * HD), dtype=np.float32)
    k = rng.standard_normal((rows, KVH * HD), dtype=np.float32)
    v = rng.standard_normal((rows, KVH * HD), dtype=np.float32)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    params = [np.array([0.0, 1.0, 0.8], np.float32), np.array([1.0, 1.0, 0.9], np.float32),
              np.array([0, 0, 10], np.int32), np.array([1, 2, 3], np.int32)]

    g = GraphBuilder()
    for name, arr in (("q", q), ("k", k), ("v", v)):
        g.tensor(name, arr.shape, "f32", "input")
    g.tensor("positions", (rows,), "i32", "input")
    g.tensor("block_table", (rows, MAXB), "i32", "input")
    g.tensor("q16", (rows, HEADS * HD), "f16", "input")
    g.tensor("logits", (rows, vocab), "f32", "input")
    for name, dt in (("temperature", "f32"), ("top_p", "f32"), ("top_k", "i32"), ("seed", "i32")):
        g.tensor(name, (rows,), dt, "input")
    pool_t = _pool_tensor(g)
    g.node("rope_q", "rotary_rows", ("q", "positions"), ("q",), heads=HEADS, head_dim=HD, theta=THETA)
    g.node("rope_k", "rotary_rows", ("k", "positions"), ("k",), heads=KVH, head_dim=HD, theta=THETA)
    g.node("append", "kv_append_paged", ("k", "v", "positions", "block_table"), (pool_t,), **_attrs())
    g.node("attn", "flash_attention_decode_paged", ("q16", pool_t, "positions", "block_table"),
           (g.tensor("a", (rows, HEADS * HD), "f16"),), heads=HEADS, **_attrs())
    g.node("pick", "sample", ("logits", "positions", "temperature", "top_p", "top_k", "seed"),
           (g.tensor("next", (rows,), "i32"),))
    graph = g.build(("a", "next"))

    ptrs = {"q": harness.put(q), "k": harness.put(k), "v": harness.put(v),
            "positions": harness.put(positions), "block_table": harness.put(table),
            "kv.pool": harness.put(pool), "logits": harness.put(logits),
            "a": harness.put(np.full((rows, HEADS * HD), np.nan, np.float16)),
            "next": harness.put(np.full(rows, -7, np.int32))}
    # q16 is the rotated q in fp16: the engine's to_f16 node; here the rotated reference's cast
    q_rot = ref.rotary_rows(q.reshape(rows, HEADS, HD), positions, THETA).reshape(rows, -1)
    ptrs["q16"] = harness.put(q_rot.astype(np.float16))
    for name, arr in zip(("temperature", "top_p", "top_k", "seed"), params):
        ptrs[name] = harness.put(arr)
    _run(harness, graph, ptrs)

    got_q = harness.get(ptrs["q"], (rows, HEADS * HD))
    assert np.allclose(got_q, q_rot, atol=1e-5) and not got_q[1].any(), "rotary_rows"
    k_rot = ref.rotary_rows(k.reshape(rows, KVH, HD), positions, THETA).reshape(rows, -1)
    want_pool = pa.kv_append_paged(pool, k_rot, v, positions, table, LAYER)
    got_pool = harness.get(ptrs["kv.pool"], pool.shape, np.float16)
    assert np.array_equal(got_pool, want_pool), "kv_append_paged wrote other bytes"
    want_a = pa.flash_decode_paged(q_rot.astype(np.float16), want_pool, positions, table, LAYER, HEADS)
    got_a = harness.get(ptrs["a"], (rows, HEADS * HD), np.float16)
    assert np.allclose(got_a.astype(np.float32), want_a.astype(np.float32), rtol=1e-2, atol=2e-3)
    assert not got_a[1].any(), "a padding row's attention output is zero"
    got_next = harness.get(ptrs["next"], (rows,), np.int32)
    assert list(got_next) == list(ref.sample(logits, positions, *params))
    assert got_next[0] == int(np.argmax(logits[0])) and got_next[1] == -1


def test_a_paged_prefill_chunk_through_the_op_binding_zeroes_its_padding_rows(harness) -> None:
    rng = np.random.default_rng(1)
    tokens, start, chunk = 24, 19, 20
    table = rng.permutation(CAP)[:MAXB].reshape(1, MAXB).astype(np.int32)
    pool = rng.standard_normal((CAP, LAYERS, 2, BT, KVH, HD), dtype=np.float32).astype(np.float16)
    q = rng.standard_normal((tokens, HEADS * HD), dtype=np.float32).astype(np.float16)
    g = GraphBuilder()
    g.tensor("q16", q.shape, "f16", "input")
    for name, shape in (("start", (1,)), ("chunk_len", (1,)), ("block_table", (1, MAXB))):
        g.tensor(name, shape, "i32", "input")
    pool_t = _pool_tensor(g)
    g.node("attn", "flash_attention_prefill_paged",
           ("q16", pool_t, "start", "chunk_len", "block_table"),
           (g.tensor("a", q.shape, "f16"),), heads=HEADS, **_attrs())
    graph = g.build(("a",))
    ptrs = {"q16": harness.put(q), "kv.pool": harness.put(pool),
            "start": harness.put(np.array([start], np.int32)),
            "chunk_len": harness.put(np.array([chunk], np.int32)),
            "block_table": harness.put(table), "a": harness.put(np.full(q.shape, np.nan, np.float16))}
    _run(harness, graph, ptrs)
    got = harness.get(ptrs["a"], q.shape, np.float16).astype(np.float32)
    want = pa.flash_prefill_paged(q, pool, start, chunk, table[0], LAYER, HEADS).astype(np.float32)
    assert np.allclose(got, want, rtol=1e-2, atol=2e-3)
    assert not got[chunk:].any() and got[:chunk].any()


def test_the_paged_decode_workspace_depends_on_the_graph_shape_not_the_lengths() -> None:
    def ws(rows, maxb):
        g = GraphBuilder()
        g.tensor("q16", (rows, 32 * 128), "f16", "input")
        g.tensor("positions", (rows,), "i32", "input")
        g.tensor("block_table", (rows, maxb), "i32", "input")
        g.tensor("kv.pool", (8, 1, 2, 16, 8, 128), "f16", "state")
        g.node("attn", "flash_attention_decode_paged", ("q16", "kv.pool", "positions", "block_table"),
               (g.tensor("a", (rows, 32 * 128), "f16"),), heads=32, layer=0, layers=1,
               block_tokens=16, kv_heads=8, head_dim=128, max_blocks=maxb)
        graph = g.build(("a",))
        return OPS["flash_attention_decode_paged"].workspace(graph.nodes[0], graph)["splits"]

    def splits(rows, maxb):
        return pa.paged_decode_splits(maxb, 16, pa.paged_decode_span(maxb, 16, rows, 32, 8))

    splits_1 = splits(1, 512)
    assert ws(1, 512) == 4 * 32 * splits_1 * 130
    assert ws(32, 512) == 4 * 32 * 32 * splits(32, 512) * 130
