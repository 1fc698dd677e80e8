"""Per-row token sampling on the device: greedy, temperature, top-k, top-p, seeded Gumbel-max.

Contract (row r of logits (B, vocab) f32, with its own temperature, top_p, top_k, seed, position):
  position < 0      -> -1 (a padding row of a decode batch).
  temperature <= 0  -> argmax of the logits, lowest index on ties (as the `argmax` kernel).
  otherwise         z = logits / temperature (IEEE division); keep z >= the top_k-th largest z
                    (top_k <= 0 or >= vocab: all; ties at the threshold are all kept); then keep
                    z >= the largest kept value t whose mass sum(exp(z - max z) for kept z >= t)
                    reaches top_p times the kept mass (top_p >= 1: all; the top token always
                    stays); pick argmax over kept tokens of z + g, g = -log(-log(u)), lowest index
                    on ties, with u = uniform01(hash(seed, position, token)).
The hash is counter-based (murmur3's 32-bit finaliser chained over seed, position and token), so
a row's choice depends only on its logits, seed and position: reproducible whatever else shares
the batch, and `reference.sample` below reproduces it exactly except on float near-ties (the
device sums the top-p mass in another order and its logf differs from NumPy's by an ulp).

Design: one block of 512 threads per row. Both thresholds are found by a 32-step bitwise search
over the order-preserving uint32 key of z (each step one pass over the row and one block
reduction: a count for top-k, an exp-sum for top-p), which needs no sort and no workspace. Block
reductions run in a fixed tree over fixed per-thread strides, so a row's result is deterministic.
Cost at vocab 128256: <= 66 passes over 0.5 MB of L2-resident logits, only when the row asks for
top-k / top-p; greedy rows and plain temperature rows take 1 and 2 passes.
"""
from __future__ import annotations

import numpy as np

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels.common import KernelDef, make_source, require, require_sizes

SAMPLE_THREADS = 512

SOURCE = make_source("gp_sampling", r"""
#define GP_SAMPLE_THREADS 512

__device__ __forceinline__ unsigned gp_fmix32(unsigned h) {
    h ^= h >> 16; h *= 0x85ebca6bu; h ^= h >> 13; h *= 0xc2b2ae35u; h ^= h >> 16;
    return h;
}

// (0, 1): the top 24 bits of the hash, centred in their bucket (exact in float).
__device__ __forceinline__ float gp_uniform(unsigned seed, unsigned position, unsigned token) {
    const unsigned h = gp_fmix32(token * 0x9e3779b1u
                                 + gp_fmix32(position * 0x85ebca77u + gp_fmix32(seed + 0x632be5abu)));
    return ((float)(h >> 8) + 0.5f) * 5.9604644775390625e-8f;
}

// Order-preserving key: a < b as floats iff key(a) < key(b) (no NaN).
__device__ __forceinline__ unsigned gp_fkey(float f) {
    const unsigned u = __float_as_uint(f);
    return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Block argmax: the largest v, lowest index among equals; every thread gets the index.
__device__ __forceinline__ int gp_block_argmax(float v, int idx, float* sv, int* si) {
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, v, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    __syncthreads();
    if (lane == 0) { sv[warp] = v; si[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        v = lane < nwarps ? sv[lane] : -INFINITY;
        idx = lane < nwarps ? si[lane] : 0x7fffffff;
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, v, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > v || (ov == v && oi < idx)) { v = ov; idx = oi; }
        }
        if (lane == 0) si[32] = idx;
    }
    __syncthreads();
    return si[32];
}

// grid (rows), GP_SAMPLE_THREADS threads: next_token[r] for row r (see sampling.py).
extern "C" __global__ void __launch_bounds__(GP_SAMPLE_THREADS)
gp_sample(int* __restrict__ out, const float* __restrict__ logits, const int* __restrict__ positions,
          const float* __restrict__ temperature, const float* __restrict__ top_p,
          const int* __restrict__ top_k, const int* __restrict__ seed, int rows, int vocab) {
    __shared__ float scratch[33];
    __shared__ float sv[32];
    __shared__ int si[33];
    const int r = blockIdx.x, tid = threadIdx.x;
    const int position = positions[r];
    if (position < 0) { if (tid == 0) out[r] = -1; return; }
    const float* x = logits + (long long)r * vocab;
    const float temp = temperature[r];
    if (!(temp > 0.f)) {  // greedy
        float best = -INFINITY; int bi = 0x7fffffff;
        for (int i = tid; i < vocab; i += blockDim.x)
            if (bi == 0x7fffffff || x[i] > best) { best = x[i]; bi = i; }
        const int w = gp_block_argmax(best, bi, sv, si);
        if (tid == 0) out[r] = w;
        return;
    }
    float zmax = -INFINITY;
    for (int i = tid; i < vocab; i += blockDim.x) zmax = fmaxf(zmax, x[i] / temp);
    zmax = gp_block_max(zmax, scratch);
    const unsigned kmax = gp_fkey(zmax);
    // top-k: the largest key t with count(key >= t) >= k, bit by bit from the top.
    unsigned thr = 0u;
    const int k = top_k[r];
    if (k > 0 && k < vocab) {
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned cand = thr | (1u << bit);
            float c = 0.f;
            for (int i = tid; i < vocab; i += blockDim.x) c += gp_fkey(x[i] / temp) >= cand ? 1.f : 0.f;
            if (gp_block_sum(c, scratch) >= (float)k) thr = cand;
        }
    }
    // top-p: the largest key t whose kept mass reaches top_p of the kept total.
    const float p = top_p[r];
    if (p < 1.f) {
        float tot = 0.f;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float z = x[i] / temp;
            tot += gp_fkey(z) >= thr ? expf(z - zmax) : 0.f;
        }
        const float target = p * gp_block_sum(tot, scratch);
        unsigned t = 0u;
        for (int bit = 31; bit >= 0; --bit) {
            const unsigned cand = t | (1u << bit);
            const unsigned lo = cand > thr ? cand : thr;
            float m = 0.f;
            for (int i = tid; i < vocab; i += blockDim.x) {
                const float z = x[i] / temp;
                m += gp_fkey(z) >= lo ? expf(z - zmax) : 0.f;
            }
            if (gp_block_sum(m, scratch) >= target) t = cand;
        }
        thr = t > thr ? t : thr;
    }
    if (thr > kmax) thr = kmax;  // the top token always stays
    const unsigned s = (unsigned)seed[r];
    float best = -INFINITY; int bi = 0x7fffffff;
    for (int i = tid; i < vocab; i += blockDim.x) {
        const float z = x[i] / temp;
        if (gp_fkey(z) < thr) continue;
        const float g = z - logf(-logf(gp_uniform(s, (unsigned)position, (unsigned)i)));
        if (bi == 0x7fffffff || g > best) { best = g; bi = i; }
    }
    const int w = gp_block_argmax(best, bi, sv, si);
    if (tid == 0) out[r] = w;
}
""")


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
        e = np.where(keys >= thr, np.exp((z - z.max()).astype(np.float64)), 0.0)
        target = float(np.float32(top_p)) * e.sum()
        order = np.argsort(-keys.astype(np.int64), kind="stable")
        sk, mass = keys[order], np.cumsum(e[order])
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
                   ptr(top_k), ptr(seed), i32(rows), i32(vocab)], stream=stream)


SAMPLE = KernelDef("sample", "gp_sample", SOURCE, sample, launch_sample)

KERNELS = [SAMPLE]
