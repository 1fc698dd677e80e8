#include "flash_device.cuh"

// The K (kv = 0) or V (kv = 1) rows of KV head hk of one layer, addressed through a table row.
__device__ __forceinline__ gp_kv_paged gp_paged_rows(const unsigned short* pool, const int* table,
                                                     int layer, int layers, int kv, int hk,
                                                     int block_tokens, int kv_heads, int head_dim) {
    const long long plane = (long long)block_tokens * kv_heads * head_dim;
    gp_kv_paged r;
    r.base = pool + (2 * layer + kv) * plane + (long long)hk * head_dim;
    r.table = table;
    r.block_stride = (long long)layers * 2 * plane;
    r.shift = __ffs(block_tokens) - 1;
    r.mask = block_tokens - 1;
    r.slot_stride = kv_heads * head_dim;
    return r;
}

// grid-stride over rows * kv_heads * head_dim: row r's K and V (f32) into the slot of position
// positions[r] of table row (table_rows == rows ? r : 0), rounded to fp16 (nearest even).
extern "C" __global__ void gp_kv_append_paged(unsigned short* __restrict__ pool,
                                              const float* __restrict__ k,
                                              const float* __restrict__ v,
                                              const int* __restrict__ positions,
                                              const int* __restrict__ table, int rows,
                                              int table_rows, int layer, int layers,
                                              int block_tokens, int kv_heads, int head_dim,
                                              int max_blocks) {
    const int width = kv_heads * head_dim;
    const long long plane = (long long)block_tokens * width;
    const long long capacity = (long long)max_blocks * block_tokens;
    GP_GRID_STRIDE(i, (long long)rows * width) {
        const int r = (int)(i / width), c = (int)(i % width);
        const int p = positions[r];
        if (p < 0 || p >= capacity) continue;  // padding row (or past the table): no write
        const int* trow = table + (long long)(table_rows == rows ? r : 0) * max_blocks;
        const long long blk = trow[p / block_tokens];
        unsigned short* dst = pool + blk * layers * 2 * plane + 2 * layer * plane
                              + (long long)(p % block_tokens) * width + c;
        dst[0] = gp_f2h(k[i]);
        dst[plane] = gp_f2h(v[i]);
    }
}

// Keys row b attends to: positions [0, positions[b]], clamped to the table (none when < 0).
__device__ __forceinline__ int gp_paged_nkeys(const int* positions, int b, int capacity) {
    return max(0, min(positions[b] + 1, capacity));
}

// grid (kv_heads * ceil(group / 4), batch, splits), 128 threads: flash decode's split kernel
// over paged K/V, split by the row's actual length. Split z covers keys [z * span, (z + 1) * span);
// the grid holds the splits of the longest row the table can hold (splits = ceil(max_blocks *
// block_tokens / span), the workspace's slots per row), and a split past its row's length
// returns before reading anything else: it writes no slot, and the combine reads none.
extern "C" __global__ void __launch_bounds__(128, 4)
gp_flash_decode_split_paged(float* __restrict__ ws, const unsigned short* __restrict__ q,
                            const unsigned short* __restrict__ pool,
                            const int* __restrict__ positions, const int* __restrict__ table,
                            int batch, int heads, int kv_heads, int head_dim, int layer,
                            int layers, int block_tokens, int max_blocks, int span, float scale) {
    // GP_FD_EARLY: the tensor-core block waits itself, after its first K/V loads (positions and
    // the table are the host's, written before the step; see gp_fd_split_block_mma)
    constexpr bool early = GP_FD_MMA && GP_FD_EARLY;
    if (!early) GP_PDL_ENTRY();
    const int b = blockIdx.y, sp = blockIdx.z, splits = gridDim.z;
    const int nkeys = gp_paged_nkeys(positions, b, max_blocks * block_tokens);
    const int j0 = sp * span;
    if (j0 >= nkeys) return;  // past the row's length (a padding row has no split at all)
    const int j1 = min(j0 + span, nkeys);
    const gp_head_block hb = gp_decode_heads(blockIdx.x, heads, kv_heads);
    const int hk = hb.hk, h0 = hb.h0, nh = hb.nh;
    const int* trow = table + (long long)b * max_blocks;
    const gp_kv_paged kr = gp_paged_rows(pool, trow, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, trow, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const unsigned short* qq = q + (long long)b * heads * head_dim + (long long)h0 * head_dim;
    float* part = ws + (((long long)b * heads + h0) * splits + sp) * (head_dim + 2);
    const int stride = splits * (head_dim + 2);
    const float sl = scale * GP_FA_LOG2E;
    __shared__ float smem[GP_FD_SMEM];
#if GP_FD_MMA
    if (head_dim == 128)
        return gp_fd_split_block_mma<128, early>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem, nkeys - 1);
    if (head_dim == 64)
        return gp_fd_split_block_mma<64, early>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem, nkeys - 1);
    if (early) GP_PDL_ENTRY();
#else
    if (head_dim == 128)
        return gp_fd_split_block<128>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
    if (head_dim == 64)
        return gp_fd_split_block<64>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
#endif
    gp_fd_split_block<16>(part, qq, kr, vr, nh, j0, j1, sl, stride, smem);
}

// ---- gp_flash_decode_paged_cluster: the whole decode in one kernel where the batch is small ----
// Where the split kernel's grid is one wave (batch 1 and 2 at Llama-3-8B's 8 KV heads), a decode
// is two short kernels, and the combine (a few microseconds) with the hand-over between them
// (the combine waits for the last split block, the next split for the combine) costs as much as
// the splits' own HBM time. Here P clusters ("parts") of S CTAs of GP_FDC_WARPS warps each take
// one (row, KV head, head block): CTA r of part c covers the (c S + r)-th 1/(P S) of the row's
// actual keys (rounded to 16), its warps run the tensor-core split block over it
// (gp_fd_split_block_mma, tiles w, w + NW, ...), the CTA's merged state goes to its own shared
// memory, and after a cluster barrier each CTA merges a 1/S of the (head, dim) outputs over the
// S states in rank order (DSMEM loads, all issued before the first add).
//   P = 1: that merge is the output, written as fp16. No workspace, no second kernel.
//   P > 1: a part is at most 8 CTAs (the portable cluster) and a wave holds few clusters, so
//          more SMs reach a row's keys only as more clusters (paged_attention.cluster_decode_shape).
//          CTA r of each part writes its merged slice to the part's slot of the workspace, and
//          the last of the P CTAs r to arrive (a counter a (row, head block, r), which it sets
//          back to 0) merges the P slots in part order and writes the fp16 output: the bits do
//          not depend on which part came last.
//   part_keys > 0: a row runs in Pe = min(P, ceil(keys / part_keys)) parts (at least 1), so a
//          short row pays no merge through the workspace; the clusters of parts Pe.. leave at
//          once (a cluster is one part of one row: all its CTAs leave together). 0: every part
//          runs (paged_attention.launch_flash_decode_paged_cluster).
// The same sums as the combine (gp_fd_combine's weights), in two levels where Pe > 1. A row with
// no key (a padding row) comes out zero; every CTA that stays, empty or not, meets both cluster
// barriers.
#ifndef GP_FDC_WARPS
#define GP_FDC_WARPS 8   // paged_attention.CLUSTER_DECODE_THREADS / 32
#endif
#ifndef GP_FDC_CTAS
#define GP_FDC_CTAS 8   // the most CTAs a cluster (paged_attention.CLUSTER_DECODE_CTAS; 16: non-portable)
#endif
#ifndef GP_FDC_TILE_ROWS
#define GP_FDC_TILE_ROWS 1   // a 16-key tile's rows from one table lookup (0: one a row)
#endif
#ifndef GP_FDC_TMA
#define GP_FDC_TMA 1   // the ring filled by the TMA unit from the pool's tensor map (a last kernel parameter; paged_attention.CLUSTER_DECODE_TMA)
#endif
#ifndef GP_FDC_RING
#define GP_FDC_RING 2   // tiles a warp keeps in flight in shared memory (0: its loads; paged_attention.CLUSTER_DECODE_RING)
#endif
#ifndef GP_FDC_PAIR
#define GP_FDC_PAIR 0   // two tiles a softmax step (gp_fd_split_block_mma's PAIR; GP_FDC_RING even)
#endif
#define GP_FDC_SMEM (2 * GP_FDC_WARPS * GP_FD_HPB + GP_FDC_WARPS * GP_FD_HPB * 128)
#define GP_FDC_SLOT (3 * GP_FD_HPB * 128)   // floats of a part's slot: max, sum, acc a (head, dim)
#define GP_FDC_COUNTERS 16                  // counters a (row, head block): one a rank, up to 16

// The merged (max, sum, acc) of output idx over the cluster's S states (DSMEM).
template <int D>
__device__ __forceinline__ float3 gp_fdc_gather(unsigned base, int idx, int S) {
    constexpr int W = D + 2;
    const int h = idx / D, d = idx - h * D;
    const unsigned off = base + 4u * (unsigned)(h * W);
    float m[GP_FDC_CTAS], l[GP_FDC_CTAS], a[GP_FDC_CTAS];
#pragma unroll
    for (int s = 0; s < GP_FDC_CTAS; ++s) {   // every remote load first: one DSMEM round trip
        m[s] = s < S ? gp_ld_cluster(off, s) : -INFINITY;
        l[s] = s < S ? gp_ld_cluster(off + 4u, s) : 0.f;
        a[s] = s < S ? gp_ld_cluster(off + 4u * (2 + d), s) : 0.f;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int s = 0; s < GP_FDC_CTAS; ++s) mx = fmaxf(mx, m[s]);
    float lt = 0.f, o = 0.f;
#pragma unroll
    for (int s = 0; s < GP_FDC_CTAS; ++s) {
        const float w = mx != -INFINITY && l[s] > 0.f ? expf(m[s] - mx) : 0.f;
        lt = fmaf(l[s], w, lt);
        o = fmaf(a[s], w, o);
    }
    return make_float3(mx, lt, o);
}

__shared__ float gp_fdc_state[GP_FD_HPB * (128 + 2)];   // a CTA's state: max, sum, acc a head
__shared__ int gp_fdc_last;                              // this CTA merges the parts (P > 1)

// After the split block: this CTA's 1/S of the block's (head, dim) outputs [lo, hi) merged over
// the cluster's states; where the row runs in Pe > 1 parts, then over the parts' slots by the
// last CTA r of the Pe to arrive (the workspace laid out for the launch's P parts). Its indices
// are recomputed here, so nothing is held live across the block.
template <int D>
__device__ __forceinline__ void gp_fdc_merge(unsigned short* __restrict__ out, float* __restrict__ ws,
                                             int nh, int rank, int S, int part, int P, int Pe,
                                             long long unit) {
    const unsigned base = gp_smem(gp_fdc_state);
    const int total = nh * D, lo = total * rank / S, hi = total * (rank + 1) / S;
    if (Pe == 1) {
        for (int idx = lo + (int)threadIdx.x; idx < hi; idx += (int)blockDim.x) {
            const float3 r = gp_fdc_gather<D>(base, idx, S);
            out[idx] = gp_f2h(r.y > 0.f ? r.z / r.y : 0.f);
        }
        return;
    }
    // workspace: GP_FDC_COUNTERS counters a unit (row, head block), one a rank, then P slots a unit
    const long long units = (long long)gridDim.z * (gridDim.y / P);
    unsigned* count = reinterpret_cast<unsigned*>(ws) + unit * GP_FDC_COUNTERS + rank;
    float* slots = ws + units * GP_FDC_COUNTERS + unit * P * GP_FDC_SLOT;
    float* mine = slots + part * GP_FDC_SLOT;
    for (int idx = lo + (int)threadIdx.x; idx < hi; idx += (int)blockDim.x) {
        const float3 r = gp_fdc_gather<D>(base, idx, S);
        mine[idx] = r.x;
        mine[GP_FD_HPB * 128 + idx] = r.y;
        mine[2 * GP_FD_HPB * 128 + idx] = r.z;
    }
    __threadfence();   // this CTA's slot, visible to the GPU before its arrival is counted
    __syncthreads();
    if (threadIdx.x == 0) {
        const unsigned before = atomicAdd(count, 1u);
        gp_fdc_last = before == (unsigned)(Pe - 1);
        if (gp_fdc_last) *count = 0u;   // every part has arrived: ready for the next launch
    }
    __syncthreads();
    if (!gp_fdc_last) return;
    __threadfence();   // the other parts' slots, seen after their arrivals
    for (int idx = lo + (int)threadIdx.x; idx < hi; idx += (int)blockDim.x) {
        float m[4], l[4], a[4];   // P <= 4 (paged_attention.MAX_DECODE_PARTS)
        float mx = -INFINITY;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float* sl = slots + c * GP_FDC_SLOT;
            m[c] = c < Pe ? __ldcg(sl + idx) : -INFINITY;
            l[c] = c < Pe ? __ldcg(sl + GP_FD_HPB * 128 + idx) : 0.f;
            a[c] = c < Pe ? __ldcg(sl + 2 * GP_FD_HPB * 128 + idx) : 0.f;
            mx = fmaxf(mx, m[c]);
        }
        float lt = 0.f, o = 0.f;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const float w = mx != -INFINITY && l[c] > 0.f ? expf(m[c] - mx) : 0.f;
            lt = fmaf(l[c], w, lt);
            o = fmaf(a[c], w, o);
        }
        out[idx] = gp_f2h(lt > 0.f ? o / lt : 0.f);
    }
}

__device__ __noinline__ void gp_fdc_finish(unsigned short* __restrict__ out, float* __restrict__ ws,
                                           int heads, int kv_heads, int head_dim, int unit,
                                           int hbi, int part, int P, int Pe) {
    const int2 cl = gp_cluster_rank_size();
    const gp_head_block hb = gp_decode_heads(hbi, heads, kv_heads);
    unsigned short* o = out + ((long long)blockIdx.z * heads + hb.h0) * head_dim;
    if (head_dim == 128) gp_fdc_merge<128>(o, ws, hb.nh, cl.x, cl.y, part, P, Pe, unit);
    else gp_fdc_merge<64>(o, ws, hb.nh, cl.x, cl.y, part, P, Pe, unit);
}

// grid (S, kv_heads * ceil(group / 4) * P, batch) in clusters of (S, 1, 1), S <= GP_FDC_CTAS,
// P <= 4 (blockIdx.y = head block * P + part), part_keys >= 0 (above); GP_FDC_WARPS * 32
// threads; head_dim 64 or 128;
// ws: none where P = 1, else cluster_decode_workspace_bytes with its counters zero
// (paged_attention.launch_flash_decode_paged_cluster).
extern "C" __global__ void __launch_bounds__(GP_FDC_WARPS * 32, 1)
gp_flash_decode_paged_cluster(unsigned short* __restrict__ out, float* __restrict__ ws,
                              const unsigned short* __restrict__ q,
                              const unsigned short* __restrict__ pool,
                              const int* __restrict__ positions, const int* __restrict__ table,
                              int batch, int heads, int kv_heads, int head_dim, int layer,
                              int layers, int block_tokens, int max_blocks, int parts,
                              int part_keys, float scale
#if GP_FDC_TMA
                              , const __grid_constant__ GpTmap poolmap   // paged_attention.pool_tensor_map
#endif
                              ) {
    static_assert(!GP_FDC_TMA || GP_FDC_RING > 0, "GP_FDC_TMA fills the ring: GP_FDC_RING > 0");
    constexpr bool tma = GP_FDC_TMA != 0;
    __shared__ float smem[GP_FDC_SMEM];
    extern __shared__ __align__(16) unsigned char gp_fdc_ring[];   // GP_FDC_RING: gp_fd_ring_bytes
    if (GP_FDC_RING > 0) {   // a launch without the ring's bytes would write past its shared memory
        unsigned dynamic;
        asm("mov.u32 %0, %%dynamic_smem_size;\n" : "=r"(dynamic));
        if (dynamic < (unsigned)(head_dim == 128 ? gp_fd_ring_bytes<128, tma>(GP_FDC_WARPS, GP_FDC_RING)
                                                 : gp_fd_ring_bytes<64, tma>(GP_FDC_WARPS, GP_FDC_RING)))
            __trap();
    }
    const unsigned ring = gp_smem(gp_fdc_ring);
    const int2 cl = gp_cluster_rank_size();
    const int rank = cl.x, S = cl.y, b = blockIdx.z, P = parts;
    const int hbi = blockIdx.y / P, part = blockIdx.y - hbi * P;
    const int nkeys = gp_paged_nkeys(positions, b, max_blocks * block_tokens);
    const int Pe = part_keys > 0 ? min(P, max(1, (nkeys + part_keys - 1) / part_keys)) : P;
    if (part >= Pe) return;   // this part's whole cluster: the row runs in fewer parts
    const int span = ((nkeys + S * Pe - 1) / (S * Pe) + 15) / 16 * 16;
    const int j0 = min((part * S + rank) * span, nkeys), j1 = min(j0 + span, nkeys);
    const gp_head_block hb = gp_decode_heads(hbi, heads, kv_heads);
    const int hk = hb.hk, h0 = hb.h0, nh = hb.nh;
    const int* trow = table + (long long)b * max_blocks;
    const gp_kv_paged kr = gp_paged_rows(pool, trow, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, trow, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const long long row0 = (long long)b * heads * head_dim + (long long)h0 * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    constexpr bool rows = GP_FDC_TILE_ROWS != 0;
#if GP_FDC_TMA
    const gp_fd_pool_map pm{&poolmap, trow, kr.shift, kr.mask, hk, layer};
#else
    const gp_fd_pool_map pm{};
#endif
    if (head_dim == 128)
        gp_fd_split_block_mma<128, true, gp_kv_paged, GP_FDC_WARPS, rows, GP_FDC_RING, tma,
                              GP_FDC_PAIR != 0>(
            gp_fdc_state, q + row0, kr, vr, nh, j0, j1, sl, 130, smem, nkeys - 1, ring, pm);
    else
        gp_fd_split_block_mma<64, true, gp_kv_paged, GP_FDC_WARPS, rows, GP_FDC_RING, tma,
                              GP_FDC_PAIR != 0>(
            gp_fdc_state, q + row0, kr, vr, nh, j0, j1, sl, 66, smem, nkeys - 1, ring, pm);
    gp_cluster_sync();   // every CTA's state is written and visible to the cluster
    gp_fdc_finish(out, ws, heads, kv_heads, head_dim, b * (int)(gridDim.y / P) + hbi, hbi, part,
                  P, Pe);
    gp_cluster_sync();   // no CTA leaves while another still reads its state
}

// grid (heads, batch), 128 threads: out (fp16) = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s
// over the ceil(nkeys / span) splits that ran for row b (never the slots past its length, which
// hold stale state); a row with no key (a padding row) is zeros. gp_fd_combine: the states staged
// into shared memory in one round trip.
extern "C" __global__ void __launch_bounds__(128)
gp_flash_combine_paged(unsigned short* __restrict__ out, const float* __restrict__ ws,
                       const int* __restrict__ positions, int batch, int heads, int head_dim,
                       int capacity, int span, int splits) {
    GP_PDL_ENTRY();
    extern __shared__ float gp_fc_states[];   // decode_combine_shared_bytes
    const int h = blockIdx.x, b = blockIdx.y, width = head_dim + 2;
    const int nkeys = gp_paged_nkeys(positions, b, capacity);
    const int ran = min(splits, (nkeys + span - 1) / span);
    const float* part = ws + ((long long)b * heads + h) * splits * width;
    unsigned short* o = out + ((long long)b * heads + h) * head_dim;
    if (head_dim == 128) gp_fd_combine<128>(o, part, ran, gp_fc_states);
    else if (head_dim == 64) gp_fd_combine<64>(o, part, ran, gp_fc_states);
    else gp_fd_combine<16>(o, part, ran, gp_fc_states);
}

// grid (ceil(tokens / 64), heads), 128 threads: one prefill chunk of one sequence. Token t <
// chunk_len (position start + t) sees positions [0, start + t]; rows t >= chunk_len are zero.
extern "C" __global__ void __launch_bounds__(128, GP_FA_MINB)
gp_flash_prefill_paged(unsigned short* out, const unsigned short* __restrict__ q,
                       const unsigned short* __restrict__ pool, const int* __restrict__ start,
                       const int* __restrict__ chunk_len, const int* __restrict__ table,
                       int tokens, int heads, int kv_heads, int head_dim, int layer, int layers,
                       int block_tokens, int max_blocks, float scale) {
    GP_PDL_ENTRY();
    __shared__ __align__(16) unsigned short k_s[GP_FA_BN * (128 + GP_FA_PAD)];
    __shared__ __align__(16) unsigned short v_s[GP_FA_BN * (128 + GP_FA_PAD)];
    const int t0 = (gridDim.x - 1 - blockIdx.x) * GP_FA_BM, h = blockIdx.y;
    const int hk = h / (heads / kv_heads);
    const int p = start[0];
    // A negative start (a padding chunk) or an empty chunk: every row is zero.
    const int rows_valid = p < 0 ? 0 : max(0, min(chunk_len[0], tokens));
    const int valid = min(max(p, 0) + rows_valid, max_blocks * block_tokens);
    const gp_kv_paged kr = gp_paged_rows(pool, table, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, table, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const long long width = (long long)heads * head_dim;
    unsigned short* o = out + (long long)h * head_dim;
    const unsigned short* qq = q + (long long)h * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    if (head_dim == 128)
        gp_fa_prefill_block<128>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                 1, width, width, sl);
    else if (head_dim == 64)
        gp_fa_prefill_block<64>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                1, width, width, sl);
    else
        gp_fa_prefill_block<16>(o, qq, kr, vr, k_s, v_s, tokens, rows_valid, t0, max(p, 0), valid,
                                1, width, width, sl);
}
