"""Graph op -> kernel library bindings: which kernels a node needs, the workspaces a variant owns
for the node's shapes, and how to launch it.

The int4 linear picks its path per variant: the fused int4 kernel (no workspace) for few rows or
when the dequantized weight would exceed `DEQUANT_WORKSPACE_LIMIT`, else dequantize into a
per-variant workspace (booked in the `workspace` zone) and run the tiled matmul. The limit keeps
one variant's scratch at the 64 MiB per matmul of DESIGN 1.2; a 14336 x 4096 MLP weight would
otherwise need 224 MiB of scratch per variant, per node.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.graph import Graph, Node
from gpu_worker.kernels import attention, elementwise, embedding, linear, norm, reduce, rotary
from services.common.config import env_int

DEQUANT_WORKSPACE_LIMIT = env_int("GPUPLANE_DEQUANT_WORKSPACE_LIMIT", 64 << 20)


@dataclass
class LaunchContext:
    device: object
    node: Node
    graph: Graph
    variant: object           # KernelVariant: .function (dict name -> fn), .workspace_ptr(name)
    ptr: Callable[[str], int]
    stream: object

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


@dataclass(frozen=True)
class OpBinding:
    kernels: tuple                                       # KernelDefs the op launches
    launch: Callable[[LaunchContext], None]
    workspace: Callable[[Node, Graph], dict[str, int]] = lambda node, graph: {}


def _linear_path(node: Node, graph: Graph) -> str:
    m, k = graph.tensors[node.inputs[0]].shape
    n = graph.tensors[node.outputs[0]].shape[1]
    if linear.int4_path(m) == "fused" or linear.INT4_DEQUANT.workspace_bytes(n=n, k=k) > DEQUANT_WORKSPACE_LIMIT:
        return "fused"
    return "dequant"


def _linear_workspace(node: Node, graph: Graph) -> dict[str, int]:
    if _linear_path(node, graph) == "fused":
        return {}
    k = graph.tensors[node.inputs[0]].shape[1]
    n = graph.tensors[node.outputs[0]].shape[1]
    return {"dequant": linear.INT4_DEQUANT.workspace_bytes(n=n, k=k)}


def _launch_linear(c: LaunchContext) -> None:
    m, k = c.shape(0)
    n = c.graph.tensors[c.node.outputs[0]].shape[1]
    if _linear_path(c.node, c.graph) == "fused":
        linear.launch_int4_matmul(c.device, c.fn("int4_matmul"), c.out(), c.inp(0), c.weight(0),
                                  c.weight(1), 0, m, n, k, stream=c.stream)
        return
    ws = c.variant.workspace_ptr("dequant")
    linear.launch_int4_dequant(c.device, c.fn("int4_dequant"), ws, c.weight(0), c.weight(1), n, k,
                               stream=c.stream)
    linear.launch_matmul_nt(c.device, c.fn("matmul_nt"), c.out(), c.inp(0), ws, 0, m, n, k,
                            stream=c.stream)


def _launch_embedding(c: LaunchContext) -> None:
    vocab, hidden = c.graph.tensors[c.node.weights[0]].shape
    embedding.launch_embedding_gather(c.device, c.fn("embedding_gather"), c.out(), c.weight(0),
                                      c.inp(0), c.shape(0)[0], hidden, vocab, stream=c.stream)


def _launch_rmsnorm(c: LaunchContext) -> None:
    rows, hidden = c.shape(0)
    norm.launch_rmsnorm(c.device, c.fn("rmsnorm"), c.out(), c.inp(0), c.weight(0), rows, hidden,
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
    rows, cols = c.shape(0)
    elementwise.launch_silu_gate(c.device, c.fn("silu_gate"), c.out(), c.inp(0), c.inp(1), rows, cols,
                                 stream=c.stream)


def _launch_gelu(c: LaunchContext) -> None:
    elementwise.launch_gelu(c.device, c.fn("gelu"), c.out(), c.inp(0), _elements(c.shape(0)),
                            stream=c.stream, exact=bool(c.node.attributes.get("exact", False)))


def _launch_attention_prefill(c: LaunchContext) -> None:
    a = c.node.attributes
    tokens, width = c.shape(0)
    kv_width = c.shape(1)[1]
    attention.launch_attention_prefill(
        c.device, c.fn("attention_prefill"), c.out(), c.inp(0), c.inp(1), c.inp(2), 0, 0, 1, tokens,
        int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]), width, kv_width, tokens * kv_width,
        causal=True, stream=c.stream)


def _launch_attention_bidirectional(c: LaunchContext) -> None:
    a = c.node.attributes
    batch, seq, width = int(a["batch"]), int(a["seq"]), c.shape(0)[1]
    attention.launch_attention_prefill(
        c.device, c.fn("attention_prefill"), c.out(), c.inp(0), c.inp(1), c.inp(2), 0, 0, batch, seq,
        int(a["heads"]), int(a["heads"]), int(a["head_dim"]), width, width, seq * width,
        causal=False, stream=c.stream)


def _launch_attention_decode(c: LaunchContext) -> None:
    a = c.node.attributes
    width = c.shape(0)[1]
    kv_width = int(a["kv_heads"]) * int(a["head_dim"])
    max_len = int(a["max_context"])
    # keys [0, start + 1): the length lives in device memory, so the graph does not depend on it
    attention.launch_attention_decode(
        c.device, c.fn("attention_decode"), c.out(), c.inp(0), c.inp(1), c.inp(2), c.inp(3), 1,
        int(a["heads"]), int(a["kv_heads"]), int(a["head_dim"]), width, kv_width,
        max_len * kv_width, 1, max_len, stream=c.stream)


def _launch_kv_append(c: LaunchContext) -> None:
    a = c.node.attributes
    tokens, kv_width = c.shape(0)
    max_len = int(a["max_context"])
    attention.launch_kv_append(
        c.device, c.fn("kv_append"), c.out(0), c.out(1), c.inp(0), c.inp(1), c.inp(2), 1, tokens,
        int(a["kv_heads"]), int(a["head_dim"]), kv_width, kv_width, max_len * kv_width, 0, max_len,
        stream=c.stream)


def _launch_argmax(c: LaunchContext) -> None:
    rows, cols = c.shape(0)
    reduce.launch_argmax(c.device, c.fn("argmax"), c.out(), c.inp(0), rows, cols, stream=c.stream)


def _launch_mean_pool(c: LaunchContext) -> None:
    a = c.node.attributes
    reduce.launch_mean_pool(c.device, c.fn("mean_pool"), c.out(), c.inp(0), 0, int(a["batch"]),
                            int(a["seq"]), c.shape(0)[1], stream=c.stream)


OPS: dict[str, OpBinding] = {
    "linear_int4": OpBinding((linear.INT4_DEQUANT, linear.MATMUL_NT, linear.INT4_MATMUL),
                             _launch_linear, _linear_workspace),
    "embedding": OpBinding((embedding.EMBEDDING_GATHER,), _launch_embedding),
    "rmsnorm": OpBinding((norm.RMSNORM,), _launch_rmsnorm),
    "layernorm": OpBinding((norm.LAYERNORM,), _launch_layernorm),
    "rotary": OpBinding((rotary.ROTARY,), _launch_rotary),
    "add": OpBinding((elementwise.ADD,), _launch_add),
    "bias_add": OpBinding((elementwise.BIAS_ADD,), _launch_bias_add),
    "silu_mul": OpBinding((elementwise.SILU_GATE,), _launch_silu_mul),
    "gelu": OpBinding((elementwise.GELU,), _launch_gelu),
    "attention_prefill": OpBinding((attention.ATTENTION_PREFILL,), _launch_attention_prefill),
    "attention_bidirectional": OpBinding((attention.ATTENTION_PREFILL,),
                                         _launch_attention_bidirectional),
    "attention_decode": OpBinding((attention.ATTENTION_DECODE,), _launch_attention_decode),
    "kv_append": OpBinding((attention.KV_APPEND,), _launch_kv_append),
    "argmax": OpBinding((reduce.ARGMAX,), _launch_argmax),
    "mean_pool": OpBinding((reduce.MEAN_POOL,), _launch_mean_pool),
}
