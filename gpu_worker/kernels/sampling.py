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

// A token's top-p mass in fixed point: floor(exp(z - zmax) * 2^32), exact sums in any order.
__device__ __forceinline__ unsigned long long gp_fixed_mass(float z, float zmax) {
    return __float2ull_rz(expf(z - zmax) * 4294967296.0f);
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
    __shared__ unsigned hcount[256];
    __shared__ unsigned long long hmass[258];  // 256 digit buckets, the total, the mass above
    __shared__ unsigned pick[2];
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
    // top-k: the k-th largest key, by radix select (one byte per pass, most significant first).
    unsigned thr = 0u;
    const int k = top_k[r];
    if (k > 0 && k < vocab) {
        unsigned prefix = 0u, mask = 0u;
        int need = k;
        for (int d = 3; d >= 0; --d) {
            for (int b = tid; b < 256; b += blockDim.x) hcount[b] = 0u;
            __syncthreads();
            for (int i = tid; i < vocab; i += blockDim.x) {
                const unsigned key = gp_fkey(x[i] / temp);
                if ((key & mask) == prefix) atomicAdd(&hcount[(key >> (8 * d)) & 255u], 1u);
            }
            __syncthreads();
            if (tid == 0) {
                int above = 0, v = 255;
                for (; v > 0 && above + (int)hcount[v] < need; --v) above += (int)hcount[v];
                pick[0] = (unsigned)v;
                pick[1] = (unsigned)above;
            }
            __syncthreads();
            prefix |= pick[0] << (8 * d);
            mask |= 255u << (8 * d);
            need -= (int)pick[1];
        }
        thr = prefix;
    }
    // top-p: the largest key t whose kept mass reaches top_p of the kept total. Masses are
    // fixed point (floor(e * 2^32), e = exp(z - max z)) so every sum is exact and order-free.
    const float p = top_p[r];
    if (p < 1.f) {
        unsigned long long part = 0ull;
        for (int i = tid; i < vocab; i += blockDim.x) {
            const float z = x[i] / temp;
            if (gp_fkey(z) >= thr) part += gp_fixed_mass(z, zmax);
        }
        if (tid == 0) hmass[256] = 0ull;
        __syncthreads();
        atomicAdd(&hmass[256], part);
        __syncthreads();
        const double target = (double)p * (double)hmass[256];
        unsigned prefix = 0u, mask = 0u;
        unsigned long long above = 0ull;
        for (int d = 3; d >= 0; --d) {
            __syncthreads();
            for (int b = tid; b < 256; b += blockDim.x) hmass[b] = 0ull;
            __syncthreads();
            for (int i = tid; i < vocab; i += blockDim.x) {
                const float z = x[i] / temp;
                const unsigned key = gp_fkey(z);
                if (key >= thr && (key & mask) == prefix)
                    atomicAdd(&hmass[(key >> (8 * d)) & 255u], gp_fixed_mass(z, zmax));
            }
            __syncthreads();
            if (tid == 0) {
                unsigned long long cum = above;
                int v = 255;
                for (; v > 0 && (double)(cum + hmass[v]) < target; --v) cum += hmass[v];
                pick[0] = (unsigned)v;
                hmass[257] = cum;
            }
            __syncthreads();
            prefix |= pick[0] << (8 * d);
            mask |= 255u << (8 * d);
            above = hmass[257];
        }
        thr = prefix > thr ? prefix : thr;
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
                   ptr(top_k), ptr(seed), i32(rows), i32(vocab)], stream=stream)


SAMPLE = KernelDef("sample", "gp_sample", SOURCE, sample, launch_sample)

KERNELS = [SAMPLE]
