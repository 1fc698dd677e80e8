#include "int4_mma.cuh"

// ---- gp_int4_mma_xa: x as the A operand, for 17..64 rows -------------------------------------
// The kernels above put the weight on the mma's 16-row A side and the batch on its 8-row B side,
// so one weight register serves 8 rows of x per mma and its dequantization (4 instructions per
// fp16x2) is paid once per 8 batch rows: at 64 rows, 7.9 instructions per mma, issue-bound. Here
// x is A (16 batch rows, fetched by ldmatrix from a swizzled shared tile in natural k order) and
// the weight is B (8 weight rows x 16 k): one dequantized register serves 16 batch rows per mma
// and MX = ceil(M / 16) mmas. B's k slots of lane (g, t) are (2t, 2t + 1) and (2t + 8, 2t + 9),
// byte t of two consecutive packed words (nibbles = consecutive k, low nibble first): one PRMT
// puts byte t in both halves, one LOP3 makes fp16 (1024 + lo, 1024 + 16 hi), one HFMA2 by
// (1, 1/16) minus (1032, 72) the exact integers nib - 8, one HMUL2 the scale (the contract's
// single rounding). A CTA is 8 warps over weight rows (NT 8-row tiles each) and all MX x tiles
// of one K range; weights, scales and x stream through a GP_XA_STAGES-deep cp.async pipeline
// and K can be split over a cluster (gp_cluster_sum_store).
#ifndef GP_XA_STAGES
#define GP_XA_STAGES 3   // int4_batched.XA_STAGES (int4_batched_bench --xa-sweep builds others)
#endif
// Ablation builds (int4_batched_bench --xa-ablate; timing only: their outputs are wrong, and the
// library never builds them). Each bit of GP_XA_DROP removes one part of the loop's work, so a
// build times what is left: the copies keep their waits and barriers, and a dropped copy is
// issued for the first GP_XA_STAGES k-groups only (later ones reuse what is in shared memory).
#define GP_XA_DROP_W_COPIES 1   // weights and scales: the first stages' copies only
#define GP_XA_DROP_X_COPIES 2   // x: the first stages' copies only
#define GP_XA_DROP_DEQUANT 4    // the packed words go to the mma as they are
#define GP_XA_DROP_PRMT 8       // the dequantize without its PRMT (design amendment 59's floor)
#define GP_XA_DROP_X_LOADS 16   // no ldmatrix: the x fragments are made in registers
#define GP_XA_DROP_W_LOADS 32   // no shared loads of the packed weights
#ifndef GP_XA_DROP
#define GP_XA_DROP 0            // the library's build
#endif
#define GP_XA_DROPS(bit) ((GP_XA_DROP & (bit)) != 0)
#ifndef GP_XA_CTAS
#define GP_XA_CTAS 2     // CTAs per SM the registers are bounded for (int4_batched.XA_CTAS)
#endif

__device__ __forceinline__ unsigned gp_hfma2(unsigned a, unsigned b, unsigned c) {
    unsigned r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;\n" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

// fp16x2 f16(scale * (nib - 8)) of the two nibbles of the byte `sel` puts in bytes 0 and 2 of
// word w (low nibble in the low half); s2: the scale in both halves.
// `k116`: fp16x2 (1, 1/16) in a register (HFMA2 takes one immediate operand; a value the compiler
// cannot prove constant stays in its register instead of being rematerialised before each HFMA2).
__device__ __forceinline__ unsigned gp_dq_byte(unsigned w, unsigned sel, unsigned s2, unsigned k116) {
    const unsigned v = gp_lop(__byte_perm(w, 0u, sel), 0x00f0000fu, 0x64006400u);
    return gp_hmul2(gp_hfma2(v, k116, 0xd480e408u), s2);   // * (1, 1/16) - (1032, 72)
}

__device__ __forceinline__ void gp_ldsm_x4(unsigned (&a)[4], unsigned addr) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3]) : "r"(addr));
}

// One pipeline stage (a k-group of 128 k), byte offsets:
//   W  [BN rows][4 quant blocks] x 16 bytes, block q of row r at slot q ^ ((r >> 1) & 3) (the 8
//      rows g of an n-tile read 8 distinct 16-byte bank groups);
//   S  [BN rows][4] fp16 scales;
//   X  [XR rows][16 chunks of 8 halves], chunk c of row r at c ^ (r & 7) (ldmatrix's 8 rows of
//      one 8x8 matrix hit 8 distinct bank groups); zeros past M.
template <int MX, int NT>
struct GpXa {
    static constexpr int BN = GP_MMA_WARPS * NT * 8;   // weight rows per CTA
    static constexpr int XR = MX * 16;                  // x rows per CTA
    static constexpr int SW = 0, SS = BN * 64, SX = SS + BN * 8;
    static constexpr int STAGE = SX + XR * 256;
    static constexpr int PS = BN + 8;                   // split partials' row stride (floats)
};

// The k-group pipeline both x-as-A kernels run: ST - 1 stages' weights issued before the
// dependent-launch wait (x after it), then per k-group i: wait for this thread's copies of
// stage i, meet the block (everyone's have landed, and buffer (i - 1) % ST is free), issue
// stage i + ST - 1, and `body(i % ST)`; at the end every copy has landed and the block has met
// (the stages may be reused). `issue_x` commits a group each call, stage or not.
template <int ST, class IssueW, class IssueX, class Body>
__device__ __forceinline__ void gp_xa_pipeline(int stages, IssueW issue_w, IssueX issue_x,
                                               Body body) {
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) issue_w(i);
    gp_pdl_wait();   // the first stages' weights are in flight; x, y and the next kernel wait
    gp_pdl_release();
#pragma unroll
    for (int i = 0; i < ST - 1; ++i) issue_x(i);
    for (int i = 0; i < stages; ++i) {
        gp_cp_wait<ST - 2>();   // this thread's copies of stage i have landed
        __syncthreads();        // everyone's have, and buffer (i - 1) % ST is free
        issue_w(i + ST - 1);
        issue_x(i + ST - 1);
        body(i % ST);
    }
    gp_cp_wait<0>();
    __syncthreads();   // every warp is done with the stages: the partials may reuse them
}

// A warp's M x 8 NT accumulator tile to / from shared memory rows of `stride` floats from p:
// acc[mt][nt][e] is x row 16 mt + g + 8 (e >> 1), column 8 nt + 2 t + (e & 1).
template <int MX, int NT>
__device__ __forceinline__ void gp_store_tile(float* p, int stride, const float (&acc)[MX][NT][4],
                                              int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MX; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h)
                *reinterpret_cast<float2*>(p + (mt * 16 + g + 8 * h) * stride + nt * 8 + 2 * t) =
                    make_float2(acc[mt][nt][2 * h], acc[mt][nt][2 * h + 1]);
}
template <int MX, int NT>
__device__ __forceinline__ void gp_add_tile(float (&acc)[MX][NT][4], const float* p, int stride,
                                            int g, int t) {
#pragma unroll
    for (int mt = 0; mt < MX; ++mt)
#pragma unroll
        for (int nt = 0; nt < NT; ++nt)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const float2 v = *reinterpret_cast<const float2*>(
                    p + (mt * 16 + g + 8 * h) * stride + nt * 8 + 2 * t);
                acc[mt][nt][2 * h] += v.x;
                acc[mt][nt][2 * h + 1] += v.y;
            }
}

template <int MX, int NT>
__device__ __forceinline__ void gp_zero(float (&acc)[MX][NT][4]) {
#pragma unroll
    for (int i = 0; i < MX; ++i)
#pragma unroll
        for (int j = 0; j < NT; ++j) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.f;
}

// TILED: packed and scales in the 16-row tile layout (int4_batched.rows_tiled). A thread's copy
// is the same (weight row tid / 4 + 64 j, slot tid & 3: in a 16-row tile's k-group of 64
// quant blocks that is block tid & 63 of tile tid / 64 + 4 j), so only the sources move: each
// warp's copy reads 512 contiguous bytes, and a k-group is 1 KiB further on a tile.
template <int MX, int NT, bool TILED = false>
__device__ __forceinline__ void gp_i4mma_xa(float* y, const unsigned short* __restrict__ x,
                                         const unsigned char* __restrict__ packed,
                                         const unsigned short* __restrict__ sc,
                                         const float* __restrict__ bias, int M, int N, int K,
                                         int accumulate, unsigned char* smem) {
    using L = GpXa<MX, NT>;
    constexpr int THREADS = GP_MMA_WARPS * 32;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int KB = K >> 5, KG = K >> 7;
    const int2 cl = gp_cluster_rank_size();
    const int rank = cl.x, S = cl.y;
    const int row0 = blockIdx.y * L::BN;
    const int g0 = (int)((long long)KG * rank / S), g1 = (int)((long long)KG * (rank + 1) / S);
    const int stages = g1 - g0;
    const unsigned base = (unsigned)__cvta_generic_to_shared(smem);

    // This thread's copies, the same every k-group but for the k offset: weight rows
    // tid / 4 + 64 j at slot tid & 3, x rows tid / 16 + 16 j at chunk tid & 15, the scales of row
    // tid. Sources are clamped to a valid row (a row past N or M is zero-filled, never read), so
    // a copy is one 64-bit add and a cp.async at an immediate shared offset (+ 4096 j).
    constexpr int WJ = L::BN / 64, XJ = L::XR / 16;
    constexpr int WSTEP = TILED ? 1024 : 64, SSTEP = TILED ? 64 : 4;   // to the next k-group
    const unsigned char* wsrc[WJ];
    bool win[WJ];
#pragma unroll
    for (int j = 0; j < WJ; ++j) {
        const int row = row0 + (tid >> 2) + 64 * j;
        win[j] = row < N;
        wsrc[j] = TILED ? packed + ((long long)(min(row, N - 1) >> 4) * KG + g0) * 1024 + (tid & 63) * 16
                        : packed + ((long long)min(row, N - 1) * KB + g0 * 4 + (tid & 3)) * 16;
    }
    const unsigned short* xsrc[XJ];
#pragma unroll
    for (int j = 0; j < XJ; ++j)
        xsrc[j] = x + (long long)min((tid >> 4) + 16 * j, M - 1) * K + g0 * 128 + 8 * (tid & 15);
    const bool sin = tid < L::BN && row0 + tid < N;
    const int srow = min(row0 + min(tid, L::BN - 1), N - 1);   // this thread's scales: row srow's 4
    const unsigned short* ssrc =
        TILED ? sc + ((long long)(srow >> 4) * KG + g0) * 64 + 32 * ((srow >> 3) & 1) + 4 * (srow & 7)
              : sc + (long long)srow * KB + g0 * 4;
    const unsigned wdst = L::SW + (tid >> 2) * 64 + (((tid & 3) ^ ((tid >> 3) & 3)) << 4);
    const unsigned xdst = L::SX + (tid >> 4) * 256 + (((tid & 15) ^ ((tid >> 4) & 7)) << 4);

    // Stage i's weights and scales, then its x and the commit: a stage's group holds both (the
    // first group also the weights of the stages issued ahead of gp_pdl_wait).
    auto issue_w = [&](int i) {
        if (i < stages) {
            const unsigned st = base + (i % GP_XA_STAGES) * L::STAGE;
            if (!GP_XA_DROPS(GP_XA_DROP_W_COPIES) || i < GP_XA_STAGES) {
#pragma unroll
                for (int j = 0; j < WJ; ++j) gp_cp16(st + wdst + 4096 * j, wsrc[j] + i * WSTEP, win[j]);
                if (tid < L::BN) gp_cp8(st + L::SS + tid * 8, ssrc + i * SSTEP, sin);
            }
        }
    };
    auto issue_x = [&](int i) {
        if (i < stages) {
            const unsigned st = base + (i % GP_XA_STAGES) * L::STAGE;
            if (!GP_XA_DROPS(GP_XA_DROP_X_COPIES) || i < GP_XA_STAGES) {
#pragma unroll
                for (int j = 0; j < XJ; ++j)
                    gp_cp16(st + xdst + 4096 * j, xsrc[j] + i * 128, (tid >> 4) + 16 * j < M);
            }
        }
        gp_cp_commit();
    };

    // ldmatrix: lane l gives row lr = (l & 7) + 8 ((l >> 3) & 1) of x tile mt, chunk 2 s + (l >> 4)
    // at (2 s + (l >> 4)) ^ (l & 7): for s = 4 h + q that is 8 h + ((2 q + (l >> 4)) ^ (l & 7)),
    // so four lane offsets (xoff[q]) and immediates (128 h, 4096 mt) address every ldmatrix.
    const int lr = (lane & 7) + ((lane >> 3) & 1) * 8;
    unsigned xoff[4];
#pragma unroll
    for (int q = 0; q < 4; ++q) xoff[q] = L::SX + lr * 256 + (((2 * q + (lane >> 4)) ^ (lane & 7)) << 4);
    const unsigned sel = 0x4040u | ((unsigned)t * 0x0101u);   // byte t -> bytes 0 and 2
    const unsigned k116 = 0x2c003c00u | ((unsigned)K >> 31);   // K >= 0: a register, not an immediate
    const int wrow = warp * NT * 8 + g;                         // this lane's weight row, n-tile 0
    const int wsw = (g >> 1) & 3;                               // its slot swizzle (every n-tile)

    float acc[MX][NT][4];
    gp_zero(acc);
    gp_xa_pipeline<GP_XA_STAGES>(stages, issue_w, issue_x, [&](int b) {
        const unsigned st = base + b * L::STAGE;
        const unsigned char* sp = smem + b * L::STAGE;
        unsigned s2[NT];
#pragma unroll
        for (int s = 0; s < 8; ++s) {          // k16 step s: k 16 s .. 16 s + 15 of the k-group
            unsigned b[NT][2];
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const int r = wrow + nt * 8;
                if ((s & 1) == 0) {
                    const unsigned sv = *reinterpret_cast<const unsigned short*>(sp + L::SS + r * 8 + (s >> 1) * 2);
                    s2[nt] = sv | (sv << 16);
                }
                const uint2 w = GP_XA_DROPS(GP_XA_DROP_W_LOADS)
                    ? make_uint2(r * 0x01010101u + s, s2[nt] + r)
                    : *reinterpret_cast<const uint2*>(sp + L::SW + r * 64 + (((s >> 1) ^ wsw) << 4) + (s & 1) * 8);
                if (GP_XA_DROPS(GP_XA_DROP_DEQUANT)) {
                    b[nt][0] = w.x ^ s2[nt];
                    b[nt][1] = w.y;
                } else if (GP_XA_DROPS(GP_XA_DROP_PRMT)) {
                    b[nt][0] = gp_dq_byte(w.x, 0x3210u, s2[nt], k116);
                    b[nt][1] = gp_dq_byte(w.y, 0x3210u, s2[nt], k116);
                } else {
                    b[nt][0] = gp_dq_byte(w.x, sel, s2[nt], k116);
                    b[nt][1] = gp_dq_byte(w.y, sel, s2[nt], k116);
                }
            }
            const unsigned xs = st + xoff[s & 3];
#pragma unroll
            for (int mt = 0; mt < MX; ++mt) {
                unsigned a[4];
                if (GP_XA_DROPS(GP_XA_DROP_X_LOADS)) {
                    a[0] = xs + mt; a[1] = a[0] ^ 0x3c003c00u; a[2] = a[0] + 7u; a[3] = a[0] ^ 5u;
                } else {
                    gp_ldsm_x4(a, xs + (s >> 2) * 128 + mt * 4096);
                }
#pragma unroll
                for (int nt = 0; nt < NT; ++nt) gp_mma(acc[mt][nt], a, b[nt][0], b[nt][1]);
            }
        }
    });

    // acc[mt][nt][e]: x row 16 mt + g + 8 (e >> 1), weight row 8 nt + 2 t + (e & 1) of the warp's
    if (S == 1) {
#pragma unroll
        for (int mt = 0; mt < MX; ++mt)
#pragma unroll
            for (int nt = 0; nt < NT; ++nt)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int m = mt * 16 + g + 8 * (e >> 1);
                    const int r = row0 + warp * NT * 8 + nt * 8 + 2 * t + (e & 1);
                    if (r >= N || m >= M) continue;
                    float v = acc[mt][nt][e];
                    if (bias) v += bias[r];
                    float* yp = y + (long long)m * N + r;
                    *yp = accumulate ? *yp + v : v;
                }
        return;
    }
    gp_store_tile(reinterpret_cast<float*>(smem) + warp * NT * 8, L::PS, acc, g, t);
    gp_cluster_sum_store(y, bias, M, N, row0, L::BN, L::PS, accumulate, base, rank, S);
}

// grid (S, ceil(N / BN), 1) in clusters of (S, 1, 1) (none when S = 1), 256 threads, dynamic
// shared memory GP_XA_STAGES * GpXa::STAGE (int4_batched.xa_shared_bytes); MX = 1 x tile of 16
// rows up to 16 rows of x, 2 up to 32, 3 up to 48, 4 above (each x tile is 8 more mmas a k16
// step: a batch of 33..48 rows does not pay for 64); nt = NT 8-row weight tiles per warp (2 or 4).
#define GP_I4MMA_XA(MX_, NT_) \
    gp_i4mma_xa<MX_, NT_, TILED>(y, x, packed, scales, bias, M, N, K, accumulate, gp_xa_smem)
template <bool TILED>
__device__ __forceinline__ void gp_i4mma_xa_entry(float* y, const unsigned short* __restrict__ x,
                                                  const unsigned char* __restrict__ packed,
                                                  const unsigned short* __restrict__ scales,
                                                  const float* __restrict__ bias, int M, int N,
                                                  int K, int accumulate, int nt,
                                                  unsigned char* gp_xa_smem) {
    if (M <= 16) {   // 9..16 rows: measured against the rows16 kernel (int4_batched_bench --xa-sweep)
        if (nt == 4) GP_I4MMA_XA(1, 4); else GP_I4MMA_XA(1, 2);
    } else if (M <= 32) {
        if (nt == 4) GP_I4MMA_XA(2, 4); else GP_I4MMA_XA(2, 2);
    } else if (M <= 48) {
        if (nt == 4) GP_I4MMA_XA(3, 4); else GP_I4MMA_XA(3, 2);
    } else {
        if (nt == 4) GP_I4MMA_XA(4, 4); else GP_I4MMA_XA(4, 2);
    }
}
extern "C" __global__ void __launch_bounds__(256, GP_XA_CTAS)
gp_int4_mma_xa(float* y, const unsigned short* __restrict__ x,
               const unsigned char* __restrict__ packed, const unsigned short* __restrict__ scales,
               const float* __restrict__ bias, int M, int N, int K, int accumulate, int nt) {
    extern __shared__ __align__(16) unsigned char gp_xa_smem[];
    gp_i4mma_xa_entry<false>(y, x, packed, scales, bias, M, N, K, accumulate, nt, gp_xa_smem);
}
// The same over weights in the 16-row tile layout (int4_batched.rows_tiled): the same bits.
extern "C" __global__ void __launch_bounds__(256, GP_XA_CTAS)
gp_int4_mma_xa_tiled(float* y, const unsigned short* __restrict__ x,
                     const unsigned char* __restrict__ packed,
                     const unsigned short* __restrict__ scales, const float* __restrict__ bias,
                     int M, int N, int K, int accumulate, int nt) {
    extern __shared__ __align__(16) unsigned char gp_xa_smem[];
    gp_i4mma_xa_entry<true>(y, x, packed, scales, bias, M, N, K, accumulate, nt, gp_xa_smem);
}

// ---- gp_int4_mma_xk: gp_int4_mma_xa's operands with K, too, over a block's warps -------------
// In gp_int4_mma_xa every warp owns NT 8-row weight tiles and multiplies all 8 k16 steps of a
// k-group, so it reads the whole x tile of every stage from shared memory: a block reads x 8
// times a stage (at 64 rows and NT 2, shared-memory traffic of 1.1 KB a weight row a k-group,
// cp.async writes included; `ncu` saw the shared-memory pipe 61 % busy). Here the block's 8
// warps are WN = 8 / WK groups over the weight rows (NT 8-row tiles each) by WK over each
// k-group's k16 steps (warp (wn, wk): steps wk, wk + WK, ...), so x is read WN times a stage,
// not 8: at WK 4 and NT 8 (128 weight rows a block, x read twice) 0.5 KB a weight row; the
// x bytes a block streams from L2 per weight row stay xa's (128 rows a block). Each warp
// accumulates its group's M x 8 NT tile over its k16 steps (NT 8, MX 4: 128 floats, one block
// per SM); at the end the WK warps of a group are summed in a fixed tree through shared
// memory (wk + WK / 2, ..., + 1), then over a cluster's K splits in rank order
// (gp_cluster_sum_store). The order depends on N, K and the build (WK, NT: xk_plan), never on
// M: a row's bits are the same at every row count from 17 to 64. Stage layout, copies,
// swizzles and dequantization are gp_int4_mma_xa's (GpXa, gp_dq_byte).
#ifndef GP_XK_STAGES
#define GP_XK_STAGES 4   // int4_batched.XK_STAGES
#endif

template <int MX, int NT, int WK>
__device__ __forceinline__ void gp_i4mma_xk(float* y, const unsigned short* __restrict__ x,
                                         const unsigned char* __restrict__ packed,
                                         const unsigned short* __restrict__ sc,
                                         const float* __restrict__ bias, int M, int N, int K,
                                         int accumulate, unsigned char* smem) {
    constexpr int WN = GP_MMA_WARPS / WK, STEPS = 8 / WK;   // warp groups over N; k16 steps a warp
    constexpr int BW = NT * 8, BN = WN * BW, XR = MX * 16;   // a group's rows; the block's
    constexpr int SW = 0, SS = BN * 64, SX = SS + BN * 8, STAGE = SX + XR * 256;
    constexpr int PW = BW + 4, PS = BN + 4;   // partial row strides (floats): a warp's, the block's
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int wn = warp / WK, wk = warp % WK;
    const int KB = K >> 5, KG = K >> 7;
    const int2 cl = gp_cluster_rank_size();
    const int rank = cl.x, S = cl.y;
    const int row0 = blockIdx.y * BN;
    const int g0 = (int)((long long)KG * rank / S), g1 = (int)((long long)KG * (rank + 1) / S);
    const int stages = g1 - g0;
    const unsigned base = (unsigned)__cvta_generic_to_shared(smem);

    // This thread's copies, the same every k-group but for the k offset (sources clamped to a
    // valid row; a row past N or M is zero-filled, never read): weight chunk tid + 256 j (row
    // c / 4, slot c & 3), x rows tid / 16 + 16 j at chunk tid & 15, the scales of row tid.
    // Sources are 32-bit offsets from the kernel's pointers (the launcher bounds N * K / 2 and
    // M * K below 2^31).
    constexpr int WJ = (BN * 4 + 255) / 256, XJ = XR / 16, SJ = (BN + 255) / 256;
    unsigned wsrc[WJ], wdst[WJ];
    bool win[WJ], wdo[WJ];
#pragma unroll
    for (int j = 0; j < WJ; ++j) {
        const int c = tid + 256 * j, rl = c >> 2, row = row0 + rl;
        wdo[j] = c < BN * 4;
        win[j] = row < N;
        wsrc[j] = ((unsigned)min(row, N - 1) * (unsigned)KB + g0 * 4 + (c & 3)) * 16u;
        wdst[j] = SW + rl * 64 + (((c & 3) ^ ((rl >> 1) & 3)) << 4);
    }
    // x row tid / 16 + 16 j at chunk tid & 15: one offset, its rows 16 apart (a row past M reads
    // row tid / 16's address, < 16 < M, and is zero-filled)
    const unsigned xsrc = (unsigned)(tid >> 4) * (unsigned)K + g0 * 128 + 8 * (tid & 15);
    const unsigned xdst = SX + (tid >> 4) * 256 + (((tid & 15) ^ ((tid >> 4) & 7)) << 4);

    auto issue_w = [&](int i) {   // stage i's weights and scales
        if (i < stages) {
            const unsigned st = base + (i % GP_XK_STAGES) * STAGE;
#pragma unroll
            for (int j = 0; j < WJ; ++j)
                if (wdo[j]) gp_cp16(st + wdst[j], packed + (wsrc[j] + i * 64u), win[j]);
#pragma unroll
            for (int j = 0; j < SJ; ++j) {
                const int rl = tid + 256 * j;
                if (rl < BN)
                    gp_cp8(st + SS + rl * 8,
                           sc + ((unsigned)min(row0 + rl, N - 1) * (unsigned)KB + (g0 + i) * 4u),
                           row0 + rl < N);
            }
        }
    };
    auto issue_x = [&](int i) {   // stage i's x, and the commit of its group
        if (i < stages) {
            const unsigned st = base + (i % GP_XK_STAGES) * STAGE;
#pragma unroll
            for (int j = 0; j < XJ; ++j) {
                const bool in = (tid >> 4) + 16 * j < M;
                gp_cp16(st + xdst + 4096 * j,
                        x + (xsrc + (in ? 16u * j * (unsigned)K : 0u) + i * 128u), in);
            }
        }
        gp_cp_commit();
    };

    // warp (wn, wk)'s k16 steps s = wk + WK q: ldmatrix lane offsets (gp_int4_mma_xa's at step
    // s), weight slots and scales of row 8 nt + g of its group
    const int lr = (lane & 7) + ((lane >> 3) & 1) * 8;
    const unsigned sel = 0x4040u | ((unsigned)t * 0x0101u);    // byte t -> bytes 0 and 2
    const unsigned k116 = 0x2c003c00u | ((unsigned)K >> 31);    // K >= 0: a register
    const int wsw = (g >> 1) & 3;                                // row g + 8 nt's slot swizzle
    const int grow = wn * BW + g;                                // the group's row g
    unsigned xoff[STEPS], woff[STEPS], soff[STEPS];
#pragma unroll
    for (int q = 0; q < STEPS; ++q) {
        const int s = wk + WK * q;
        xoff[q] = SX + lr * 256 + (((2 * (s & 3) + (lane >> 4)) ^ (lane & 7)) << 4) + (s >> 2) * 128;
        woff[q] = SW + grow * 64 + (((s >> 1) ^ wsw) << 4) + (s & 1) * 8;
        soff[q] = SS + grow * 8 + (s >> 1) * 2;
    }

    float acc[MX][NT][4];
    gp_zero(acc);
    gp_xa_pipeline<GP_XK_STAGES>(stages, issue_w, issue_x, [&](int b) {
        const unsigned st = base + b * STAGE;
        const unsigned char* sp = smem + b * STAGE;
#pragma unroll
        for (int q = 0; q < STEPS; ++q) {
            unsigned a[MX][4];
#pragma unroll
            for (int mt = 0; mt < MX; ++mt) gp_ldsm_x4(a[mt], st + xoff[q] + mt * 4096);
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const unsigned sv = *reinterpret_cast<const unsigned short*>(sp + soff[q] + nt * 64);
                const unsigned s2 = sv | (sv << 16);
                const uint2 w = *reinterpret_cast<const uint2*>(sp + woff[q] + nt * 512);
                const unsigned b0 = gp_dq_byte(w.x, sel, s2, k116);
                const unsigned b1 = gp_dq_byte(w.y, sel, s2, k116);
#pragma unroll
                for (int mt = 0; mt < MX; ++mt) gp_mma(acc[mt][nt], a[mt], b0, b1);
            }
        }
    });

    // A group's WK warps summed in a fixed tree: wk += wk + half for half = WK / 2 .. 1; slot
    // (wn, wk - half) holds one warp's M x BW partial ([m][rl], stride PW), after it the
    // block's sum ([m][rl] over BN, stride PS, at the start of shared memory).
    float* part = reinterpret_cast<float*>(smem);
    float* slots = part + XR * PS;
    constexpr int SLOT = XR * PW;
#pragma unroll
    for (int half = WK / 2; half >= 1; half >>= 1) {
        if (wk >= half && wk < 2 * half)
            gp_store_tile(slots + (wn * (WK / 2) + wk - half) * SLOT, PW, acc, g, t);
        __syncthreads();
        if (wk < half) gp_add_tile(acc, slots + (wn * (WK / 2) + wk) * SLOT, PW, g, t);
        __syncthreads();
    }
    // each group's sum, into the block's [m][rl] for the store (or the cluster's)
    if (wk == 0) gp_store_tile(part + wn * BW, PS, acc, g, t);
    if (S > 1) {
        gp_cluster_sum_store(y, bias, M, N, row0, BN, PS, accumulate, base, rank, S);
        return;
    }
    __syncthreads();
    for (int idx = tid; idx < M * BN; idx += 256) {
        const int m = idx / BN, rl = idx - m * BN, r = row0 + rl;
        if (r >= N) continue;
        float v = part[m * PS + rl];
        if (bias) v += bias[r];
        float* yp = y + (long long)m * N + r;
        *yp = accumulate ? *yp + v : v;
    }
}

// grid (S, ceil(N / BN), 1) in clusters of (S, 1, 1) (none when S = 1), 256 threads, dynamic
// shared memory int4_batched.xk_shared_bytes; MX = 2 x tiles of 16 rows up to 32 rows of x, 3
// up to 48, 4 above; `wk` warps over K, so BN = 8 NT x 8 / wk weight rows a block.
// gp_int4_mma_xk8: NT 8, wk 2, 4 or 8 (one block per SM); gp_int4_mma_xk4: NT 4, wk 2 or 4 (two).
#define GP_I4MMA_XK(MX_, NT_, WK_) \
    gp_i4mma_xk<MX_, NT_, WK_>(y, x, packed, scales, bias, M, N, K, accumulate, gp_xk_smem)
#define GP_I4MMA_XK_ROWS(NT_, WK_)                      \
    do {                                                \
        if (M <= 32) GP_I4MMA_XK(2, NT_, WK_);          \
        else if (M <= 48) GP_I4MMA_XK(3, NT_, WK_);     \
        else GP_I4MMA_XK(4, NT_, WK_);                  \
    } while (0)
extern "C" __global__ void __launch_bounds__(256, 1)
gp_int4_mma_xk8(float* y, const unsigned short* __restrict__ x,
                const unsigned char* __restrict__ packed, const unsigned short* __restrict__ scales,
                const float* __restrict__ bias, int M, int N, int K, int accumulate, int wk) {
    extern __shared__ __align__(16) unsigned char gp_xk_smem[];
    if (wk == 8) GP_I4MMA_XK_ROWS(8, 8);
    else if (wk == 4) GP_I4MMA_XK_ROWS(8, 4);
    else GP_I4MMA_XK_ROWS(8, 2);
}
extern "C" __global__ void __launch_bounds__(256, 2)
gp_int4_mma_xk4(float* y, const unsigned short* __restrict__ x,
                const unsigned char* __restrict__ packed, const unsigned short* __restrict__ scales,
                const float* __restrict__ bias, int M, int N, int K, int accumulate, int wk) {
    extern __shared__ __align__(16) unsigned char gp_xk_smem[];
    // wk 4 or 2 (64 or 128 weight rows a block); at wk 8 a block would be 32 rows, reading 4x
    // xa's x from L2 per weight row
    if (wk == 4) GP_I4MMA_XK_ROWS(4, 4); else GP_I4MMA_XK_ROWS(4, 2);
}
