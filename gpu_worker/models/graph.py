"""Model graphs: named nodes over named tensors, in execution order.

A graph is built per shape plan with concrete shapes; node names are stable across plans so the
per-node kernel cache can key variants on (node name, input shapes). Nodes only name things: the
executor maps `op` to a kernel launcher and tensor names to device pointers.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

DTYPE_BYTES = {"f32": 4, "f16": 2, "i32": 4, "u8": 1}


@dataclass(frozen=True)
class TensorSpec:
    """A tensor the graph produces or consumes. `kind` says who owns its memory:
    "input" (written by the caller before a run), "activation" (the plan's arena),
    "state" (owned by the model, e.g. the KV cache), "weight" (a VMM weight slot)."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "f32"
    kind: str = "activation"

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class Node:
    """One operation: `op` names a kernel family, inputs/outputs name tensors, weights name
    weight keys, attributes are static parameters (eps, head counts, ...)."""

    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attributes: Mapping[str, object] = field(default_factory=dict)
    weights: tuple[str, ...] = ()

    def __hash__(self) -> int:  # attributes is a dict; identity is the stable name
        return hash(self.name)


class GraphError(ValueError):
    """The graph is malformed (unknown tensor, duplicate node, use before definition)."""


@dataclass
class Graph:
    """Nodes in execution order plus the specs of every tensor they touch."""

    nodes: list[Node]
    tensors: dict[str, TensorSpec]
    outputs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Every input is defined before use, every name is known, node names are unique."""
        defined = {t.name for t in self.tensors.values() if t.kind in ("input", "state", "weight")}
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise GraphError(f"duplicate node name {node.name!r}")
            seen.add(node.name)
            for name in (*node.inputs, *node.outputs, *node.weights):
                if name not in self.tensors:
                    raise GraphError(f"node {node.name!r} names unknown tensor {name!r}")
            for name in (*node.inputs, *node.weights):
                if name not in defined:
                    raise GraphError(f"node {node.name!r} reads {name!r} before it is written")
            defined.update(node.outputs)
        for name in self.outputs:
            if name not in defined:
                raise GraphError(f"graph output {name!r} is never written")

    def shapes_of(self, names: Iterable[str]) -> tuple[tuple[int, ...], ...]:
        return tuple(self.tensors[n].shape for n in names)

    def activations(self) -> list[TensorSpec]:
        return [t for t in self.tensors.values() if t.kind == "activation"]

    def activation_bytes(self, align: int = 256) -> int:
        return sum(-(-t.nbytes // align) * align for t in self.activations())


class GraphBuilder:
    """Collects tensor specs and nodes in execution order for the models' graph functions."""

    def __init__(self) -> None:
        self.tensors: dict[str, TensorSpec] = {}
        self.nodes: list[Node] = []

    def tensor(self, name: str, shape: tuple[int, ...], dtype: str = "f32",
               kind: str = "activation") -> str:
        self.tensors[name] = TensorSpec(name, shape, dtype, kind)
        return name

    def weight(self, name: str, shape: tuple[int, ...], dtype: str) -> str:
        return self.tensor(name, shape, dtype, "weight")

    def node(self, name: str, op: str, ins: tuple, outs: tuple, weights: tuple = (),
             **attrs: object) -> None:
        self.nodes.append(Node(name, op, tuple(ins), tuple(outs), attrs, tuple(weights)))

    def linear_input_dtype(self, rows: int, weight_format: str = "int4") -> str:
        """The activation dtype a linear reads as it is (no cast node): fp16, for every weight
        format and row count (every int4 path multiplies fp16 x: reference.int4_matmul). A
        producer that writes either (rmsnorm, silu_mul) writes this one. `rows` stays in the
        signature: the dtype is a property of the linear a graph of `rows` rows runs."""
        del rows, weight_format
        return "f16"

    def residual_linear(self, name: str, x: str, residual: str, rows: int, out_dim: int,
                        in_dim: int, weight_format: str, add_name: str) -> None:
        """residual (rows, out_dim) += x @ W^T, in place: the linear accumulates into the
        residual stream (inputs (x, residual), outputs (residual,), `accumulate`) where its op
        supports it (OpBinding.accumulate), else a linear into `<name>.out` and an in-place `add`
        node `add_name`.

        In place is safe in these graphs: the residual stream is written first by the graph's
        own embedding node, so a whole-graph run (the BLAS warm-up's eager run before capture,
        then the replay) recomputes it from scratch and runs twice to the same bytes, and a
        streamed segment runs exactly once per run (gpu_worker/execution/streaming.py)."""
        from gpu_worker.execution.ops import OPS  # which ops honour `accumulate`

        # an input or state residual would be added to twice by the warm-up run and the replay
        assert self.tensors[residual].kind == "activation", \
            f"{name}: the residual {residual!r} must be an activation the graph writes first"
        op = "linear_f16" if weight_format == "fp16" else "linear_int4"
        out = name + ".out"
        self.linear(name, x, out, rows, out_dim, in_dim, weight_format)
        if not OPS[op].accumulate:
            self.node(add_name, "add", (residual, out), (residual,))
            return
        node = self.nodes.pop()
        assert node.name == name and node.outputs == (out,), node
        del self.tensors[out]
        self.nodes.append(Node(name, node.op, (*node.inputs, residual), (residual,),
                               {**node.attributes, "accumulate": True}, node.weights))

    def linear(self, name: str, x: str, out: str, rows: int, out_dim: int, in_dim: int,
               weight_format: str = "int4") -> None:
        """out (rows, out_dim) = x @ W^T for a weight stored as `weight_format` (ModelConfig)."""
        if weight_format == "fp16":
            self.linear_f16(name, x, out, rows, out_dim, in_dim)
        else:
            self.linear_int4(name, x, out, rows, out_dim, in_dim)

    def linear_f16(self, name: str, x: str, out: str, rows: int, out_dim: int,
                   in_dim: int) -> None:
        """out (rows, out_dim) f32 = x @ W^T with W fp16 as stored (`<name>.h`), on cuBLAS for
        every row count, decode's single row included: no dequantization, so no fused kernel to
        prefer. An f32 x is cast by a `to_f16` node into `<name>.x16` first; fp16 x is read as is."""
        dtype = self.tensors[x].dtype
        if dtype == "f32":
            x16 = self.tensor(name + ".x16", (rows, in_dim), "f16")
            self.node(name + ".cast", "to_f16", (x,), (x16,))
            x = x16
        elif dtype != "f16":
            raise GraphError(f"{name}: a linear reads f32 or f16 activations, not {dtype}")
        self.node(name, "linear_f16", (x,), (self.tensor(out, (rows, out_dim)),),
                  (self.weight(name + ".h", (out_dim, in_dim), "f16"),))

    def linear_int4(self, name: str, x: str, out: str, rows: int, out_dim: int,
                    in_dim: int) -> None:
        """out (rows, out_dim) = x @ W^T with W int4 block-quantized: `.q` nibbles, `.s` scales.

        Every int4 path reads fp16 x (reference.int4_matmul: the GEMV, int4_mma and the prefill's
        dequant tile + cuBLAS share one contract): an f32 x is cast by a `to_f16` node into an fp16
        activation `<name>.x16` first (the layout reuses its bytes once the linear has read it);
        an fp16 x (a norm's, silu_mul's or flash attention's output) is read as it is. Which
        kernel runs is the op's choice from the row count (execution/ops.py, linear.int4_path)."""
        dtype = self.tensors[x].dtype
        if dtype == "f32":
            x16 = self.tensor(name + ".x16", (rows, in_dim), "f16")
            self.node(name + ".cast", "to_f16", (x,), (x16,))
            x = x16
        elif dtype != "f16":
            raise GraphError(f"{name}: a linear reads f32 or f16 activations, not {dtype}")
        self.node(name, "linear_int4", (x,), (self.tensor(out, (rows, out_dim)),),
                  (self.weight(name + ".q", (out_dim, in_dim // 2), "u8"),
                   self.weight(name + ".s", (out_dim, in_dim // 32), "f16")))

    def build(self, outputs: tuple[str, ...]) -> Graph:
        return Graph(self.nodes, self.tensors, outputs=outputs)

