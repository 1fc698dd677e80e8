"""Activation layout: offsets for every activation of a graph inside one plan arena.

A plan owns one arena allocation; tensors whose lifetimes do not overlap share bytes (greedy
first-fit over live intervals, in node order). Without reuse a prefill of the `large` config at
8192 tokens would need a copy of every layer's intermediates: hundreds of GiB instead of ~1.
Inputs of the graph are laid out too (the caller writes them before each run) and stay live
throughout; outputs, and the source of a `select_row` alias, stay live to the end.
"""
from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.models.graph import Graph

ALIGN = 256


def _round(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


@dataclass(frozen=True)
class Layout:
    offsets: dict[str, int]
    nbytes: int
    inputs_bytes: int = 0   # the graph's inputs occupy [0, inputs_bytes), placed first


def plan_layout(graph: Graph) -> Layout:
    owned = {t.name for t in graph.tensors.values() if t.kind in ("activation", "input")}
    last_use: dict[str, int] = {}
    end = len(graph.nodes)
    for i, node in enumerate(graph.nodes):
        for name in (*node.inputs, *node.outputs):
            if name in owned:
                last_use[name] = i
    for name in owned:
        if graph.tensors[name].kind == "input" or name in graph.outputs:
            last_use[name] = end
    for node in graph.nodes:   # a select_row output aliases a row of its source: keep it alive
        if node.op == "select_row" and node.inputs[0] in owned:
            last_use[node.inputs[0]] = end
    free: list[tuple[int, int]] = []      # (offset, size), sorted by offset
    top = 0
    offsets: dict[str, int] = {}
    live: dict[str, tuple[int, int]] = {}

    def place(name: str) -> None:
        nonlocal top
        size = _round(graph.tensors[name].nbytes)
        for k, (off, sz) in enumerate(free):
            if sz >= size:
                free[k:k + 1] = [(off + size, sz - size)] if sz > size else []
                offsets[name] = off
                live[name] = (off, size)
                return
        offsets[name] = top
        live[name] = (top, size)
        top += size

    def release(name: str) -> None:
        off, size = live.pop(name)
        free.append((off, size))
        free.sort()
        merged: list[tuple[int, int]] = []
        for o, s in free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((o, s))
        free[:] = merged

    for name, spec in graph.tensors.items():
        if spec.kind == "input":
            place(name)
    inputs_bytes = top
    for i, node in enumerate(graph.nodes):
        for name in node.outputs:
            if name in owned and name not in live:
                place(name)
        for name in {*node.inputs, *node.outputs}:
            if name in live and last_use.get(name) == i:
                release(name)
    return Layout(offsets, max(top, ALIGN), inputs_bytes)
