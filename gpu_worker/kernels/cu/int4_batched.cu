#include "int4_mma.cuh"

// The 4 A registers of both k16 chunks of one packed word (8 consecutive k from k0) for rows g
// (word wg, scale sg) and g + 8 (w8, s8), scales fp16 in both halves: chunk 0 = {p0(g), p0(g+8),
// p1(g), p1(g+8)}, chunk 1 = {p2.., p3..}; p_i holds k (k0 + i, k0 + 4 + i) as
// f16(scale * (nib - 8)): nib - 8 exact, then one rounding of the product, as the reference.
// The nibble at bits 0-3 of each half becomes fp16 1024 + nib (magic 0x6400, minus 1032), the
// one at bits 4-7 fp16 64 + nib (magic 0x5400: its mantissa step there is 1/16; minus 72), so
// one shift by 8 per word serves all four pairs.
__device__ __forceinline__ void gp_dequant(unsigned (&a)[2][4], unsigned wg, unsigned w8,
                                           unsigned sg, unsigned s8) {
    const unsigned lo = 0x64086408u, hi = 0x54805480u;  // fp16x2 (1032, 1032), (72, 72)
    const unsigned lm = 0x000f000fu, lx = 0x64006400u, hm = 0x00f000f0u, hx = 0x54005400u;
    a[0][0] = gp_hmul2(gp_hsub2(gp_lop(wg, lm, lx), lo), sg);
    a[0][1] = gp_hmul2(gp_hsub2(gp_lop(w8, lm, lx), lo), s8);
    a[0][2] = gp_hmul2(gp_hsub2(gp_lop(wg, hm, hx), hi), sg);
    a[0][3] = gp_hmul2(gp_hsub2(gp_lop(w8, hm, hx), hi), s8);
    wg >>= 8;
    w8 >>= 8;
    a[1][0] = gp_hmul2(gp_hsub2(gp_lop(wg, lm, lx), lo), sg);
    a[1][1] = gp_hmul2(gp_hsub2(gp_lop(w8, lm, lx), lo), s8);
    a[1][2] = gp_hmul2(gp_hsub2(gp_lop(wg, hm, hx), hi), sg);
    a[1][3] = gp_hmul2(gp_hsub2(gp_lop(w8, hm, hx), hi), s8);
}

// B registers of 8 consecutive fp16 of an x row from k0 (one 16-byte load v): the (k, k + 4)
// pairs, b[i] = (x[k0 + i], x[k0 + 4 + i]), by byte permutes.
__device__ __forceinline__ void gp_xfrag(unsigned (&b)[4], uint4 v) {
    b[0] = __byte_perm(v.x, v.z, 0x5410);
    b[1] = __byte_perm(v.x, v.z, 0x7632);
    b[2] = __byte_perm(v.y, v.w, 0x5410);
    b[3] = __byte_perm(v.y, v.w, 0x7632);
}

// Lane (g, t)'s weights of 16-row tiles mt for k-group kg (4 quant blocks, 128 k): quant block
// 4 kg + t of rows g and g + 8, one 16-byte load each, and its scale in both halves; rows past N
// hold nibble 8 (weight 0) with scale 0.
template <int MT>
__device__ __forceinline__ void gp_load_w(uint4 (&wv)[MT][2], unsigned (&s2)[MT][2],
                                          const unsigned char* __restrict__ packed,
                                          const unsigned short* __restrict__ sc, int row0, int g,
                                          int t, int KB, int N, int kg) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + mt * 16 + g + 8 * h;
            const long long b = (long long)r * KB + kg * 4 + t;
            if (r < N) {
                wv[mt][h] = __ldg(reinterpret_cast<const uint4*>(packed + b * 16));
                const unsigned s = __ldg(sc + b);
                s2[mt][h] = s | (s << 16);
            } else {
                wv[mt][h] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
                s2[mt][h] = 0u;
            }
        }
}

// Lane (g, t)'s x for word j of its quant block in k-group kg, every n-tile: 8 halves at
// k = 128 kg + 32 t + 8 j of row 8 nt + g (zeros past M).
template <int NT>
__device__ __forceinline__ void gp_load_x(uint4 (&xv)[NT], const unsigned short* __restrict__ x,
                                          int g, int t, int M, int K, int kg, int j) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
        const int m = nt * 8 + g;
        xv[nt] = m < M ? __ldg(reinterpret_cast<const uint4*>(x + (long long)m * K + kg * 128 + 32 * t + 8 * j))
                       : make_uint4(0u, 0u, 0u, 0u);
    }
}

__device__ __forceinline__ unsigned gp_word(uint4 v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// The k order inside an mma is a permutation shared by A and B (the scale is applied to A before
// the mma, so any permutation sums the same products): lane t's k16 chunks of step j cover
// k0 = 128 kg + 32 t + 8 j .. k0 + 7, mma-k (2t, 2t + 1, 2t + 8, 2t + 9) = k0 + (0, 4, 1, 5) in
// chunk 0 and k0 + (2, 6, 3, 7) in chunk 1. So a lane loads one whole 16-byte quant block per
// weight row and k-group (a quad reads 64 contiguous bytes of a row), and the next k-group's
// weights (and, for MT * NT <= 8, the next step's x) are in flight while this step multiplies.
template <int MT, int NT>
__device__ __noinline__ void gp_i4mma(float* y, const unsigned short* __restrict__ x,
                                         const unsigned char* __restrict__ packed,
                                         const unsigned short* __restrict__ sc,
                                         const float* __restrict__ bias, int M, int N, int K,
                                         int accumulate, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int KB = K >> 5, KG = K >> 7;  // quant blocks, groups of 4 per row
    const int row0 = blockIdx.x * MT * 16;
    const int g0 = (int)((long long)KG * warp / GP_MMA_WARPS);
    const int g1 = (int)((long long)KG * (warp + 1) / GP_MMA_WARPS);
    // x of the next step in flight too where the registers allow (the accumulators are MT * NT * 4)
    constexpr bool XPF = MT * NT <= 8;
    float acc[MT][NT][4];
#pragma unroll
    for (int i = 0; i < MT; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
    if (g0 < g1) {
        uint4 wc[MT][2], wn[MT][2], xc[NT];
        unsigned sc2[MT][2], sn2[MT][2];
        gp_load_w<MT>(wc, sc2, packed, sc, row0, g, t, KB, N, g0);
        gp_load_x<NT>(xc, x, g, t, M, K, g0, 0);
        for (int kg = g0; kg < g1; ++kg) {
            const bool more = kg + 1 < g1;
            if (more) gp_load_w<MT>(wn, sn2, packed, sc, row0, g, t, KB, N, kg + 1);
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                uint4 xn[NT];
                if (XPF) {
                    if (j < 3) gp_load_x<NT>(xn, x, g, t, M, K, kg, j + 1);
                    else if (more) gp_load_x<NT>(xn, x, g, t, M, K, kg + 1, 0);
                } else if (j > 0) {
                    gp_load_x<NT>(xc, x, g, t, M, K, kg, j);
                }
                unsigned a[MT][2][4];
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
                    gp_dequant(a[mt], gp_word(wc[mt][0], j), gp_word(wc[mt][1], j), sc2[mt][0], sc2[mt][1]);
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) {
                    unsigned b[4];
                    gp_xfrag(b, xc[nt]);
#pragma unroll
                    for (int mt = 0; mt < MT; ++mt) {
                        gp_mma(acc[mt][nt], a[mt][0], b[0], b[1]);
                        gp_mma(acc[mt][nt], a[mt][1], b[2], b[3]);
                    }
                }
                if (XPF && (j < 3 || more)) {
#pragma unroll
                    for (int nt = 0; nt < NT; ++nt) xc[nt] = xn[nt];
                }
            }
            if (!XPF && more) gp_load_x<NT>(xc, x, g, t, M, K, kg + 1, 0);
            if (more) {
#pragma unroll
                for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                    for (int h = 0; h < 2; ++h) { wc[mt][h] = wn[mt][h]; sc2[mt][h] = sn2[mt][h]; }
            }
        }
    }
    // Sum the warps' K slices in warp order (deterministic): red holds the running sum.
    for (int wv = 0; wv < GP_MMA_WARPS - 1; ++wv) {
        if (warp == wv) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt)
#pragma unroll
                for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        float* p = red + ((mt * NT + nt) * 4 + e) * 32 + lane;
                        *p = wv == 0 ? acc[mt][nt][e] : *p + acc[mt][nt][e];
                    }
        }
        __syncthreads();
    }
    if (warp != GP_MMA_WARPS - 1) return;
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int r = row0 + mt * 16 + g + 8 * (e >> 1), m = nt * 8 + 2 * t + (e & 1);
                if (r >= N || m >= M) continue;
                float v = red[((mt * NT + nt) * 4 + e) * 32 + lane] + acc[mt][nt][e];
                if (bias) v += bias[r];
                float* yp = y + (long long)m * N + r;
                *yp = accumulate ? *yp + v : v;
            }
}

// grid (ceil(N / (16 * mt))), 256 threads; NT from M, mt (16-row tiles per warp) from the
// launcher (int4_batched.mma_tiles): fewer rows per block for small N, so every SM gets a block;
// every MT of int4_batched.MT_CHOICES is built (MT * NT <= 16: the reduction buffer).
#define GP_I4MMA(MT_, NT_) gp_i4mma<MT_, NT_>(y, x, packed, scales, bias, M, N, K, accumulate, red)
extern "C" __global__ void __launch_bounds__(256, 1)
gp_int4_mma(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
            const unsigned short* __restrict__ scales, const float* __restrict__ bias, int M, int N,
            int K, int accumulate, int mt) {
    __shared__ float red[16 * 4 * 32];  // MT * NT * 4 * 32 floats: MT * NT <= 16
    if (M <= 8) {
        if (mt == 4) GP_I4MMA(4, 1); else if (mt == 2) GP_I4MMA(2, 1); else GP_I4MMA(1, 1);
    } else if (M <= 16) {
        if (mt == 4) GP_I4MMA(4, 2); else if (mt == 2) GP_I4MMA(2, 2); else GP_I4MMA(1, 2);
    } else if (M <= 32) {
        if (mt == 4) GP_I4MMA(4, 4); else if (mt == 2) GP_I4MMA(2, 4); else GP_I4MMA(1, 4);
    } else {
        if (mt == 2) GP_I4MMA(2, 8); else GP_I4MMA(1, 8);
    }
}

// ---- gp_int4_mma_rows: the same contract for 1..8 rows (one 8-row tile of x) -----------------
// gp_int4_mma's work split at MT = NT = 1 (a block's 8 warps on the same 16 weight rows, each a
// contiguous eighth of K, summed in warp order), so its result is bitwise gp_int4_mma's. What
// changes is how the bytes are kept in flight: gp_int4_mma is one entry for every MT x NT, so
// every launch gets the 250 registers of its largest tile and one block per SM (2 warps per
// scheduler, latency-bound at 1 row: 0.2-0.4 of copy). Here a warp holds only its own tile, the
// registers are bounded for GP_ROW_CTAS blocks per SM, and GP_ROW_DEPTH k-groups of weights
// are in flight per warp (a ring of register slots: slot d is refilled with k-group
// kg + GP_ROW_DEPTH as soon as kg has been multiplied). A long K (int4_batched.row_warps: the
// down projection's 14336) runs 16 warps a block, each a contiguous sixteenth of K, so the
// 256 blocks of a 4096-row linear keep twice the warps in flight; the split, and so a row's
// bits, depends on K only, never on the row count.
#ifndef GP_ROW_DEPTH
#define GP_ROW_DEPTH 2
#endif
#ifndef GP_ROW_CTAS
#define GP_ROW_CTAS 4
#endif
#ifndef GP_ROW16_CTAS
#define GP_ROW16_CTAS 4
#endif
#define GP_ROW_MAX_WARPS 16
// registers a thread for `ctas` blocks of 256 threads per SM, in the allocation's steps of 8
#define GP_ROW_REGS(ctas) ((65536 / (256 * (ctas))) & ~7)
#define GP_ROW_MAXNREG GP_ROW_REGS(GP_ROW_CTAS)
#define GP_ROW16_MAXNREG GP_ROW_REGS(GP_ROW16_CTAS)

struct GpRowSlot {   // lane (g, t)'s quant block 4 kg + t of rows g and g + 8, scales in both halves
    uint4 w[2];
    unsigned s[2];
};

// Lane (g, t)'s offsets at k-group 0, computed once: quant block t of rows g and g + 8 (in
// 16-byte blocks and in scales; NONE past N) and the 8 halves at k 32 t of x row 8 nt + g (in
// 16-byte units; NONE past M). K-group kg is 4 blocks further along a weight row and 16 units
// along x. 32-bit offsets: the launcher bounds N * K / 32 and M * K / 8 below 2^32.
// TILED: packed and scales in the 16-row tile layout (int4_batched.rows_tiled): quant block
// 4 kg + t of tile row 8 h + g sits at (tile * KG + kg) * 64 + 32 h + 4 g + t, so a tile's
// k-group is 1 KiB of weights and 128 bytes of scales in one piece, and each of a warp's 16-byte
// weight loads reads 512 contiguous bytes (row-major: 8 rows x 64 bytes, a row K / 2 apart).
template <int NT, bool TILED = false>
struct GpRowLane {
    static constexpr unsigned KG_STEP = TILED ? 64u : 4u;   // quant blocks to the next k-group
    static constexpr unsigned NONE = 0xffffffffu;
    const uint4* __restrict__ packed;
    const unsigned short* __restrict__ sc;
    const uint4* __restrict__ x;
    unsigned w[2], xo[NT];

    __device__ __forceinline__ GpRowLane(const unsigned char* __restrict__ packed_,
                                         const unsigned short* __restrict__ sc_,
                                         const unsigned short* __restrict__ x_, int row0, int g,
                                         int t, int M, int N, int K)
        : packed(reinterpret_cast<const uint4*>(packed_)), sc(sc_),
          x(reinterpret_cast<const uint4*>(x_)) {
        const unsigned KB = (unsigned)K >> 5;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = row0 + g + 8 * h;
            w[h] = r >= N ? NONE
                   : TILED ? (unsigned)(row0 >> 4) * (KB >> 2) * 64u + 32u * h + 4u * g + t
                           : (unsigned)r * KB + t;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            const int m = nt * 8 + g;
            xo[nt] = m < M ? ((unsigned)m * (unsigned)K >> 3) + 4 * t : NONE;
        }
    }

    // rows past N hold nibble 8 (weight 0) with scale 0
    __device__ __forceinline__ void load(GpRowSlot& q, int kg) const {
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (w[h] != NONE) {
                q.w[h] = __ldg(packed + (w[h] + KG_STEP * kg));
                const unsigned v = __ldg(sc + (w[h] + KG_STEP * kg));
                q.s[h] = v | (v << 16);
            } else {
                q.w[h] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
                q.s[h] = 0u;
            }
        }
    }

    // acc += the 16 x 128 weight tile of slot q times x's k-group kg (rows past M read as zero)
    __device__ __forceinline__ void mma(float (&acc)[NT][4], const GpRowSlot& q, int kg) const {
        uint4 xv[4][NT];
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
                xv[j][nt] = xo[nt] != NONE ? __ldg(x + (xo[nt] + 16 * kg + j))
                                           : make_uint4(0u, 0u, 0u, 0u);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            unsigned a[2][4];
            gp_dequant(a, gp_word(q.w[0], j), gp_word(q.w[1], j), q.s[0], q.s[1]);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                unsigned b[4];
                gp_xfrag(b, xv[j][nt]);
                gp_mma(acc[nt], a[0], b[0], b[1]);
                gp_mma(acc[nt], a[1], b[2], b[3]);
            }
        }
    }
};

// grid (ceil(N / 16)), 8 or 16 warps (blockDim), M <= 8 NT, K a multiple of 128
// (int4_batched.launch_int4_mma_rows).
template <int NT, bool TILED = false>
__device__ __forceinline__ void gp_i4mma_rows(float* y, const unsigned short* __restrict__ x,
                                              const unsigned char* __restrict__ packed,
                                              const unsigned short* __restrict__ sc,
                                              const float* __restrict__ bias, int M, int N, int K,
                                              int accumulate, float (*red)[4 * NT][32]) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int warps = blockDim.x >> 5;
    const int KG = K >> 7;
    const int row0 = blockIdx.x * 16;
    const int g0 = (int)((long long)KG * warp / warps);   // at 8 warps gp_int4_mma's K slices
    const int g1 = (int)((long long)KG * (warp + 1) / warps);
    const GpRowLane<NT, TILED> lane_at(packed, sc, x, row0, g, t, M, N, K);
    float acc[NT][4];
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
    GpRowSlot ring[GP_ROW_DEPTH];
#pragma unroll
    for (int d = 0; d < GP_ROW_DEPTH; ++d)
        if (g0 + d < g1) lane_at.load(ring[d], g0 + d);
    gp_pdl_wait();   // the weights above are in flight; x, y and the next kernel wait for this
    gp_pdl_release();
    for (int kb = g0; kb < g1; kb += GP_ROW_DEPTH) {
#pragma unroll
        for (int d = 0; d < GP_ROW_DEPTH; ++d) {
            const int kg = kb + d;
            if (kg >= g1) break;
            lane_at.mma(acc, ring[d], kg);
            if (kg + GP_ROW_DEPTH < g1) lane_at.load(ring[d], kg + GP_ROW_DEPTH);
        }
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int e = 0; e < 4; ++e) red[warp][nt * 4 + e][lane] = acc[nt][e];
    __syncthreads();
    if (threadIdx.x >= 128 * NT) return;
    // thread (nt, e, lane) sums its output over the warps in warp order, as gp_int4_mma does
    const int c = threadIdx.x >> 5, nt = c >> 2, e = c & 3;
    float v = red[0][c][lane];
    for (int w = 1; w < warps; ++w) v += red[w][c][lane];
    const int r = row0 + g + 8 * (e >> 1), m = nt * 8 + 2 * t + (e & 1);
    if (r >= N || m >= M) return;
    if (bias) v += bias[r];
    float* yp = y + (long long)m * N + r;
    *yp = accumulate ? *yp + v : v;
}

// grid (ceil(N / 16)), 256 or 512 threads, K a multiple of 128 (int4_batched.launch_int4_mma_rows):
// gp_int4_mma_rows for M <= 8, gp_int4_mma_rows16 for M <= 16 (each its own registers, bounded
// for GP_ROW_CTAS / GP_ROW16_CTAS blocks of 256 threads per SM).
extern "C" __global__ void __maxnreg__(GP_ROW_MAXNREG)
gp_int4_mma_rows(float* y, const unsigned short* __restrict__ x,
                 const unsigned char* __restrict__ packed, const unsigned short* __restrict__ sc,
                 const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ float red[GP_ROW_MAX_WARPS][4][32];
    gp_i4mma_rows<1>(y, x, packed, sc, bias, M, N, K, accumulate, red);
}
extern "C" __global__ void __maxnreg__(GP_ROW16_MAXNREG)
gp_int4_mma_rows16(float* y, const unsigned short* __restrict__ x,
                   const unsigned char* __restrict__ packed, const unsigned short* __restrict__ sc,
                   const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ float red[GP_ROW_MAX_WARPS][8][32];
    gp_i4mma_rows<2>(y, x, packed, sc, bias, M, N, K, accumulate, red);
}
// The same two entries over weights in the 16-row tile layout (int4_batched.rows_tiled): the
// same lanes, loads and sums, so the same bits as the row-major entries on the same weights.
extern "C" __global__ void __maxnreg__(GP_ROW_MAXNREG)
gp_int4_mma_rows_tiled(float* y, const unsigned short* __restrict__ x,
                       const unsigned char* __restrict__ packed,
                       const unsigned short* __restrict__ sc, const float* __restrict__ bias,
                       int M, int N, int K, int accumulate) {
    __shared__ float red[GP_ROW_MAX_WARPS][4][32];
    gp_i4mma_rows<1, true>(y, x, packed, sc, bias, M, N, K, accumulate, red);
}
extern "C" __global__ void __maxnreg__(GP_ROW16_MAXNREG)
gp_int4_mma_rows16_tiled(float* y, const unsigned short* __restrict__ x,
                         const unsigned char* __restrict__ packed,
                         const unsigned short* __restrict__ sc, const float* __restrict__ bias,
                         int M, int N, int K, int accumulate) {
    __shared__ float red[GP_ROW_MAX_WARPS][8][32];
    gp_i4mma_rows<2, true>(y, x, packed, sc, bias, M, N, K, accumulate, red);
}

// ---- gp_int4_mma_rows_async: the rows kernels' K slices and sums, weights by cp.async ---------
// gp_int4_mma_rows keeps GP_ROW_DEPTH k-groups of weights a warp in flight in registers, so its
// bytes in flight are bounded by registers (deeper rings measured slower), and each block is one
// 16-row tile: a block's loads drain at its end and the next block's start cold (3.4 waves at
// gate/up). Here the same warps, K slices, mma order and warp-order sums (so the same bits as
// gp_int4_mma_rows / rows16 at the same warps) take their weights and scales through a
// per-warp ring of GP_RA_STAGES k-groups in shared memory filled by cp.async, and the grid is
// persistent: a block takes tiles blockIdx.x, + gridDim.x, ... and its ring runs on across
// tiles, so the next tile's weights stream while a tile's partials are summed. A warp's ring
// is its own (each lane reads what its quad copied), so a warp waits for its copies alone;
// the block meets once a tile, to sum its warps' partials (double-buffered, one barrier).
// Before gp_pdl_wait the first GP_RA_STAGES - 1 k-groups of weights are in flight: at the
// 8b shapes of wo and QKV that is every weight byte of the call, loaded while the kernel
// before it runs.
#ifndef GP_RA_STAGES
#define GP_RA_STAGES 4
#endif
#ifndef GP_RA_CTAS
#define GP_RA_CTAS 4
#endif
#define GP_RA_MAXNREG GP_ROW_REGS(GP_RA_CTAS)
// one warp's k-group: weights [2 row halves][32 lanes] x 16 bytes (lane (g, t): quant block
// 4 kg + t of row g, then of row g + 8; a half's 512 bytes read conflict-free), then scales
// [16 rows][4 quant blocks] fp16
#define GP_RA_STAGE 1152
#define GP_RA_SCALES 1024

template <int NT>
__device__ __forceinline__ void gp_i4mma_rows_async(float* y, const unsigned short* __restrict__ x,
                                                    const unsigned char* __restrict__ packed,
                                                    const unsigned short* __restrict__ sc,
                                                    const float* __restrict__ bias, int M, int N,
                                                    int K, int accumulate, unsigned char* smem) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    const int warps = blockDim.x >> 5;
    const int KG = K >> 7, KB = K >> 5;
    const int g0 = (int)((long long)KG * warp / warps);   // gp_int4_mma_rows's K slices
    const int g1 = (int)((long long)KG * (warp + 1) / warps);
    const int tiles = (N + 15) >> 4;
    const int mine = (int)blockIdx.x < tiles ? (tiles - 1 - (int)blockIdx.x) / (int)gridDim.x + 1 : 0;
    const int items = mine * (g1 - g0);                   // this warp's k-groups over its tiles
    const unsigned ring = (unsigned)__cvta_generic_to_shared(smem) + warp * (GP_RA_STAGES * GP_RA_STAGE);
    const unsigned char* ringp = smem + warp * (GP_RA_STAGES * GP_RA_STAGE);
    float* red = reinterpret_cast<float*>(smem + warps * (GP_RA_STAGES * GP_RA_STAGE));  // [2][warps][4 NT][32]
    const GpRowLane<NT> lane_at(packed, sc, x, 0, g, t, M, N, K);   // x offsets and the mma

    // The issue cursor: the next item's tile and k-group, its rows' sources (clamped to a valid
    // row; a row past N is zero-filled, and only its own outputs, never stored, read it).
    int issued = 0, it = blockIdx.x, ik = g0, is = 0;
    const unsigned char* wsrc[2];
    bool win[2];
    const unsigned short* ssrc = sc;
    bool sin = false;
    auto aim = [&]() {   // sources for tile `it`, k-group g0
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const int r = it * 16 + g + 8 * h;
            win[h] = r < N;
            wsrc[h] = packed + ((long long)min(r, N - 1) * KB + 4 * g0 + t) * 16;
        }
        const int rs = it * 16 + g + 8 * (t & 1);
        sin = t < 2 && rs < N;
        ssrc = sc + (long long)min(rs, N - 1) * KB + 4 * g0;
    };
    auto issue = [&]() {   // the next item into stage `is`, and one commit group (maybe empty)
        if (issued < items) {
            const unsigned st = ring + is * GP_RA_STAGE;
            const int dk = ik - g0;
#pragma unroll
            for (int h = 0; h < 2; ++h) gp_cp16(st + h * 512 + lane * 16, wsrc[h] + dk * 64, win[h]);
            if (t < 2) gp_cp8(st + GP_RA_SCALES + (g + 8 * t) * 8, ssrc + dk * 4, sin);
            if (++ik == g1) {
                ik = g0;
                it += gridDim.x;
                if (it < tiles) aim();
            }
            is = is + 1 == GP_RA_STAGES ? 0 : is + 1;
        }
        gp_cp_commit();
        ++issued;
    };

    if (items > 0) aim();
#pragma unroll
    for (int s = 0; s < GP_RA_STAGES - 1; ++s) issue();
    gp_pdl_wait();   // the first stages' weights are in flight; x, y and the next kernel wait
    gp_pdl_release();

    int cs = 0, parity = 0;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x, parity ^= 1) {
        float acc[NT][4];
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) acc[nt][0] = acc[nt][1] = acc[nt][2] = acc[nt][3] = 0.f;
        for (int kg = g0; kg < g1; ++kg) {
            gp_cp_wait<GP_RA_STAGES - 2>();   // this lane's copies of the item have landed
            __syncwarp();                     // its quad's too; the stage before it is free
            issue();
            const unsigned char* sp = ringp + cs * GP_RA_STAGE;
            GpRowSlot q;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                q.w[h] = *reinterpret_cast<const uint4*>(sp + h * 512 + lane * 16);
                const unsigned v = *reinterpret_cast<const unsigned short*>(
                    sp + GP_RA_SCALES + (g + 8 * h) * 8 + t * 2);
                q.s[h] = v | (v << 16);
            }
            lane_at.mma(acc, q, kg);
            cs = cs + 1 == GP_RA_STAGES ? 0 : cs + 1;
        }
        float* rb = red + parity * (warps * 4 * NT * 32);
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) rb[(warp * 4 * NT + nt * 4 + e) * 32 + lane] = acc[nt][e];
        // One barrier a tile: the other buffer's readers (the tile before) passed it already.
        __syncthreads();
        if (threadIdx.x < 128 * NT) {
            // thread (nt, e, lane) sums its output over the warps in warp order, as the rows kernels
            const int c = threadIdx.x >> 5, nt = c >> 2, e = c & 3, l = threadIdx.x & 31;
            float v = rb[c * 32 + l];
            for (int w = 1; w < warps; ++w) v += rb[(w * 4 * NT + c) * 32 + l];
            const int r = tile * 16 + (l >> 2) + 8 * (e >> 1), m = nt * 8 + 2 * (l & 3) + (e & 1);
            if (r < N && m < M) {
                if (bias) v += bias[r];
                float* yp = y + (long long)m * N + r;
                *yp = accumulate ? *yp + v : v;
            }
        }
    }
    gp_cp_wait<0>();
}

// grid min(ceil(N / 16), resident blocks) (persistent), 8 or 16 warps, dynamic shared memory
// warps * (GP_RA_STAGES * GP_RA_STAGE + 2 * 4 NT * 32 * 4) (int4_batched.rows_async_shared_bytes),
// K a multiple of 128: gp_int4_mma_rows_async for M <= 8, gp_int4_mma_rows16_async for M <= 16.
extern "C" __global__ void __maxnreg__(GP_RA_MAXNREG)
gp_int4_mma_rows_async(float* y, const unsigned short* __restrict__ x,
                       const unsigned char* __restrict__ packed, const unsigned short* __restrict__ sc,
                       const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    extern __shared__ __align__(16) unsigned char gp_ra_smem[];
    gp_i4mma_rows_async<1>(y, x, packed, sc, bias, M, N, K, accumulate, gp_ra_smem);
}
extern "C" __global__ void __maxnreg__(GP_RA_MAXNREG)
gp_int4_mma_rows16_async(float* y, const unsigned short* __restrict__ x,
                         const unsigned char* __restrict__ packed, const unsigned short* __restrict__ sc,
                         const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    extern __shared__ __align__(16) unsigned char gp_ra_smem[];
    gp_i4mma_rows_async<2>(y, x, packed, sc, bias, M, N, K, accumulate, gp_ra_smem);
}
