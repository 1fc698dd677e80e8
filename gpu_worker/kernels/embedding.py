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
    MAX_GRID_1D,
    KernelDef,
    make_source,
    require,
    require_sizes,
)

SOURCE = make_source("gp_embedding", r"""
// One block per row (grid-stride over rows); threads stride over the hidden dimension.
extern "C" __global__ void gp_embedding_gather(float* out, const unsigned short* __restrict__ table,
                                               const int* __restrict__ ids, int rows, int hidden,
                                               int vocab, int accumulate) {
    for (int r = blockIdx.x; r < rows; r += gridDim.x) {
        const int id = ids[r];
        const bool valid = id >= 0 && id < vocab;
        const unsigned short* t = table + (size_t)(valid ? id : 0) * hidden;
        float* o = out + (size_t)r * hidden;
        for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
            const float v = valid ? gp_half_to_float(t[c]) : 0.f;
            o[c] = accumulate ? o[c] + v : v;
        }
    }
}
""")


def launch_embedding_gather(device, function, out: int, table: int, ids: int, rows: int,
                            hidden: int, vocab: int, accumulate: bool = False,
                            stream=None) -> None:
    require_sizes("embedding_gather", rows=rows, hidden=hidden, vocab=vocab)
    require(vocab > 0, "embedding_gather: vocab must be positive")
    if rows == 0 or hidden == 0:
        return
    device.launch(function, (min(rows, MAX_GRID_1D), 1, 1), BLOCK,
                  [ptr(out), ptr(table), ptr(ids), i32(rows), i32(hidden), i32(vocab),
                   i32(1 if accumulate else 0)], stream=stream)


EMBEDDING_GATHER = KernelDef("embedding_gather", "gp_embedding_gather", SOURCE,
                             reference.embedding_gather, launch_embedding_gather)

KERNELS = [EMBEDDING_GATHER]
