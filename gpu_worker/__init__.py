"""The GPU worker: runs model graphs on one GPU with bounded kernel and plan caches.

The public surface, imported on first use (so that `import gpu_worker.core...` never pulls in grpc):

    from gpu_worker import WorkerConfig, WorkerRuntime   # the domain core, no gRPC
    from gpu_worker import WorkerClient                  # a typed client of a running worker

Layout: `edge/` is the gRPC edge (servicer, client, CLI, access roles, metrics), `core/` the domain
core (runtime, loading, admission, reclaim, token streams, stats), `engines/` the batching engines
(decoder scheduler, encoder batcher), `models/`, `execution/`, `kernels/`, `compile/`, `device/` and
`checkpoints/` what the core runs on, `stack/` the whole-stack tools behind `make run`/`make serve`.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__all__ = ["WorkerClient", "WorkerConfig", "WorkerRuntime"]

_WHERE = {"WorkerConfig": "gpu_worker.config", "WorkerRuntime": "gpu_worker.core.runtime",
          "WorkerClient": "gpu_worker.edge.client"}

if TYPE_CHECKING:
    from gpu_worker.config import WorkerConfig
    from gpu_worker.core.runtime import WorkerRuntime
    from gpu_worker.edge.client import WorkerClient


def __getattr__(name: str) -> object:
    if name not in _WHERE:
        raise AttributeError(f"module 'gpu_worker' has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)
