"""Embedding gather: token ids (int32) -> rows of an fp16 table, as float32 activations.

Shapes: out (rows, hidden) f32, table (vocab, hidden) f16, ids (rows,) i32. An id outside
[0, vocab) yields a zero row instead of a read out of bounds. `accumulate` adds to `out`
(position embeddings on top of token embeddings, for the encoder).
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    cu_source,
    max_grid_1d,
    require,
    require_sizes,
)

SOURCE = cu_source("gp_embedding", "embedding.cu")


def launch_embedding_gather(device, function, out: int, table: int, ids: int, rows: int,
                            hidden: int, vocab: int, accumulate: bool = False,
                            stream=None) -> None:
    require_sizes("embedding_gather", rows=rows, hidden=hidden, vocab=vocab)
    require(vocab > 0, "embedding_gather: vocab must be positive")
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, max_grid_1d(device)), 1, 1), BLOCK,
                  [ptr(out), ptr(table), ptr(ids), i32(rows), i32(hidden), i32(vocab),
                   i32(1 if accumulate else 0)], stream=stream, pdl=True)


EMBEDDING_GATHER = KernelDef("embedding_gather", "gp_embedding_gather", SOURCE,
                             reference.embedding_gather, launch_embedding_gather)

KERNELS = [EMBEDDING_GATHER]
