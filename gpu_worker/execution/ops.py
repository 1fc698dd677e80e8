"""Graph op -> kernel library bindings: which kernels a node needs, the workspaces a variant owns
for the node's shapes, and how to launch it.

The int4 linear reads fp16 x on every path (one numeric contract, reference.int4_matmul: fp16 x,
each weight rounded once to fp16, f32 sums), and the row count picks the kernel
(`linear.int4_path`): up to 64 rows (decode, a decode batch, a short chunk) read the packed
weight directly, no workspace: one row in the fused int4 GEMV, 2..64 rows (K a multiple of 128) in
the tensor-core int4_mma that streams the weight once for all rows
(gpu_worker.kernels.int4_batched); more rows (prefill) run on cuBLAS: the weight is dequantized to
fp16 one bounded tile of rows at a time into the model's dequantization tile
(`ModelExecutor.dequant_tile`, booked in `workspace`, one per model: nodes run one after another
on the model's stream, so one tile serves them all), and each tile is multiplied by cuBLAS
(gpu_worker.device.blas) with fp32 accumulation into its columns of y. The tile is
`DEQUANT_TILE_BYTES` (default 32 MiB) at most, whatever the weight: a 14336 x 4096 MLP weight
takes 4 tiles instead of 112 MiB of scratch (224 MiB per variant per node in f32 before).

An int4 weight of whole 16-row tiles and k-groups (int4_batched.tiled_layout) is stored on the
device in the 16-row tile layout (`device_weight`, applied by the executor as weights are added:
its `.q` packed bytes and `.s` scales, permuted as the weight store copies them into pinned
memory), and its linears launch the kernels' `_tiled` entries: the decode kernels read it
5-14 % faster (docs/kernels.md). Other weights keep the reference layout, read by the same
kernels' plain entries.

The fp16 linear (`weight_format: fp16`, GraphBuilder.linear_f16) is one cuBLAS GEMM for every row
count, decode's single row included: x arrives as fp16 (a `to_f16` node), W is read from its
weight slot as stored, y is f32. It owns no workspace beyond the device BLAS's own, and needs no
dequantization tile. It uses only what was verified on the H200 (to_f16, cublasGemmEx under
capture); tests/gpu/test_checkpoints_fp16.py passes on the H200.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from gpu_worker.config import DEFAULT_DEQUANT_TILE_BYTES
from gpu_worker.kernels import (
    attention,
    elementwise,
    embedding,
    flash_attention,
    half,
    int4_batched,
    linear,
    norm,
    paged_attention,
    qkv,
    reduce,
    rotary,
    sampling,
)
from gpu_worker.models.graph import Graph, Node

DEQUANT_TILE_BYTES = DEFAULT_DEQUANT_TILE_BYTES   # the default bound; WorkerConfig.dequant_tile_bytes
TILE_ROW_ALIGN = 64   # tile rows: a multiple of 64 keeps every GEMM's output columns aligned


@dataclass
class LaunchContext:
    device: object
    node: Node
    graph: Graph
    variant: object           # KernelVariant: .function (dict name -> fn), .workspace_ptr(name)
    ptr: Callable[[str], int]
    stream: object
    tile: object = None       # the model's dequantization tile (.ptr, .size), when an op needs it
    # whether a weight is stored in the 16-row tile layout (`device_weight`)
    tiled: Callable[[str], bool] = field(default=lambda name: False)

    def fn(self, kernel_name: str) -> object:
        return self.variant.function[kernel_name]

    def shape(self, i: int) -> tuple[int, ...]:
        return self.graph.tensors[self.node.inputs[i]].shape

    def inp(self, i: int) -> int:
        return self.ptr(self.node.inputs[i])

    def out(self, i: int = 0) -> int:
        return self.ptr(self.node.outputs[i])

    def weight(self, i: int) -> int:
        return self.ptr(self.node.weights[i])

    def int4_tiled(self) -> bool:
        """Whether this int4 linear's packed weight and scales are in the 16-row tile layout."""
        packed, scales = (self.tiled(w) for w in self.node.weights[:2])
        if packed != scales:
            raise RuntimeError(f"{self.node.name}: packed weight {self.node.weights[0]!r} and "
                               f"scales {self.node.weights[1]!r} are stored in different layouts")
        return packed


def device_weight(key: str, host: np.ndarray) -> tuple[np.ndarray, bool]:
    """(the array whose bytes in C order a weight is stored as on the device, whether it is in
    the 16-row tile layout): an int4 linear's packed `.q` (N, K/2) u8 and scales `.s` (N, K/32)
    fp16 are tiled where int4_batched.tiled_layout(N, K) holds, as a strided view of `host` (no
    copy here: the weight store's one copy into pinned memory permutes them); every other
    weight is stored as given."""
    a = np.asarray(host)
    if a.ndim == 2 and key.endswith(".q") and a.dtype == np.uint8 and \
            int4_batched.tiled_layout(a.shape[0], 2 * a.shape[1]):
        return int4_batched.packed_tile_view(np.ascontiguousarray(a)), True
    if a.ndim == 2 and key.endswith(".s") and a.dtype == np.float16 and \
            int4_batched.tiled_layout(a.shape[0], 32 * a.shape[1]):
        return int4_batched.scales_tile_view(np.ascontiguousarray(a)), True
    return host, False


@dataclass(frozen=True)
class OpBinding:
    kernels: tuple                                       # KernelDefs the op launches
    launch: Callable[[LaunchContext], None]
    workspace: Callable[[Node, Graph], dict[str, int]] = lambda node, graph: {}
    # GEMM shapes (m, n, k) the op hands to the device's BLAS for this node (warmed up before capture)
    gemms: Callable[[Node, Graph, int], list[tuple[int, int, int]]] = lambda node, graph, tile: []
    # The op honours a node's `accumulate` attribute: y += x @ W^T into its output, which the
    # node also names as its second input (the residual stream, updated in place). The graph
    # builders fold a residual add into a linear only where this holds (GraphBuilder.linear).
    accumulate: bool = False


def tile_rows(n: int, k: int, tile_bytes: int) -> int:
    """Weight rows per dequantization tile: all n when they fit, else a multiple of 64."""
    fit = tile_bytes // max(1, 2 * k)
    if fit >= n:
        return n
    if fit < TILE_ROW_ALIGN:
        raise ValueError(f"a dequantization tile of {tile_bytes} bytes holds fewer than "
                         f"{TILE_ROW_ALIGN} rows of k={k}: raise --dequant-tile-bytes (GPUPLANE_DEQUANT_TILE_BYTES)")
    return fit // TILE_ROW_ALIGN * TILE_ROW_ALIGN


def tile_bytes_for(fp16_weight_bytes: list[int], limit: int | None = None) -> int:
    """The model's tile: its largest weight in fp16 when that fits under `limit` (default
    DEQUANT_TILE_BYTES), else `limit`."""
    return min(DEQUANT_TILE_BYTES if limit is None else limit, max(fp16_weight_bytes, default=0))


def _linear_dims(node: Node, graph: Graph) -> tuple[int, int, int]:
    m, k = graph.tensors[node.inputs[0]].shape
    return m, graph.tensors[node.outputs[0]].shape[1], k


def _on_tensor_cores(node: Node, graph: Graph) -> bool:
    """Whether an int4 linear takes the prefill's dequant tile + cuBLAS (linear.int4_path)."""
    return linear.int4_path(_linear_dims(node, graph)[0]) == "tensor"


def _linear_gemms(node: Node, graph: Graph, tile_bytes: int) -> list[tuple[int, int, int]]:
    if not _on_tensor_cores(node, graph):
        return []
    m, n, k = _linear_dims(node, graph)
    rows = tile_rows(n, k, tile_bytes)
    return sorted({(m, min(rows, n - r0), k) for r0 in range(0, n, rows)})


def _launch_linear(c: LaunchContext) -> None:
    m, n, k = _linear_dims(c.node, c.graph)
    acc = bool(c.node.attributes.get("accumulate"))    # y += x @ W^T (the residual, in place)
    tiled = c.int4_tiled()
    if not _on_tensor_cores(c.node, c.graph):
        if int4_batched.mma_supported(m, k):   # a decode batch: the weight streamed once
            kernels = int4_batched.MMA_KERNELS_TILED if tiled else int4_batched.MMA_KERNELS
            kdef = kernels[int4_batched.mma_kernel(m, c.device.info.arch)]
            kdef.launcher(c.device, c.fn(kdef.name), c.out(), c.inp(0), c.weight(0), c.weight(1),
                          0, m, n, k, accumulate=acc, stream=c.stream)
            return
        assert not tiled, f"{c.node.name}: a tiled weight (k % 128 == 0) never takes the GEMV"
        linear.launch_int4_matmul(c.device, c.fn("int4_matmul"), c.out(), c.inp(0), c.weight(0),
                                  c.weight(1), 0, m, n, k, accumulate=acc, stream=c.stream)
        return
    assert c.tile is not None, f"{c.node.name}: the tensor-core linear needs the dequant tile"
    rows = tile_rows(n, k, c.tile.size)
    y = c.out()
    for r0 in range(0, n, rows):
        part = min(rows, n - r0)
        dequant = half.INT4_DEQUANT_F16_TILED if tiled else half.INT4_DEQUANT_F16
        dequant.launcher(c.device, c.fn(dequant.name), c.tile.ptr, c.weight(0), c.weight(1), r0,
                         part, n, k, stream=c.stream)
        # columns [r0, r0 + part) of y: row stride n
        c.device.blas.gemm_nt(y + 4 * r0, c.inp(0), c.tile.ptr, m, part, k, ldy=n,
                              accumulate=acc, stream=c.stream)


def _f16_gemms(node: Node, graph: Graph, tile_bytes: int) -> list[tuple[int, int, int]]:
    return [_linear_dims(node, graph)]


def _launch_linear_f16(c: LaunchContext) -> None:
    m, n, k = _linear_dims(c.node, c.graph)
    c.device.blas.gemm_nt(c.out(), c.inp(0), c.weight(0), m, n, k,
                          accumulate=bool(c.node.attributes.get("accumulate")), stream=c.stream)


def _launch_to_f16(c: LaunchContext) -> None:
    half.launch_to_f16(c.device, c.fn("to_f16"), c.out(), c.inp(0), _elements(c.shape(0)),
                       stream=c.stream)


def _launch_embedding(c: LaunchContext) -> None:
    vocab, hidden = c.graph.tensors[c.node.weights[0]].shape
    embedding.launch_embedding_gather(c.device, c.fn("embedding_gather"), c.out(), c.weight(0),
                                      c.inp(0), c.shape(0)[0], hidden, vocab, stream=c.stream)


def _out_f16(c: LaunchContext) -> bool:
    return c.graph.tensors[c.node.outputs[0]].dtype == "f16"


def _launch_rmsnorm(c: LaunchContext) -> None:
    """f32 out, or fp16 (rmsnorm_f16) when the next linear reads fp16: no to_f16 node."""
    rows, hidden = c.shape(0)
    launch, name = ((norm.launch_rmsnorm_f16, "rmsnorm_f16") if _out_f16(c)
                    else (norm.launch_rmsnorm, "rmsnorm"))
    launch(c.device, c.fn(name), c.out(), c.inp(0), c.weight(0), rows, hidden,
           float(c.node.attributes["eps"]), stream=c.stream)


def _launch_layernorm(c: LaunchContext) -> None:
    rows, hidden = c.shape(0)
    norm.launch_layernorm(c.device, c.fn("layernorm"), c.out(), c.inp(0), c.weight(0), c.weight(1),
                          rows, hidden, float(c.node.attributes["eps"]), stream=c.stream)


def _launch_rotary(c: LaunchContext) -> None:
    a = c.node.attributes
    tokens, width = c.shape(0)
    rotary.launch_rotary(c.device, c.fn("rotary"), c.inp(0), c.inp(1), 1, tokens, int(a["heads"]),
                         int(a["head_dim"]), width, 0, float(a["theta"]), stream=c.stream,
                         inv_freq=c.weight(0) if c.node.weights else 0)


def _launch_bias_add(c: LaunchContext) -> None:
    rows, cols = c.shape(0)
    elementwise.launch_bias_add(c.device, c.fn("bias_add"), c.out(), c.inp(0), c.weight(0), rows,
                                cols, stream=c.stream)


def _elements(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _launch_add(c: LaunchContext) -> None:
    elementwise.launch_add(c.device, c.fn("add"), c.out(), c.inp(0), c.inp(1), _elements(c.shape(0)),
                           stream=c.stream)


def _launch_silu_mul(c: LaunchContext) -> None:
    """silu(gate) * up from two tensors, or from one: the fused gate|up linear's rows (gate the
    first half of a row, up the second), read in place. fp16 out (silu_gate_f16) when the down
    projection reads fp16."""
    launch, name = ((elementwise.launch_silu_gate_f16, "silu_gate_f16") if _out_f16(c)
                    else (elementwise.launch_silu_gate, "silu_gate"))
    if len(c.node.inputs) == 1:
        rows, width = c.shape(0)
        cols = width // 2
        launch(c.device, c.fn(name), c.out(), c.inp(0), c.inp(0) + 4 * cols, rows, cols,
               width, width, stream=c.stream)
        return
    rows, cols = c.shape(0)
    launch(c.device, c.fn(name), c.out(), c.inp(0), c.inp(1), rows, cols, stream=c.stream)


def _launch_gelu(c: LaunchContext) -> None:
    elementwise.launch_gelu(c.device, c.fn("gelu"), c.out(), c.inp(0), _elements(c.shape(0)),
                            stream=c.stream, exact=bool(c.node.attributes.get("exact", False)))


def _launch_attention_prefill_cached(c: LaunchContext) -> None:
    """A prefill chunk against the fp16 KV cache: query t sees cache rows [0, start + t], at
    most start + chunk_len of them (inputs: q, k cache, v cache, start, chunk_len). f32 q and
    out: the head dims the flash kernels do not take."""
    a = c.node.attributes
    tokens, width = c.shape(0)
    kv_width = int(a["kv_heads"]) * int(a["head_dim"])
    attention.launch_attention_prefill_kv16(
        c.device, c.fn("attention_prefill_kv16"), c.out(), c.inp(0), c.inp(1), c.inp(2),
        c.inp(4), c.inp(3), 1, tokens, int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]), width,
        kv_width, int(a["max_context"]) * kv_width, causal=True, stream=c.stream)


def _launch_flash_attention_prefill_cached(c: LaunchContext) -> None:
    """attention_prefill_cached on tensor cores: fp16 q (the to_f16 of the rotated q), the fp16
    KV cache, fp16 out (same inputs: q, k cache, v cache, start, chunk_len)."""
    a = c.node.attributes
    tokens, width = c.shape(0)
    kv_width = int(a["kv_heads"]) * int(a["head_dim"])
    flash_attention.launch_flash_attention_prefill(
        c.device, c.fn("flash_attention_prefill"), c.out(), c.inp(0), c.inp(1), c.inp(2),
        c.inp(4), c.inp(3), 1, tokens, int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]),
        width, kv_width, int(a["max_context"]) * kv_width, causal=True, stream=c.stream)


def _flash_decode_splits(node: Node) -> int:
    """Split count of the flash decode: a function of max_context alone, so the captured decode
    graph (which bakes the grid and the workspace) stays valid as the cache grows."""
    a = node.attributes
    return flash_attention.flash_decode_splits(int(a["max_context"]), 1, int(a["heads"]),
                                               int(a["kv_heads"]))


def _flash_decode_workspace(node: Node, graph: Graph) -> dict[str, int]:
    a = node.attributes
    return {"splits": flash_attention.flash_decode_workspace_bytes(
        batch=1, heads=int(a["heads"]), head_dim=int(a["head_dim"]),
        splits=_flash_decode_splits(node))}


def _launch_flash_attention_decode(c: LaunchContext) -> None:
    a = c.node.attributes
    width = c.shape(0)[1]
    kv_width = int(a["kv_heads"]) * int(a["head_dim"])
    max_len = int(a["max_context"])
    # keys [0, start + 1): the length lives in device memory, so the graph does not depend on it
    flash_attention.launch_flash_attention_decode(
        c.device, c.fn("flash_attention_decode_split"), c.fn("flash_attention_combine"), c.out(),
        c.variant.workspace_ptr("splits"), c.inp(0), c.inp(1), c.inp(2), c.inp(3), 1,
        int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]), width, kv_width,
        max_len * kv_width, 1, max_len, _flash_decode_splits(c.node), stream=c.stream)


def _launch_attention_bidirectional(c: LaunchContext) -> None:
    """Inputs q, k, v and optionally lengths (batch,) i32: row b's queries see keys
    [0, lengths[b]) (the encoder's padding mask), else all `seq`."""
    a = c.node.attributes
    batch, seq, width = int(a["batch"]), int(a["seq"]), c.shape(0)[1]
    lens = c.inp(3) if len(c.node.inputs) > 3 else 0
    attention.launch_attention_prefill(
        c.device, c.fn("attention_prefill"), c.out(), c.inp(0), c.inp(1), c.inp(2), lens, 0, batch,
        seq, int(a["heads"]), int(a["heads"]), int(a["head_dim"]), width, width, seq * width,
        causal=False, stream=c.stream)


def _launch_attention_decode(c: LaunchContext) -> None:
    a = c.node.attributes
    width = c.shape(0)[1]
    kv_width = int(a["kv_heads"]) * int(a["head_dim"])
    max_len = int(a["max_context"])
    # keys [0, start + 1): the length lives in device memory, so the graph does not depend on it
    attention.launch_attention_decode_kv16(
        c.device, c.fn("attention_decode_kv16"), c.out(), c.inp(0), c.inp(1), c.inp(2), c.inp(3), 1,
        int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]), width, kv_width,
        max_len * kv_width, 1, max_len, stream=c.stream)


def _launch_kv_append(c: LaunchContext) -> None:
    a = c.node.attributes
    tokens, kv_width = c.shape(0)
    max_len = int(a["max_context"])
    attention.launch_kv_append_kv16(
        c.device, c.fn("kv_append_kv16"), c.out(0), c.out(1), c.inp(0), c.inp(1), c.inp(2), 1, tokens,
        int(a["kv_heads"]), int(a["head_dim"]), kv_width, kv_width, max_len * kv_width, 0, max_len,
        stream=c.stream)


def _launch_argmax(c: LaunchContext) -> None:
    rows, cols = c.shape(0)
    reduce.launch_argmax(c.device, c.fn("argmax"), c.out(), c.inp(0), rows, cols, stream=c.stream)


def _launch_mean_pool(c: LaunchContext) -> None:
    """Inputs x and optionally lengths (batch,) i32: the mean over row b's first lengths[b]."""
    a = c.node.attributes
    lens = c.inp(1) if len(c.node.inputs) > 1 else 0
    reduce.launch_mean_pool(c.device, c.fn("mean_pool"), c.out(), c.inp(0), lens, int(a["batch"]),
                            int(a["seq"]), c.shape(0)[1], stream=c.stream)


def _launch_rotary_rows(c: LaunchContext) -> None:
    a = c.node.attributes
    rows, width = c.shape(0)
    rotary.launch_rotary_rows(c.device, c.fn("rotary_rows"), c.inp(0), c.inp(1), rows,
                              int(a["heads"]), int(a["head_dim"]), width, float(a["theta"]),
                              stream=c.stream, inv_freq=c.weight(0) if c.node.weights else 0)


def _qkv_weights(c: LaunchContext) -> tuple[int, int]:
    """(bias, inv_freq) pointers of a qkv_rope node (0: none): weights (bias?, inv_freq?)."""
    a, i = c.node.attributes, 0
    bias = table = 0
    if a.get("bias"):
        bias, i = c.weight(0), 1
    if len(c.node.weights) > i:
        table = c.weight(i)
    return bias, table


def _launch_qkv_rope_append(c: LaunchContext) -> None:
    """inputs (qkv, start), outputs (q, k cache, v cache): one sequence's contiguous cache."""
    a = c.node.attributes
    bias, table = _qkv_weights(c)
    qkv.launch_qkv_rope_append(
        c.device, c.fn("qkv_rope_append"), c.out(0), c.out(1), c.out(2), c.inp(0), bias,
        c.inp(1), c.shape(0)[0], int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]),
        float(a["theta"]), int(a["max_context"]), q_half=_out_f16(c), stream=c.stream,
        inv_freq=table)


def _launch_qkv_rope_append_paged(c: LaunchContext) -> None:
    """inputs (qkv, positions, table), outputs (q16, pool)."""
    g = _paged(c.node.attributes)
    bias, table = _qkv_weights(c)
    qkv.launch_qkv_rope_append_paged(
        c.device, c.fn("qkv_rope_append_paged"), c.out(0), c.out(1), c.inp(0), bias, c.inp(1),
        c.inp(2), c.shape(0)[0], c.shape(2)[0], int(c.node.attributes["heads"]), g["kv_heads"],
        g["head_dim"], float(c.node.attributes["theta"]), g["layer"], g["layers"],
        g["block_tokens"], g["max_blocks"], stream=c.stream, inv_freq=table)


def _paged(a) -> dict[str, int]:
    """The paged kernels' pool geometry from a node's attrs (the i13 contract's names)."""
    return {k: int(a[k]) for k in ("layer", "layers", "block_tokens", "kv_heads", "head_dim",
                                   "max_blocks")}


def _launch_kv_append_paged(c: LaunchContext) -> None:
    g = _paged(c.node.attributes)
    rows = c.shape(0)[0]
    paged_attention.launch_kv_append_paged(
        c.device, c.fn("kv_append_paged"), c.out(0), c.inp(0), c.inp(1), c.inp(2), c.inp(3), rows,
        c.shape(3)[0], g["layer"], g["layers"], g["block_tokens"], g["kv_heads"], g["head_dim"],
        g["max_blocks"], stream=c.stream)


def _paged_decode_span(node: Node, graph: Graph) -> int:
    """Keys per split: a function of the graph's shapes only (batch, heads, table), so captured
    graphs stay valid; the kernels split each row by its actual length."""
    a = node.attributes
    return paged_attention.paged_decode_span(int(a["max_blocks"]), int(a["block_tokens"]),
                                             graph.tensors[node.inputs[0]].shape[0],
                                             int(a["heads"]), int(a["kv_heads"]))


def _paged_decode_splits(node: Node, graph: Graph) -> int:
    a = node.attributes
    return paged_attention.paged_decode_splits(int(a["max_blocks"]), int(a["block_tokens"]),
                                               _paged_decode_span(node, graph))


def _paged_decode_workspace(node: Node, graph: Graph) -> dict[str, int]:
    """The split kernel's slots, and where the batch is small enough for the cluster decode on
    any device, its parts' slots and counters (zeroed when allocated: KernelCache's zero)."""
    a = node.attributes
    batch, heads, kv_heads = graph.tensors[node.inputs[0]].shape[0], int(a["heads"]), int(a["kv_heads"])
    return {"splits": paged_attention.paged_decode_workspace_bytes(
                batch=batch, heads=heads, head_dim=int(a["head_dim"]),
                splits=_paged_decode_splits(node, graph)),
            "cluster": paged_attention.cluster_decode_workspace_bytes(
                batch=batch, heads=heads, kv_heads=kv_heads)
            if paged_attention.cluster_decode_may_run(batch, heads, kv_heads) else 0}


def _launch_flash_decode_paged(c: LaunchContext) -> None:
    g = _paged(c.node.attributes)
    batch = c.shape(0)[0]
    paged_attention.launch_flash_decode_paged(
        c.device, c.fn("flash_decode_split_paged"), c.fn("flash_combine_paged"), c.out(),
        c.variant.workspace_ptr("splits"), c.inp(0), c.inp(1), c.inp(2), c.inp(3), batch,
        int(c.node.attributes["heads"]), g["kv_heads"], g["head_dim"], g["layer"], g["layers"],
        g["block_tokens"], g["max_blocks"],
        span=_paged_decode_span(c.node, c.graph), stream=c.stream,
        cluster_function=c.fn("flash_decode_paged_cluster"),
        cluster_workspace=c.variant.workspace_ptr("cluster"), pool_blocks=c.shape(1)[0])


def _launch_flash_prefill_paged(c: LaunchContext) -> None:
    g = _paged(c.node.attributes)
    paged_attention.launch_flash_prefill_paged(
        c.device, c.fn("flash_prefill_paged"), c.out(), c.inp(0), c.inp(1), c.inp(2), c.inp(3),
        c.inp(4), c.shape(0)[0], int(c.node.attributes["heads"]), g["kv_heads"], g["head_dim"],
        g["layer"], g["layers"], g["block_tokens"], g["max_blocks"], stream=c.stream)


def _launch_sample(c: LaunchContext) -> None:
    rows, vocab = c.shape(0)
    sampling.launch_sample(c.device, c.fn("sample"), c.out(), c.inp(0), c.inp(1), c.inp(2),
                           c.inp(3), c.inp(4), c.inp(5), rows, vocab, stream=c.stream)


OPS: dict[str, OpBinding] = {
    "linear_int4": OpBinding((half.INT4_DEQUANT_F16, half.INT4_DEQUANT_F16_TILED,
                              linear.INT4_MATMUL, *int4_batched.MMA_KERNELS.values(),
                              *int4_batched.MMA_KERNELS_TILED.values()),
                             _launch_linear,
                             gemms=_linear_gemms, accumulate=True),
    "linear_f16": OpBinding((), _launch_linear_f16, gemms=_f16_gemms, accumulate=True),
    "to_f16": OpBinding((half.TO_F16,), _launch_to_f16),
    "embedding": OpBinding((embedding.EMBEDDING_GATHER,), _launch_embedding),
    "rmsnorm": OpBinding((norm.RMSNORM, norm.RMSNORM_F16), _launch_rmsnorm),
    "layernorm": OpBinding((norm.LAYERNORM,), _launch_layernorm),
    "rotary": OpBinding((rotary.ROTARY,), _launch_rotary),
    "add": OpBinding((elementwise.ADD,), _launch_add),
    "bias_add": OpBinding((elementwise.BIAS_ADD,), _launch_bias_add),
    "silu_mul": OpBinding((elementwise.SILU_GATE, elementwise.SILU_GATE_F16), _launch_silu_mul),
    "gelu": OpBinding((elementwise.GELU,), _launch_gelu),
    "attention_prefill_cached": OpBinding((attention.ATTENTION_PREFILL_KV16,),
                                          _launch_attention_prefill_cached),
    "flash_attention_prefill_cached": OpBinding((flash_attention.FLASH_ATTENTION_PREFILL,),
                                                _launch_flash_attention_prefill_cached),
    "flash_attention_decode": OpBinding((flash_attention.FLASH_ATTENTION_DECODE_SPLIT,
                                         flash_attention.FLASH_ATTENTION_COMBINE),
                                        _launch_flash_attention_decode,
                                        workspace=_flash_decode_workspace),
    "attention_bidirectional": OpBinding((attention.ATTENTION_PREFILL,),
                                         _launch_attention_bidirectional),
    "attention_decode": OpBinding((attention.ATTENTION_DECODE_KV16,), _launch_attention_decode),
    "kv_append": OpBinding((attention.KV_APPEND_KV16,), _launch_kv_append),
    "argmax": OpBinding((reduce.ARGMAX,), _launch_argmax),
    "mean_pool": OpBinding((reduce.MEAN_POOL,), _launch_mean_pool),
    # continuous batching over the paged KV pool (the issue-13 contract)
    "rotary_rows": OpBinding((rotary.ROTARY_ROWS,), _launch_rotary_rows),
    "kv_append_paged": OpBinding((paged_attention.KV_APPEND_PAGED,), _launch_kv_append_paged),
    "flash_attention_decode_paged": OpBinding((paged_attention.FLASH_DECODE_SPLIT_PAGED,
                                               paged_attention.FLASH_COMBINE_PAGED,
                                               paged_attention.FLASH_DECODE_PAGED_CLUSTER),
                                              _launch_flash_decode_paged,
                                              workspace=_paged_decode_workspace),
    "flash_attention_prefill_paged": OpBinding((paged_attention.FLASH_PREFILL_PAGED,),
                                               _launch_flash_prefill_paged),
    "sample": OpBinding((sampling.SAMPLE,), _launch_sample),
    # the fused QKV linear's epilogue (bias, rotary, KV append, q cast: gpu_worker.kernels.qkv)
    "qkv_rope_append": OpBinding((qkv.QKV_ROPE_APPEND,), _launch_qkv_rope_append),
    "qkv_rope_append_paged": OpBinding((qkv.QKV_ROPE_APPEND_PAGED,),
                                       _launch_qkv_rope_append_paged),
}
