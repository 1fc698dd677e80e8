"""Per-row token sampling on the device: greedy, temperature, top-k, top-p, seeded Gumbel-max.

Contract (row r of logits (B, vocab) f32, with its own temperature, top_p, top_k, seed, position):
  position < 0      -> -1 (a padding row of a decode batch).
  temperature <= 0  -> argmax of the logits, lowest index on ties (as the `argmax` kernel).
  otherwise         z = logits / temperature (IEEE division); keep z >= the top_k-th largest z
                    (top_k <= 0 or >= vocab: all; ties at the threshold are all kept); then keep
                    z >= the largest kept value t whose mass sum(exp(z - max z) for kept z >= t)
                    reaches top_p times the kept mass (top_p >= 1: all; the top token always
                    stays; masses in fixed point, floor(exp(z - max z) * 2^32), so sums are
                    exact); pick argmax over kept tokens of z + g, g = -log(-log(u)), lowest index
                    on ties, with u = uniform01(hash(seed, position, token)).
The hash is counter-based (murmur3's 32-bit finaliser chained over seed, position and token), so
a row's choice depends only on its logits, seed and position: reproducible whatever else shares
the batch, and `reference.sample` (the oracle) reproduces it exactly except on float near-ties (the
device's expf / logf differ from NumPy's by an ulp).

Design: one block of 512 threads per row. Both thresholds are found by radix select over the
order-preserving uint32 key of z, one byte per pass from the top (4 passes each): a 256-bucket
histogram in shared memory of counts (top-k) or of fixed-point masses (top-p, 64-bit integer
atomics), so every sum is exact whatever the order: a row's result is deterministic. No sort, no
workspace. Cost at vocab 128256: <= 11 passes over 0.5 MB of L2-resident logits when the row asks
for top-k and top-p; greedy rows take 1 pass, plain temperature 2. (The first version searched
bit by bit, 66 passes: 3.7 ms per call at top-k + top-p on the H200, docs/kernels.md.)
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import KernelDef, cu_source, require, require_sizes

SAMPLE_THREADS = 512

SOURCE = cu_source("gp_sampling", "sampling.cu")


# -- launcher --------------------------------------------------------------------------------
def launch_sample(device, function, out: int, logits: int, positions: int, temperature: int,
                  top_p: int, top_k: int, seed: int, rows: int, vocab: int, stream=None) -> None:
    kernel = "sample"
    require_sizes(kernel, rows=rows, vocab=vocab, items=rows * vocab)
    require(rows < 2**31 and vocab >= 1, f"{kernel}: vocab={vocab} must be >= 1")
    require(all((out, logits, positions, temperature, top_p, top_k, seed)),
            f"{kernel}: every pointer is required")
    if rows == 0:
        return
    device.launch(function, (rows, 1, 1), (SAMPLE_THREADS, 1, 1),
                  [ptr(out), ptr(logits), ptr(positions), ptr(temperature), ptr(top_p),
                   ptr(top_k), ptr(seed), i32(rows), i32(vocab)], stream=stream, pdl=True)


SAMPLE = KernelDef("sample", "gp_sample", SOURCE, reference.sample, launch_sample)

KERNELS = [SAMPLE]
