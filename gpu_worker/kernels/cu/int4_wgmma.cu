// gp_int4_wgmma: the int4 linear's contract (int4_batched.py) on Hopper's warpgroup MMA, for up to
// 64 rows of x. sm_90a only (wgmma.mma_async): this module is built for that arch alone.
//
// One CTA is GP_WG_GROUPS warpgroups of 128 threads, each on 64 weight rows over the whole of K,
// sharing one x tile per k-group (128 k). Both operands stream through a GP_WG_STAGES-deep
// cp.async pipeline in shared memory, so the bytes in flight cost no registers:
//   x      16 KiB: already in the layout wgmma reads B from (no-swizzle, K-major canonical): the
//          16 k of slice s at 2048 s, n-octet o (8 rows of x) at + 256 o, core matrix q (k 8q..
//          8q + 7 of the slice) at + 128 q, row r at + 16 r. Each 16-byte chunk of an x row (8
//          consecutive k) is one cp.async to its place, so the descriptor's leading byte offset
//          (K step) is 128 and its stride byte offset (N step) 256 (the reading
//          tests/gpu/test_wgmma_sm90a.py established); rows past M are zero-filled.
//   W      GP_WG_GROUPS x 64 rows x 64 bytes: a row's 4 quant blocks of the k-group, as in global.
//   scales GP_WG_GROUPS x 64 rows x 4 fp16.
// Per k-group each warp makes the A operand of its 16 weight rows in registers, in natural k
// order (lane (g, t) takes byte t of each packed word: nibbles k 2t and 2t + 1 of that word's 8,
// as one fp16x2 through the magics 1024 + nib (bits 0-3) and 64 + nib (bits 4-7), minus 1032 /
// 72, times the block's scale: f16(scale * (nib - 8)), the contract's one rounding), then the
// warpgroup issues 8 wgmma.m64n64k16 and waits for them; the GP_WG_GROUPS x CTAs per SM
// warpgroups interleave those chains.
//
// Sums: f32 in the tensor cores over the whole K in one warpgroup (no split), so a row's bits do
// not depend on how many rows share the call; they differ from gp_int4_mma's by f32 summation
// order only.
#include "gpuplane_common.cuh"

#ifndef GP_WG_STAGES
#define GP_WG_STAGES 4     // k-groups in the pipeline (int4_batched.WGMMA_STAGES)
#endif
#ifndef GP_WG_GROUPS
#define GP_WG_GROUPS 2     // warpgroups per CTA (int4_batched.WGMMA_GROUPS)
#endif
#ifndef GP_WG_CTAS
#define GP_WG_CTAS 2       // CTAs per SM the registers are bounded for (int4_batched.WGMMA_CTAS)
#endif
#define GP_WG_THREADS (128 * GP_WG_GROUPS)
#define GP_WG_ROWS (64 * GP_WG_GROUPS)                 // weight rows per CTA
#define GP_WG_X 16384                                  // x bytes of a stage
#define GP_WG_W (GP_WG_ROWS * 64)                      // weight bytes of a stage
#define GP_WG_STAGE (GP_WG_X + GP_WG_W + GP_WG_ROWS * 8)

// One A register: byte t of packed word w (k 2t, 2t + 1 of its 8) as f16(scale * (nib - 8)) x 2.
__device__ __forceinline__ unsigned gp_wg_pair(unsigned w, unsigned sel, unsigned s2) {
    unsigned r, p;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(p) : "r"(w), "r"(0u), "r"(sel));   // byte t -> bytes 0, 2
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(p), "r"(0x00f0000fu), "r"(0x54006400u));
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(r), "r"(0x54806408u));   // (1032, 72)
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(r), "r"(s2));
    return r;
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

// Pin registers across an asynchronous wgmma: the compiler sees the asm read `a` and write `d` at
// issue, not until wgmma.wait_group, so without this it could reuse their registers meanwhile.
__device__ __forceinline__ void gp_wg_keep(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void gp_wg_keep(unsigned (&a)[8][4]) {
#pragma unroll
    for (int s = 0; s < 8; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}

// k-group kg's x, weights and scales of this CTA into the stage at shared address `st`, one commit
// group (an empty one past K keeps the count even).
__device__ __forceinline__ void gp_wg_issue(unsigned st, const unsigned short* __restrict__ x,
                                            const unsigned char* __restrict__ packed,
                                            const unsigned short* __restrict__ sc, int tid, int row0,
                                            int M, int N, int K, int kg, int KG) {
    if (kg < KG) {
        const int KB = K >> 5;
#pragma unroll
        for (int c = tid; c < 64 * 16; c += GP_WG_THREADS) {   // x: row m, 8 k at 8 ch
            const int m = c >> 4, ch = c & 15;
            const bool in = m < M;
            const unsigned dst = st + (ch >> 1) * 2048 + (m >> 3) * 256 + (ch & 1) * 128 + (m & 7) * 16;
            gp_cp16(dst, x + (in ? (long long)m * K + kg * 128 + 8 * ch : 0), in);
        }
#pragma unroll
        for (int c = tid; c < GP_WG_ROWS * 4; c += GP_WG_THREADS) {   // weights: row, quant block
            const int rl = c >> 2, b = c & 3, r = row0 + rl;
            const bool in = r < N;
            gp_cp16(st + GP_WG_X + c * 16, packed + (in ? ((long long)r * KB + kg * 4 + b) * 16 : 0), in);
        }
        for (int rl = tid; rl < GP_WG_ROWS; rl += GP_WG_THREADS) {   // scales: a row's 4
            const int r = row0 + rl;
            const bool in = r < N;
            gp_cp8(st + GP_WG_X + GP_WG_W + rl * 8, sc + (in ? (long long)r * KB + kg * 4 : 0), in);
        }
    }
    gp_cp_commit();
}

// grid (ceil(N / GP_WG_ROWS)), GP_WG_THREADS threads, dynamic shared memory GP_WG_STAGES x
// GP_WG_STAGE (int4_batched.wgmma_shared_bytes); M <= 64, K a multiple of 128 (launch_int4_wgmma).
// Rows past N read zeros: nibble 0 with scale 0, so their products are exactly 0.
extern "C" __global__ void __launch_bounds__(GP_WG_THREADS, GP_WG_CTAS)
gp_int4_wgmma(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
              const unsigned short* __restrict__ scales, const float* __restrict__ bias, int M, int N,
              int K, int accumulate) {
    extern __shared__ __align__(128) unsigned char gp_wg_smem[];
    const unsigned base = (unsigned)__cvta_generic_to_shared(gp_wg_smem);
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int KG = K >> 7;
    const int row0 = blockIdx.x * GP_WG_ROWS;
    const int wr = warp * 16;                       // this warp's first row within the CTA
    const unsigned sel = (unsigned)t | 0x40u | ((unsigned)t << 8) | 0x4000u;   // byte t -> 0 and 2
    float acc[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) acc[i] = 0.f;

#pragma unroll
    for (int i = 0; i < GP_WG_STAGES - 1; ++i)
        gp_wg_issue(base + i * GP_WG_STAGE, x, packed, scales, tid, row0, M, N, K, i, KG);
    for (int kg = 0; kg < KG; ++kg) {
        gp_cp_wait<GP_WG_STAGES - 2>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");   // for the tensor cores
        __syncthreads();   // every thread's copies of kg landed; stage (kg - 1) % S is free
        gp_wg_issue(base + ((kg + GP_WG_STAGES - 1) % GP_WG_STAGES) * GP_WG_STAGE, x, packed, scales,
                    tid, row0, M, N, K, kg + GP_WG_STAGES - 1, KG);
        const unsigned st = base + (kg % GP_WG_STAGES) * GP_WG_STAGE;
        const unsigned char* sp = gp_wg_smem + (kg % GP_WG_STAGES) * GP_WG_STAGE;
        unsigned a[8][4];   // slice s = 2 b + c: quant block b, its k16 chunk c
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            uint4 w[2];
            unsigned s2[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const int rl = wr + g + 8 * h;
                w[h] = *reinterpret_cast<const uint4*>(sp + GP_WG_X + (rl * 4 + b) * 16);
                const unsigned s = *reinterpret_cast<const unsigned short*>(sp + GP_WG_X + GP_WG_W + rl * 8 + b * 2);
                s2[h] = s | (s << 16);
            }
            // chunk 0: words 0 (k 2t, 2t + 1) and 1 (k 8 + 2t ..); chunk 1: words 2 and 3
            a[2 * b][0] = gp_wg_pair(w[0].x, sel, s2[0]);
            a[2 * b][1] = gp_wg_pair(w[1].x, sel, s2[1]);
            a[2 * b][2] = gp_wg_pair(w[0].y, sel, s2[0]);
            a[2 * b][3] = gp_wg_pair(w[1].y, sel, s2[1]);
            a[2 * b + 1][0] = gp_wg_pair(w[0].z, sel, s2[0]);
            a[2 * b + 1][1] = gp_wg_pair(w[1].z, sel, s2[1]);
            a[2 * b + 1][2] = gp_wg_pair(w[0].w, sel, s2[0]);
            a[2 * b + 1][3] = gp_wg_pair(w[1].w, sel, s2[1]);
        }
        gp_wg_keep(acc);
        gp_wg_keep(a);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int s = 0; s < 8; ++s) gp_wgmma_64x64(acc, a[s], gp_wg_desc(st + s * 2048));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        gp_wg_keep(acc);
        gp_wg_keep(a);
    }
    gp_cp_wait<0>();

    // acc[4i + e]: weight row g + 8 (e >> 1) of this warp's 16, row of x 8i + 2t + (e & 1)
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + wr + g + 8 * (e >> 1), m = 8 * i + 2 * t + (e & 1);
            if (r >= N || m >= M) continue;
            float v = acc[4 * i + e];
            if (bias) v += bias[r];
            float* yp = y + (long long)m * N + r;
            *yp = accumulate ? *yp + v : v;
        }
}
