// gp_int4_wgmma(_tiled): the int4 linear's contract (int4_batched.py) on Hopper's warpgroup MMA,
// for up to GP_WG_N (64; a tuning build 32) rows of x. sm_90a only (wgmma.mma_async): this module is
// built for that arch alone.
//
// One CTA is GP_WG_GROUPS warpgroups of 128 threads, each on 64 weight rows (four 16-row tiles,
// one a warp) over the whole of K, sharing one x tile per k-group (128 k). Both operands stream
// through a GP_WG_STAGES-deep pipeline in shared memory, GP_WG_STAGES - 2 k-groups ahead (a stage
// is refilled only once the wgmmas two k-groups back, which read it, are done):
//   x      16 KiB (N = 64) by the TMA unit: two boxes of 64 k x N rows from x's tensor map (a kernel
//          parameter, int4_batched.launch_int4_wgmma), issued by one thread and counted on the
//          stage's mbarrier. A box lands 128-byte swizzled, the layout wgmma reads B from: row r's
//          16-byte chunk c at 128 r + 16 (c ^ (r & 7)); rows past M read zeros (the map's bounds).
//          It replaced 1,024 16-byte cp.async a CTA a k-group, whose per-thread requests held
//          the kernel at 64 rows (docs/kernels.md, "x by the TMA unit").
//   W      a 16-row tile's 64 bytes a row in 1 KiB: row 8h + g at 512 h + 64 g, its quant block b
//          at + 16 (b ^ ((g >> 1) & 3)), so the eight rows a warp's lanes read for one (h, b)
//          fall in eight different 16-byte bank groups.
//   scales a row's 4 fp16 at 8 x its row in the CTA.
// A row's 64 bytes and 4 scales of a k-group are contiguous in both layouts the entries read
// (the reference layout's rows; rows_tiled's 16-row tiles), so only their addresses differ; they
// stream by cp.async (their shared loads are the generic proxy's, so no proxy fence is needed;
// GP_WG_WTMA, below, moves them to the TMA unit as well).
//
// The A operand is made in registers one quant block (two k16 slices) at a time, in natural k
// order: lane (g, t) takes byte t of each packed word (nibbles k 2t and 2t + 1 of that word's 8)
// as one fp16x2 through the magics 1024 + nib (bits 0-3) and 64 + nib (bits 4-7), minus 1032 /
// 72, times the block's scale: f16(scale * (nib - 8)), the contract's one rounding. Its two
// wgmma.m64nNk16 are one commit group; two register sets alternate, and a set is rewritten after
// wgmma.wait_group 1 (its group, two back, is done), so the tensor cores run one quant block
// while the warps make the next.
//
// Launched with dependent launch: the first GP_WG_AHEAD stages' weights (constants) are issued
// before gp_pdl_wait, so they stream while the kernel before still runs; x, y and every later
// stage wait for it.
//
// K splits over a cluster of up to 8 CTAs where N alone leaves SMs idle: CTA q of a cluster takes
// k-groups [KG q / S, KG (q + 1) / S) and the partials are summed through distributed shared
// memory in rank order (gp_cluster_sum_store).
//
// Sums: f32 in the tensor cores over each CTA's K range in one warpgroup, then the split's sum in
// rank order; the split depends on N and K only (int4_batched.wgmma_plan), so a row's bits do not
// depend on how many rows share the call. They differ from gp_int4_mma's by f32 summation order.
#include "int4_mma.cuh"

#ifndef GP_WG_STAGES
#define GP_WG_STAGES 4     // k-groups in the pipeline (int4_batched.WGMMA_STAGES), at least 3
#endif
#ifndef GP_WG_GROUPS
#define GP_WG_GROUPS 2     // warpgroups per CTA (int4_batched.WGMMA_GROUPS)
#endif
#ifndef GP_WG_WTMA
#define GP_WG_WTMA 0       // 1: the tiled entry's weights and scales by the TMA unit too (below)
#endif
#ifndef GP_WG_NEXT
#define GP_WG_NEXT 0       // 1: a quant block's weights read from shared memory one block ahead
#endif
#ifndef GP_WG_CTAS
#define GP_WG_CTAS 2       // CTAs per SM the registers are bounded for (int4_batched.WGMMA_CTAS)
#endif
#define GP_WG_AHEAD (GP_WG_STAGES - 2)                 // k-groups in flight ahead of the one used
#define GP_WG_THREADS (128 * GP_WG_GROUPS)
#define GP_WG_ROWS (64 * GP_WG_GROUPS)                 // weight rows per CTA
#ifndef GP_WG_N
#define GP_WG_N 64         // rows of x a CTA carries: the wgmma's N (int4_batched.WGMMA_X_ROWS), 64 or 32
#endif
static_assert(GP_WG_N == 64 || GP_WG_N == 32, "GP_WG_N: 64 or 32 rows of x");
#define GP_WG_XBOX (GP_WG_N * 128)                     // bytes of a TMA box of x (64 k x N rows)
#define GP_WG_X (2 * GP_WG_XBOX)                       // x bytes of a stage
#define GP_WG_W (GP_WG_ROWS * 64)                      // weight bytes of a stage
#define GP_WG_STAGE (GP_WG_X + GP_WG_W + GP_WG_ROWS * 8)
static_assert(GP_WG_STAGE % 1024 == 0, "a stage's x must stay 1 KiB aligned (the swizzle's atoms)");
#define GP_WG_PS (GP_WG_ROWS + 4)   // floats a row of x in the split's partials (banks: t x 8 + g)
#define GP_WG_BARS 64                // bytes past the stages: one 8-byte mbarrier a stage (<= 8)

// GP_WG_WTMA (the tiled entry only; a tuning build, int4_batched.wgmma_build(wtma=True)): a
// stage's weights and scales are one TMA box each, from tensor maps over rows_tiled's layout
// (u64 elements: a tile's whole K a row, the CTA's tiles the box's rows; no swizzle): a tile's
// k-group piece, 1 KiB of weights and 128 bytes of scales, lands as the stage's layout without
// the block swizzle (a quarter-warp's lanes read two rows 64 bytes apart, in different banks).
// With x, every copy of a stage is then thread 0's, on the stage's mbarrier, and no thread
// issues a cp.async. Tiles past N read zeros (the maps' bounds): their products are never
// stored.
// The 128-byte-swizzle K-major descriptor of 8-row x 128-byte atoms at `addr` (1 KiB aligned):
// SBO 1 KiB (the next 8 rows), LBO unused, layout type 1 (128B swizzle).
__device__ __forceinline__ unsigned long long gp_wg_desc(unsigned addr) {
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32)
           | (1ull << 62);
}

// One A register: byte t of packed word w (k 2t, 2t + 1 of its 8) as f16(scale * (nib - 8)) x 2.
__device__ __forceinline__ unsigned gp_wg_pair(unsigned w, unsigned sel, unsigned s2) {
    unsigned r, p;
    asm("prmt.b32 %0, %1, %2, %3;\n" : "=r"(p) : "r"(w), "r"(0u), "r"(sel));   // byte t -> bytes 0, 2
    asm("lop3.b32 %0, %1, %2, %3, 0xea;\n" : "=r"(r) : "r"(p), "r"(0x00f0000fu), "r"(0x54006400u));
    asm("sub.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(r), "r"(0x54806408u));   // (1032, 72)
    asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(r) : "r"(r), "r"(s2));
    return r;
}

// d (64 x N f32, this thread's N / 2) += a (64 x 16 fp16, registers) * b (16 x N, shared, `desc`)
__device__ __forceinline__ void gp_wgmma_64xn(float (&d)[32], const unsigned (&a)[4],
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
__device__ __forceinline__ void gp_wgmma_64xn(float (&d)[16], const unsigned (&a)[4],
                                              unsigned long long desc) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, "
        "{%16, %17, %18, %19}, %20, 1, 1, 1, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
          "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
          "+f"(d[14]), "+f"(d[15])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));
}

template <int N_>
__device__ __forceinline__ void gp_wg_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N_) : "memory");
}

// Pin registers across an asynchronous wgmma: the compiler sees the asm read `a` and write `d` at
// issue, not until wgmma.wait_group, so without this it could reuse their registers meanwhile.
template <int C_>
__device__ __forceinline__ void gp_wg_keep(float (&d)[C_]) {
#pragma unroll
    for (int i = 0; i < C_; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
__device__ __forceinline__ void gp_wg_keep(unsigned (&a)[2][4]) {
#pragma unroll
    for (int s = 0; s < 2; ++s)
#pragma unroll
        for (int i = 0; i < 4; ++i) asm volatile("" : "+r"(a[s][i])::"memory");
}

// Element offset of row r's first quant block (packed: x 16 bytes; scales: x 1 fp16) of k-group
// kg: the reference layout's row, or rows_tiled's (tile, kg) piece at 32 h + 4 g.
template <bool TILED>
__device__ __forceinline__ long long gp_wg_block(int r, int kg, int KG) {
    if (TILED) return ((long long)(r >> 4) * KG + kg) * 64 + ((r >> 3) & 1) * 32 + (r & 7) * 4;
    return ((long long)r * KG + kg) * 4;
}

// This thread's cp.async copies of a k-group, addressed once (gp_int4_mma_xa's way: a copy is
// then a pointer plus the k-group's step and a cp.async at a fixed shared offset; recomputing
// the sources every k-group was most of the loop's integer work). Every k-group a thread copies
// the same pieces:
//   weights quant block b = tid & 3 of CTA row rl = (tid >> 2) + 32 G j, j < 2;
//   scales  the 4 of CTA row tid, where tid < GP_WG_ROWS.
// Sources are clamped to a valid row (a row past N is zero-filled, never read).
template <bool TILED>
struct GpWgCopies {
    static constexpr int WSTEP = TILED ? 1024 : 64, SSTEP = TILED ? 64 : 4;   // to the next k-group
    const unsigned char* ws[2];
    const unsigned short* ss;
    unsigned wd, sd;   // shared offsets in a stage
    bool win[2], sin;

    __device__ __forceinline__ GpWgCopies(const unsigned char* __restrict__ packed,
                                          const unsigned short* __restrict__ sc, int tid, int row0,
                                          int N, int KG) {
        const int b = tid & 3, rl = tid >> 2;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int r = row0 + rl + 32 * GP_WG_GROUPS * j;
            win[j] = r < N;
            ws[j] = packed + (gp_wg_block<TILED>(min(r, N - 1), 0, KG) + b) * 16;
        }
        wd = GP_WG_X + (rl >> 3) * 512 + (rl & 7) * 64 + 16 * (b ^ ((rl >> 1) & 3));
        const int sr = row0 + min(tid, GP_WG_ROWS - 1);
        sin = tid < GP_WG_ROWS && sr < N;
        ss = sc + gp_wg_block<TILED>(min(sr, N - 1), 0, KG);
        sd = GP_WG_X + GP_WG_W + tid * 8;
    }

    // k-group kg's pieces into the stage at shared address st
    __device__ __forceinline__ void issue(unsigned st, int kg, int tid) const {
#pragma unroll
        for (int j = 0; j < 2; ++j)
            gp_cp16(st + wd + 2048 * GP_WG_GROUPS * j, ws[j] + (long long)kg * WSTEP, win[j]);
        if (tid < GP_WG_ROWS) gp_cp8(st + sd, ss + (long long)kg * SSTEP, sin);
    }
};

// What gp_wg_issue copies: the weights and scales (constants: before the dependent-launch wait
// too), x (the previous kernel's output: after it), or both.
enum : int { GP_WG_WEIGHTS = 1, GP_WG_XS = 2, GP_WG_BOTH = 3 };

// k-group kg's PARTS of this CTA into the stage at shared address `st`: x (and, where WTMA, the
// weights and scales) by thread 0 on the stage's mbarrier, which expects the stage's bytes once
// (with x, or where WTMA with the weights); the rest by cp.async. The x part closes a cp.async
// commit group (an empty one where !live, past the CTA's K range, keeps the count even), so a
// weights part issued alone joins the next x part's group.
// maps: x's, and where WTMA the weights' and the scales'.
template <bool TILED, bool WTMA, int PARTS>
__device__ __forceinline__ void gp_wg_issue(unsigned st, unsigned bar, const GpWgCopies<TILED>& cp,
                                            const GpTmap* const (&maps)[3], int tid, int row0,
                                            int kg, bool live) {
    if ((PARTS & GP_WG_WEIGHTS) && live) {
        if (WTMA && tid == 0) {   // a tile's k-group piece: 128 u64 of weights, 16 of scales
            gp_fence_proxy_async();   // the stage's shared loads (generic proxy) before the TMA writes
            gp_mbar_expect(bar, GP_WG_X + GP_WG_W + GP_WG_ROWS * 8);
            gp_tma_2d(st + GP_WG_X, maps[1], kg * 128, row0 >> 4, bar);
            gp_tma_2d(st + GP_WG_X + GP_WG_W, maps[2], kg * 16, row0 >> 4, bar);
        }
        if (!WTMA) cp.issue(st, kg, tid);
    }
    if (PARTS & GP_WG_XS) {
        if (live && tid == 0) {
            if (!WTMA) gp_mbar_expect(bar, GP_WG_X);
            gp_tma_2d(st, maps[0], kg * 128, 0, bar);
            gp_tma_2d(st + GP_WG_XBOX, maps[0], kg * 128 + 64, 0, bar);
        }
        gp_cp_commit();
    }
}

// grid (S, ceil(N / GP_WG_ROWS)) in clusters of (S, 1, 1) where S > 1, GP_WG_THREADS threads,
// dynamic shared memory GP_WG_STAGES x GP_WG_STAGE + 1 KiB (int4_batched.wgmma_shared_bytes);
// maps[0] x's tensor map (M rows of K fp16, boxes of 64 k x GP_WG_N rows, 128-byte swizzle), and
// where WTMA the weights' and scales' (int4_batched.launch_int4_wgmma_tiled); M <= GP_WG_N,
// K a multiple of 128, S <= K / 128 (launch_int4_wgmma; the tiled entry also N a multiple of 16).
// Rows past N read zeros: nibble 0 with scale 0, so their products are exactly 0.
template <bool TILED>
__device__ __forceinline__ void gp_int4_wgmma_body(float* y, const unsigned char* __restrict__ packed,
                                                   const unsigned short* __restrict__ scales,
                                                   const float* __restrict__ bias, int M, int N,
                                                   int K, int accumulate,
                                                   const GpTmap* const (&maps)[3]) {
    extern __shared__ __align__(128) unsigned char gp_wg_smem[];
    // the 128-byte swizzle's atoms are 1 KiB aligned (wgmma_shared_bytes keeps 1 KiB spare)
    const unsigned raw = (unsigned)__cvta_generic_to_shared(gp_wg_smem);
    const unsigned pad = (1024u - (raw & 1023u)) & 1023u, base = raw + pad;
    unsigned char* const smem = gp_wg_smem + pad;
    constexpr bool WTMA = GP_WG_WTMA && TILED;
    const unsigned bars = base + GP_WG_STAGES * GP_WG_STAGE;   // stage s's mbarrier at + 8 s
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, g = lane >> 2, t = lane & 3;
    const int S = (int)gridDim.x, rank = (int)blockIdx.x;   // the cluster is the grid's x
    const int KG = K >> 7, kg0 = (int)((long long)KG * rank / S), kg1 = (int)((long long)KG * (rank + 1) / S);
    const int row0 = blockIdx.y * GP_WG_ROWS, nk = kg1 - kg0;
    const unsigned sel = (unsigned)t | 0x40u | ((unsigned)t << 8) | 0x4000u;   // byte t -> 0 and 2
    // this lane's rows g (h 0) and g + 8 (h 1) of its warp's tile: weights and scales in a stage
    const int wrow = GP_WG_X + warp * 1024 + g * 64, srow = GP_WG_X + GP_WG_W + (warp * 16 + g) * 8;
    const int wswz = WTMA ? 0 : (g >> 1) & 3;   // the TMA unit's box lands without the swizzle
    float acc[GP_WG_N / 2];
#pragma unroll
    for (int i = 0; i < GP_WG_N / 2; ++i) acc[i] = 0.f;
    unsigned a[2][2][4];   // two register sets of one quant block's two k16 slices

    if (tid < GP_WG_STAGES) gp_mbar_init(bars + 8 * tid);
    gp_fence_mbar_init();
    __syncthreads();
    const GpWgCopies<TILED> cp(packed, scales, tid, row0, N, KG);
    // the first stages' weights are in flight before the dependent-launch wait; x and y (the
    // previous kernel's writes) and the next kernel wait for it
#pragma unroll
    for (int i = 0; i < GP_WG_AHEAD; ++i)
        gp_wg_issue<TILED, WTMA, GP_WG_WEIGHTS>(base + i * GP_WG_STAGE, bars + 8 * i, cp, maps, tid,
                                                row0, kg0 + i, i < nk);
    gp_pdl_wait();
    gp_pdl_release();
#pragma unroll
    for (int i = 0; i < GP_WG_AHEAD; ++i)
        gp_wg_issue<TILED, WTMA, GP_WG_XS>(base + i * GP_WG_STAGE, bars + 8 * i, cp, maps, tid,
                                           row0, kg0 + i, i < nk);
    for (int i = 0; i < nk; ++i) {
        gp_cp_wait<GP_WG_AHEAD - 1>();
        // k-group i's TMA boxes: the (i / STAGES)-th use of its stage's mbarrier
        gp_mbar_wait(bars + 8 * (i % GP_WG_STAGES), (unsigned)(i / GP_WG_STAGES) & 1u);
        // every thread's copies of k-group i landed; every warpgroup's wgmmas of i - 2 are done
        // (it waited for them before its last quant block), so their stage takes i + AHEAD
        __syncthreads();
        gp_wg_issue<TILED, WTMA, GP_WG_BOTH>(base + ((i + GP_WG_AHEAD) % GP_WG_STAGES) * GP_WG_STAGE,
                                             bars + 8 * ((i + GP_WG_AHEAD) % GP_WG_STAGES), cp, maps,
                                             tid, row0, kg0 + i + GP_WG_AHEAD, i + GP_WG_AHEAD < nk);
        const int so = (i % GP_WG_STAGES) * GP_WG_STAGE;
        const unsigned st = base + so;
        // slice s's descriptor: box s >> 2 (GP_WG_XBOX on) at + 32 (s & 3) bytes (the swizzle is of
        // the address bits, so a k16 step inside a 128-byte row is a start-address step); the
        // start address is the low 14 bits, in 16-byte units, and a stage ends below 256 KiB,
        // so these are the same descriptor plus a constant
        const unsigned long long d0 = gp_wg_desc(st);
        auto dslice = [&](int s) -> unsigned long long {
            return d0 + (s >> 2) * (GP_WG_XBOX >> 4) + (s & 3) * 2;
        };
        const uint2 sv[2] = {*reinterpret_cast<const uint2*>(smem + so + srow),
                             *reinterpret_cast<const uint2*>(smem + so + srow + 64)};
        auto wload = [&](uint4 (&dst)[2], int b) {
#pragma unroll
            for (int h = 0; h < 2; ++h)
                dst[h] = *reinterpret_cast<const uint4*>(smem + so + wrow + h * 512 + 16 * (b ^ wswz));
        };
#if GP_WG_NEXT
        uint4 wn[2];   // the next quant block's weights, loaded before this one's wait
        wload(wn, 0);
#endif
#pragma unroll
        for (int b = 0; b < 4; ++b) {
            unsigned(&ab)[2][4] = a[b & 1];
            uint4 w[2];
#if GP_WG_NEXT
            w[0] = wn[0];
            w[1] = wn[1];
            if (b < 3) wload(wn, b + 1);
#endif
            gp_wg_wait<1>();   // the group that last read this set (two quant blocks back) is done
            gp_wg_keep(ab);
#if !GP_WG_NEXT
            wload(w, b);
#endif
            unsigned s2[2];
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                const unsigned s = ((b & 2) ? sv[h].y : sv[h].x) >> (16 * (b & 1)) & 0xffffu;
                s2[h] = s | (s << 16);
            }
            // slice 0: words 0 (k 2t, 2t + 1) and 1 (k 8 + 2t ..); slice 1: words 2 and 3
            ab[0][0] = gp_wg_pair(w[0].x, sel, s2[0]);
            ab[0][1] = gp_wg_pair(w[1].x, sel, s2[1]);
            ab[0][2] = gp_wg_pair(w[0].y, sel, s2[0]);
            ab[0][3] = gp_wg_pair(w[1].y, sel, s2[1]);
            ab[1][0] = gp_wg_pair(w[0].z, sel, s2[0]);
            ab[1][1] = gp_wg_pair(w[1].z, sel, s2[1]);
            ab[1][2] = gp_wg_pair(w[0].w, sel, s2[0]);
            ab[1][3] = gp_wg_pair(w[1].w, sel, s2[1]);
            asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
            gp_wgmma_64xn(acc, ab[0], dslice(2 * b));
            gp_wgmma_64xn(acc, ab[1], dslice(2 * b + 1));
            asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        }
    }
    gp_wg_wait<0>();
    gp_wg_keep(acc);
    gp_wg_keep(a[0]);
    gp_wg_keep(a[1]);
    gp_cp_wait<0>();

    // acc[4i + e]: weight row g + 8 (e >> 1) of this warp's 16, row of x 8i + 2t + (e & 1)
    if (S > 1) {   // the partials over the stages, then the cluster's sum in rank order
        __syncthreads();
        float* part = reinterpret_cast<float*>(smem);
#pragma unroll
        for (int i = 0; i < GP_WG_N / 8; ++i)
#pragma unroll
            for (int e = 0; e < 4; ++e)
                part[(8 * i + 2 * t + (e & 1)) * GP_WG_PS + warp * 16 + g + 8 * (e >> 1)] = acc[4 * i + e];
        gp_cluster_sum_store(y, bias, M, N, row0, GP_WG_ROWS, GP_WG_PS, accumulate, base, rank, S);
        return;
    }
#pragma unroll
    for (int i = 0; i < GP_WG_N / 8; ++i)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + warp * 16 + g + 8 * (e >> 1), m = 8 * i + 2 * t + (e & 1);
            if (r >= N || m >= M) continue;
            float v = acc[4 * i + e];
            if (bias) v += bias[r];
            float* yp = y + (long long)m * N + r;
            *yp = accumulate ? *yp + v : v;
        }
}

extern "C" __global__ void __launch_bounds__(GP_WG_THREADS, GP_WG_CTAS)
gp_int4_wgmma(float* y, const unsigned short* __restrict__ x, const unsigned char* __restrict__ packed,
              const unsigned short* __restrict__ scales, const float* __restrict__ bias, int M, int N,
              int K, int accumulate, const __grid_constant__ GpTmap xmap) {   // x: read through xmap
    const GpTmap* const maps[3] = {&xmap, nullptr, nullptr};
    gp_int4_wgmma_body<false>(y, packed, scales, bias, M, N, K, accumulate, maps);
}

#if GP_WG_WTMA   // the weights' and scales' tensor maps follow x's
#define GP_WG_WMAPS , const __grid_constant__ GpTmap wmap, const __grid_constant__ GpTmap smap
#define GP_WG_WMAP_PTRS &wmap, &smap
#else
#define GP_WG_WMAPS
#define GP_WG_WMAP_PTRS nullptr, nullptr
#endif

extern "C" __global__ void __launch_bounds__(GP_WG_THREADS, GP_WG_CTAS)
gp_int4_wgmma_tiled(float* y, const unsigned short* __restrict__ x,
                    const unsigned char* __restrict__ packed, const unsigned short* __restrict__ scales,
                    const float* __restrict__ bias, int M, int N, int K, int accumulate,
                    const __grid_constant__ GpTmap xmap GP_WG_WMAPS) {
    const GpTmap* const maps[3] = {&xmap, GP_WG_WMAP_PTRS};
    gp_int4_wgmma_body<true>(y, packed, scales, bias, M, N, K, accumulate, maps);
}
