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
the batch, and `reference.sample` below reproduces it exactly except on float near-ties (the
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

import numpy as np

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels.common import KernelDef, cu_source, require, require_sizes

SAMPLE_THREADS = 512

SOURCE = cu_source("gp_sampling", "sampling.cu")


# -- reference -------------------------------------------------------------------------------
def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def uniform(seed: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """The device's u in (0, 1) for these token indices (float32, exact)."""
    with np.errstate(over="ignore"):
        s = _fmix32(np.array([seed + 0x632BE5AB], np.int64).astype(np.uint32))
        ps = _fmix32(np.array([position], np.int64).astype(np.uint32) * np.uint32(0x85EBCA77) + s)
        h = _fmix32(np.asarray(tokens, np.int64).astype(np.uint32) * np.uint32(0x9E3779B1) + ps)
    return (((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5))
            * np.float32(5.9604644775390625e-8)).astype(np.float32)


def fkey(z: np.ndarray) -> np.ndarray:
    u = np.asarray(z, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def sample_row(x: np.ndarray, position: int, temperature: float, top_p: float, top_k: int,
               seed: int) -> int:
    """One row of `sample` (see the module docstring)."""
    x = np.asarray(x, np.float32)
    vocab = x.shape[0]
    if position < 0:
        return -1
    if not np.float32(temperature) > 0:
        return int(np.argmax(x))
    z = (x / np.float32(temperature)).astype(np.float32)
    keys = fkey(z)
    kmax = int(keys.max())
    thr = 0
    if 0 < top_k < vocab:
        thr = int(np.sort(keys)[vocab - top_k])
    if np.float32(top_p) < 1:
        # fixed-point masses, as the device sums them: floor(exp(z - max z) * 2^32), exact sums
        e = np.exp((z - z.max()).astype(np.float32)).astype(np.float64)
        e = np.where(keys >= thr, np.floor(e * 4294967296.0), 0.0).astype(np.uint64)
        target = float(np.float32(top_p)) * float(e.sum())
        order = np.argsort(-keys.astype(np.int64), kind="stable")
        sk, mass = keys[order], np.cumsum(e[order]).astype(np.float64)
        # mass(t) for t = a key value counts every token with key >= t: the last of its ties.
        last = np.searchsorted(-sk.astype(np.int64), -sk.astype(np.int64), side="right") - 1
        reach = np.flatnonzero(mass[last] >= target)
        t = int(sk[reach[0]]) if reach.size else 0
        thr = max(thr, t)
    thr = min(thr, kmax)
    kept = np.flatnonzero(keys >= thr)
    u = uniform(int(seed), int(position), kept)
    g = (z[kept] - np.log(-np.log(u))).astype(np.float32)
    return int(kept[int(np.argmax(g))])


def sample(logits: np.ndarray, positions: np.ndarray, temperature: np.ndarray, top_p: np.ndarray,
           top_k: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """next_token (B,) int32 for logits (B, vocab) f32 and the per-row parameters."""
    return np.array([sample_row(logits[r], int(positions[r]), float(temperature[r]),
                                float(top_p[r]), int(top_k[r]), int(seed[r]))
                     for r in range(logits.shape[0])], np.int32)


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


SAMPLE = KernelDef("sample", "gp_sample", SOURCE, sample, launch_sample)

KERNELS = [SAMPLE]
