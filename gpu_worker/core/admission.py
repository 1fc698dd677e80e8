"""What a model's load will commit, per zone, computed before any of its weights exist.

Load admission probes the budget owner with these figures before generating or reading a single
weight (a 36 GiB config would otherwise spend a minute and as much host memory only to be refused).
They must be what the load really commits, not the tensors' content bytes: every carve is aligned
(arena.ALIGN) and commits round up to whole granules, plus one granule where a packed run
straddles a boundary. A probe of content bytes passes a model whose commits then fail halfway.
"""
from __future__ import annotations

from gpu_worker.models.configs import ModelConfig


def admission_bytes(cfg: ModelConfig, granule: int) -> int:
    """Committed bytes a model's load asks for: its weights and KV cache, granule-rounded."""
    return sum(admission_by_zone(cfg, granule).values())


def admission_by_zone(cfg: ModelConfig, granule: int) -> dict[str, int]:
    """Committed bytes a model's load asks for, per zone: weights in `weights`, KV in `kv`.

    Per zone because the governor's zone budgets are: booking the KV cache in `weights` made a
    `small` decoder (23.8 MiB of weights, 64 MiB of KV) ask a 40 MiB weights zone for 87.8 MiB."""
    from gpu_worker.device.arena import ALIGN
    from gpu_worker.models.weights import weight_sizes

    def packed(sizes: list[int]) -> int:
        content = sum(-(-n // ALIGN) * ALIGN for n in sizes)
        return -(-content // granule) * granule + granule
    kv: list[int] = []
    if cfg.family == "decoder":
        kv = [cfg.kv_bytes() // (2 * cfg.layers)] * (2 * cfg.layers)  # one K and one V per layer
    return {"weights": packed(weight_sizes(cfg)), "kv": packed(kv) if kv else 0}


def streaming_floor_bytes(cfg: ModelConfig, granule: int) -> int:
    """The smallest weight budget this model can stream through (two neighbouring segments of
    one layer each, or a layer next to the embedding or head), estimated before any weight has
    an address: gpu_worker/execution/streaming.py."""
    from gpu_worker.device.arena import ALIGN
    from gpu_worker.execution.streaming import packed_cost, streaming_floor
    from gpu_worker.models.weights import weight_names, weight_sizes

    size = dict(zip(weight_names(cfg), weight_sizes(cfg)))
    return streaming_floor(list(size), lambda keys: packed_cost((size[k] for k in keys), granule,
                                                                ALIGN))


def weights_to_probe(cfg: ModelConfig, granule: int, budget: int | None, what: str,
                     need: int, source: str = "--weight-budget-bytes") -> int:
    """Committed weight bytes the load probe asks for: all of them (`need`) when they fit the
    effective weight budget (the least of the flag and the governor's weights zone cap), else the
    budget (the model streams); ResourceExhausted naming `source` when it cannot stream."""
    from gpu_worker.execution.streaming import refuse_unstreamable
    if budget is None or need <= budget:
        return need
    refuse_unstreamable(what, streaming_floor_bytes(cfg, granule), budget, source)
    return budget
