// gp_int4_wgmma: the int4 linear's contract (int4_batched.py) on Hopper's warpgroup MMA, for up to
// 64 rows of x. sm_90a only (wgmma.mma_async): this module is built for that arch alone.
//
// One CTA is one warpgroup (4 warps, 128 threads) on 64 weight rows and the whole of K. Per
// k-group (128 k) each warp makes the A operand of its 16 weight rows in registers, exactly as
// the mma.sync kernels do (gp_dequant: f16(scale * (nib - 8)), one rounding), and the warpgroup
// issues 8 wgmma.m64n64k16 (4 words of a quant block x 2 k16 chunks) whose B operand, x, is read
// by the tensor cores from shared memory. So where gp_int4_mma spends 8 mma.sync and 20 x
// fragment instructions a warp for every 16 x 16 weight tile at 64 rows, here one wgmma covers
// 64 weight rows x 64 rows of x x 16 k and x needs no per-warp fragment work.
//
// The k permutation is gp_int4_mma's (lane t of a quad owns word t of each 16-byte quant block,
// whose nibbles i and 4 + i form one fp16x2 register), so x is written to shared memory in that
// order: for word j of the block and chunk c, mma-k 2t, 2t + 1 (core matrix 0) hold x at k
// 32t + 8j + 2c + (0, 4) and mma-k 2t + 8, 2t + 9 (core matrix 1) hold 32t + 8j + 2c + (1, 5).
// Shared layout of one k-group's x (16 KiB), the no-swizzle K-major canonical layout: slice
// s = 2j + c of 2 KiB, in it n-octet o (8 rows of x) at 256 o, core matrix q at + 128 q, row r at
// + 16 r, word t at + 4 t; so the descriptor's leading byte offset (K step) is 128 and its stride
// byte offset (N step) 256 (the reading tests/gpu/test_wgmma_sm90a.py established).
//
// Pipeline: x arrives by cp.async in GP_WG_STAGES raw 16 KiB stages (GP_WG_STAGES - 1 k-groups
// ahead; each thread copies, and later permutes, its own 8 chunks, so no barrier sits between a
// copy landing and its permute), is permuted into one of two wgmma buffers while the other's
// wgmmas run, and the weights come straight to registers two k-groups ahead.
//
// Sums: f32 in the tensor cores, over the whole K in one warpgroup (no split), so a row's bits
// do not depend on how many rows share the call; they differ from gp_int4_mma's by f32
// summation order only.
#include "gpuplane_common.cuh"

#define GP_WG_THREADS 128
#define GP_WG_XBUF 16384   // bytes of one k-group's x tile
#ifndef GP_WG_STAGES
#define GP_WG_STAGES 3     // raw x stages (int4_batched.WGMMA_STAGES)
#endif

__device__ __forceinline__ unsigned gp_wg_hsub2(unsigned a, unsigned b) {
    unsigned r;
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ unsigned gp_wg_hmul2(unsigned a, unsigned b) {
    unsigned r;
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(a), "r"(b));
    return r;
}
__device__ __forceinline__ unsigned gp_wg_lop(unsigned w, unsigned mask, unsigned magic) {
    unsigned r;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(w), "r"(mask), "r"(magic));
    return r;
}

// int4_batched.cu's gp_dequant: the A registers of both k16 chunks of word (wg, w8) of rows g and
// g + 8 (scales sg, s8 in both halves); nib - 8 exact through the fp16 magics, then one rounding.
__device__ __forceinline__ void gp_wg_dequant(unsigned (&a)[2][4], unsigned wg, unsigned w8,
                                              unsigned sg, unsigned s8) {
    const unsigned lo = 0x64086408u, hi = 0x54805480u;
    const unsigned lm = 0x000f000fu, lx = 0x64006400u, hm = 0x00f000f0u, hx = 0x54005400u;
    a[0][0] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(wg, lm, lx), lo), sg);
    a[0][1] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(w8, lm, lx), lo), s8);
    a[0][2] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(wg, hm, hx), hi), sg);
    a[0][3] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(w8, hm, hx), hi), s8);
    wg >>= 8;
    w8 >>= 8;
    a[1][0] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(wg, lm, lx), lo), sg);
    a[1][1] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(w8, lm, lx), lo), s8);
    a[1][2] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(wg, hm, hx), hi), sg);
    a[1][3] = gp_wg_hmul2(gp_wg_hsub2(gp_wg_lop(w8, hm, hx), hi), s8);
}

__device__ __forceinline__ unsigned gp_wg_word(uint4 v, int j) {
    return j == 0 ? v.x : j == 1 ? v.y : j == 2 ? v.z : v.w;
}

// d (64 x 64 f32, this thread's 32) += a (64 x 16 fp16, registers) * b (16 x 64, shared, `desc`)
__device__ __forceinline__ void gp_wgmma_64x64(float (&d)[32], const unsigned (&a)[4],
                                               unsigned long long desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
          "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
          "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

// The no-swizzle descriptor of a 2 KiB x slice at shared address `addr`: LBO 128, SBO 256.
__device__ __forceinline__ unsigned long long gp_wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | ((unsigned long long)(128 >> 4) << 16)
           | ((unsigned long long)(256 >> 4) << 32);
}

// This thread's 8 x chunks of k-group kg into raw stage `raw` (shared address), one commit group:
// chunk i = tid + 128 q is row m = i / 16 and the 8 halves at k 8 (i % 16) of the k-group, at
// byte 16 i of the stage (zeros past M). An empty group when kg is past K keeps the count even.
__device__ __forceinline__ void gp_wg_copy_x(unsigned raw, const unsigned short* __restrict__ x,
                                             int tid, int M, int K, int kg, int KG) {
    if (kg < KG) {
#pragma unroll
        for (int q = 0; q < 8; ++q) {
            const int i = tid + GP_WG_THREADS * q, m = i >> 4, ch = i & 15;
            const bool in = m < M;
            const unsigned short* src = x + (in ? (long long)m * K + kg * 128 + 8 * ch : 0);
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n"
                         ::"r"(raw + 16 * i), "l"(src), "r"(in ? 16 : 0) : "memory");
        }
    }
    asm volatile("cp.async.commit_group;\n" ::: "memory");
}

// ... and from the raw stage into the k-group's wgmma tile `buf` in the permuted layout (the
// top note); then the fence that lets the tensor cores (the async proxy) read those stores.
__device__ __forceinline__ void gp_wg_permute_x(unsigned char* buf, const unsigned char* raw, int tid) {
#pragma unroll
    for (int q = 0; q < 8; ++q) {
        const int i = tid + GP_WG_THREADS * q, m = i >> 4, ch = i & 15, t = ch >> 2, j = ch & 3;
        const uint4 v = *reinterpret_cast<const uint4*>(raw + 16 * i);
        const unsigned b0 = __byte_perm(v.x, v.z, 0x5410), b1 = __byte_perm(v.x, v.z, 0x7632);
        const unsigned b2 = __byte_perm(v.y, v.w, 0x5410), b3 = __byte_perm(v.y, v.w, 0x7632);
        unsigned char* row = buf + (m >> 3) * 256 + (m & 7) * 16 + t * 4;
        *reinterpret_cast<unsigned*>(row + (2 * j) * 2048) = b0;
        *reinterpret_cast<unsigned*>(row + (2 * j) * 2048 + 128) = b1;
        *reinterpret_cast<unsigned*>(row + (2 * j + 1) * 2048) = b2;
        *reinterpret_cast<unsigned*>(row + (2 * j + 1) * 2048 + 128) = b3;
    }
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Pin registers across an asynchronous wgmma: the compiler sees the asm read `a` and write `d` at
// issue, not until wgmma.wait_group, so without this it could reuse their registers meanwhile.
__device__ __forceinline__ void gp_wg_keep(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void gp_wg_keep(unsigned (&a)[4][2][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c)
#pragma unroll
            for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[j][c][i])::"memory");
}

struct GpWgSlot {   // lane (g, t)'s quant block 4 kg + t of rows g and g + 8, scales in both halves
    uint4 w[2];
    unsigned s[2];
};

__device__ __forceinline__ void gp_wg_load_w(GpWgSlot& q, const unsigned char* __restrict__ packed,
                                             const unsigned short* __restrict__ sc, const int (&r)[2],
                                             int N, int KB, int kg, int t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        if (r[h] < N) {
            const long long b = (long long)r[h] * KB + kg * 4 + t;
            q.w[h] = __ldg(reinterpret_cast<const uint4*>(packed + b * 16));
            const unsigned s = __ldg(sc + b);
            q.s[h] = s | (s << 16);
        } else {   // rows past N: nibble 8 (weight 0), scale 0
            q.w[h] = make_uint4(0x88888888u, 0x88888888u, 0x88888888u, 0x88888888u);
            q.s[h] = 0u;
        }
    }
}

// grid (ceil(N / 64)), 128 threads, dynamic shared memory (GP_WG_STAGES + 2) x 16 KiB
// (int4_batched.wgmma_shared_bytes); M <= 64, K a multiple of 128 (launch_int4_wgmma).
extern "C" __global__ void __launch_bounds__(GP_WG_THREADS)
gp_int4_wgmma(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
              const unsigned short* __restrict__ scales, const float* __restrict__ bias, int M, int N,
              int K, int accumulate) {
    extern __shared__ __align__(128) unsigned char gp_wg_smem[];
    unsigned char* tiles = gp_wg_smem;                      // 2 wgmma tiles
    unsigned char* raws = gp_wg_smem + 2 * GP_WG_XBUF;      // GP_WG_STAGES raw stages
    const unsigned tiles_at = (unsigned)__cvta_generic_to_shared(tiles);
    const unsigned raws_at = tiles_at + 2 * GP_WG_XBUF;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int KB = K >> 5, KG = K >> 7;
    const int row0 = blockIdx.x * 64 + warp * 16;
    const int rows[2] = {row0 + g, row0 + g + 8};
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;

    GpWgSlot ring[2];
    gp_wg_load_w(ring[0], packed, scales, rows, N, KB, 0, t);
    if (KG > 1) gp_wg_load_w(ring[1], packed, scales, rows, N, KB, 1, t);
#pragma unroll
    for (int st = 0; st < GP_WG_STAGES - 1; ++st)
        gp_wg_copy_x(raws_at + st * GP_WG_XBUF, x, tid, M, K, st, KG);
    asm volatile("cp.async.wait_group %0;\n" ::"n"(GP_WG_STAGES - 2) : "memory");
    gp_wg_permute_x(tiles, raws, tid);
    __syncthreads();

    // One k-group: its wgmmas (A set `cur`, made the step before; x tile kg & 1); while they run,
    // x of kg + STAGES - 1 is copied, ring slot `wkg` (k-group kg's weights, already made into
    // `cur`) refilled with kg + 2, k-group kg + 1's A made into `nxt` from ring slot `wnx`, and
    // its x permuted into the other tile (last read by kg - 1's wgmmas, waited for). The next
    // wgmmas are issued only after this group's wait, so no instruction defines a wgmma input
    // while wgmmas that precede it are in flight (ptxas would serialize them, C7513).
    unsigned a0[4][2][4], a1[4][2][4];
    auto dequant = [&](unsigned (&a)[4][2][4], const GpWgSlot& w) {
#pragma unroll
        for (int j = 0; j < 4; ++j)
            gp_wg_dequant(a[j], gp_wg_word(w.w[0], j), gp_wg_word(w.w[1], j), w.s[0], w.s[1]);
    };
    auto step = [&](GpWgSlot& wkg, const GpWgSlot& wnx, unsigned (&cur)[4][2][4],
                    unsigned (&nxt)[4][2][4], int kg) {
        gp_wg_copy_x(raws_at + ((kg + GP_WG_STAGES - 1) % GP_WG_STAGES) * GP_WG_XBUF, x, tid, M, K,
                     kg + GP_WG_STAGES - 1, KG);
        const unsigned buf = tiles_at + (kg & 1) * GP_WG_XBUF;
        gp_wg_keep(acc);
        gp_wg_keep(cur);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int j = 0; j < 4; ++j)
#pragma unroll
            for (int c = 0; c < 2; ++c) gp_wgmma_64x64(acc, cur[j][c], gp_wg_desc(buf + (2 * j + c) * 2048));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (kg + 2 < KG) gp_wg_load_w(wkg, packed, scales, rows, N, KB, kg + 2, t);
        if (kg + 1 < KG) {
            dequant(nxt, wnx);
            asm volatile("cp.async.wait_group %0;\n" ::"n"(GP_WG_STAGES - 2) : "memory");
            gp_wg_permute_x(tiles + ((kg + 1) & 1) * GP_WG_XBUF,
                            raws + ((kg + 1) % GP_WG_STAGES) * GP_WG_XBUF, tid);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        gp_wg_keep(acc);
        gp_wg_keep(cur);
        __syncthreads();   // every thread's part of tile kg + 1 is stored
    };
    dequant(a0, ring[0]);
    for (int kg = 0; kg < KG; kg += 2) {   // ring slots and A sets by name: no dynamic index
        step(ring[0], ring[1], a0, a1, kg);
        if (kg + 1 < KG) step(ring[1], ring[0], a1, a0, kg + 1);
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");

    // acc[4i + e]: weight row g + 8 (e >> 1) of this warp's 16, row of x 8i + 2t + (e & 1)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + g + 8 * (e >> 1), m = 8 * i + 2 * t + (e & 1);
            if (r >= N || m >= M) continue;
            float v = acc[4 * i + e];
            if (bias) v += bias[r];
            float* yp = y + (long long)m * N + r;
            *yp = accumulate ? *yp + v : v;
        }
}
