#include "gpuplane_common.cuh"
#define GP_SAMPLE_THREADS 512
#define GP_SAMPLE_VEC 8   // float4 loads in flight a thread in the greedy scan

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

// A thread's running argmax over the values it sees in increasing index order: the first
// value always (so a row of NaN or -inf still names a token), then only a strictly larger one.
__device__ __forceinline__ void gp_argmax_take(float v, int i, float& best, int& bi) {
    if (bi == 0x7fffffff || v > best) { best = v; bi = i; }
}

// grid (rows), GP_SAMPLE_THREADS threads: next_token[r] for row r (see sampling.py).
extern "C" __global__ void __launch_bounds__(GP_SAMPLE_THREADS)
gp_sample(int* __restrict__ out, const float* __restrict__ logits, const int* __restrict__ positions,
          const float* __restrict__ temperature, const float* __restrict__ top_p,
          const int* __restrict__ top_k, const int* __restrict__ seed, int rows, int vocab) {
    GP_PDL_ENTRY();
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
        if ((vocab & 3) == 0 && (reinterpret_cast<unsigned long long>(x) & 15) == 0) {
            // GP_SAMPLE_VEC float4 loads in flight a thread (one dependent load per iteration
            // was ~90 us a row of 128256 on the H200); a thread still sees its indices in order
            const float4* x4 = reinterpret_cast<const float4*>(x);
            const int n4 = vocab >> 2, step = GP_SAMPLE_VEC * blockDim.x;
            for (int c0 = tid; c0 < n4; c0 += step) {
                float4 v[GP_SAMPLE_VEC];
#pragma unroll
                for (int j = 0; j < GP_SAMPLE_VEC; ++j) {
                    const int c = c0 + j * blockDim.x;
                    if (c < n4) v[j] = x4[c];
                }
#pragma unroll
                for (int j = 0; j < GP_SAMPLE_VEC; ++j) {
                    const int c = c0 + j * blockDim.x;
                    if (c >= n4) break;
                    gp_argmax_take(v[j].x, 4 * c, best, bi);
                    gp_argmax_take(v[j].y, 4 * c + 1, best, bi);
                    gp_argmax_take(v[j].z, 4 * c + 2, best, bi);
                    gp_argmax_take(v[j].w, 4 * c + 3, best, bi);
                }
            }
        } else {
            for (int i = tid; i < vocab; i += blockDim.x) gp_argmax_take(x[i], i, best, bi);
        }
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
