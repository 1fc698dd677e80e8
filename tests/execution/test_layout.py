"""Activation layout: tensors that are live at the same time never share bytes."""
from __future__ import annotations

from gpu_worker.execution.layout import plan_layout
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.decoder import build_decoder_graph
from gpu_worker.models.encoder import build_encoder_graph


def live_intervals(graph):
    owned = {t.name for t in graph.tensors.values() if t.kind in ("activation", "input")}
    first, last = {}, {}
    for i, node in enumerate(graph.nodes):
        for name in (*node.inputs, *node.outputs):
            if name in owned:
                first.setdefault(name, i)
                last[name] = i
    end = len(graph.nodes)
    for name in owned:
        if graph.tensors[name].kind == "input" or name in graph.outputs:
            first[name], last[name] = (-1 if graph.tensors[name].kind == "input" else first[name]), end
    for node in graph.nodes:
        if node.op == "select_row":
            last[node.inputs[0]] = end
    return {n: (first[n], last[n]) for n in owned if n in first}


def check(graph):
    layout = plan_layout(graph)
    spans = live_intervals(graph)
    names = sorted(spans)
    for i, a in enumerate(names):
        a0, a1 = layout.offsets[a], layout.offsets[a] + graph.tensors[a].nbytes
        assert a1 <= layout.nbytes, f"{a} runs past the arena"
        for b in names[i + 1:]:
            if spans[a][1] < spans[b][0] or spans[b][1] < spans[a][0]:
                continue                                     # never live together
            b0, b1 = layout.offsets[b], layout.offsets[b] + graph.tensors[b].nbytes
            assert a1 <= b0 or b1 <= a0, f"live tensors {a} and {b} overlap in the plan arena"
    inputs = [n for n, t in graph.tensors.items() if t.kind == "input"]
    assert max(layout.offsets[n] + graph.tensors[n].nbytes for n in inputs) <= layout.inputs_bytes
    return layout


def test_live_tensors_never_share_bytes_and_memory_is_reused():
    for graph in (build_decoder_graph(CONFIGS["tiny"], 64, "prefill"),
                  build_decoder_graph(CONFIGS["tiny"], 1, "decode"),
                  build_encoder_graph(CONFIGS["tiny-encoder"], 3, 17)):
        layout = check(graph)
        assert layout.nbytes < graph.activation_bytes(), "liveness reuse saved nothing"


def test_large_prefill_arena_stays_near_one_layer_of_intermediates():
    graph = build_decoder_graph(CONFIGS["8b-int4"], 512, "prefill")
    assert plan_layout(graph).nbytes < graph.activation_bytes() / 20, \
        "the 8b prefill arena should hold about one layer's intermediates, not all 32"
