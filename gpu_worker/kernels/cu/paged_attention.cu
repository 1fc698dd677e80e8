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
// the splits' own HBM time. Here a cluster of GP_FDC_CTAS CTAs of GP_FDC_WARPS warps each takes
// one (row, KV head, head block): CTA r covers the r-th 1/S of the row's actual keys (rounded to
// 16), its warps run the tensor-core split block over it (gp_fd_split_block_mma, tiles w, w +
// NW, ...), the CTA's merged state goes to its own shared memory, and after a cluster barrier
// each CTA merges a 1/S of the (head, dim) outputs over the S states in rank order (DSMEM
// loads, all issued before the first add) and writes them as fp16. No workspace, no second
// kernel, and the same sums as the combine (gp_fd_combine's weights). A row with no key (a
// padding row) comes out zero; every CTA, empty or not, meets both cluster barriers.
#define GP_FDC_WARPS 16   // paged_attention.CLUSTER_DECODE_THREADS / 32
#define GP_FDC_SMEM (2 * GP_FDC_WARPS * GP_FD_HPB + GP_FDC_WARPS * GP_FD_HPB * 128)

// rec == nullptr: the merged outputs as fp16 into out (nh heads of D). Otherwise the merged state
// as a record of the fused decode's workspace (gp_flash_decode_paged): head h's natural-unit max,
// sum and unnormalised acc at rec + h * rec_stride (out unused).
template <int D>
__device__ __forceinline__ void gp_fdc_merge(unsigned short* __restrict__ out, const float* state,
                                             int nh, int rank, int S, float* __restrict__ rec = nullptr,
                                             long long rec_stride = 0) {
    constexpr int W = D + 2;
    const unsigned base = gp_smem(state);
    const int total = nh * D;
    const int lo = total * rank / S, hi = total * (rank + 1) / S;
    for (int idx = lo + (int)threadIdx.x; idx < hi; idx += (int)blockDim.x) {
        const int h = idx / D, d = idx - h * D;
        const unsigned off = base + 4u * (unsigned)(h * W);
        float m[8], l[8], a[8];
#pragma unroll
        for (int s = 0; s < 8; ++s) {   // every remote load first: one DSMEM round trip
            m[s] = s < S ? gp_ld_cluster(off, s) : -INFINITY;
            l[s] = s < S ? gp_ld_cluster(off + 4u, s) : 0.f;
            a[s] = s < S ? gp_ld_cluster(off + 4u * (2 + d), s) : 0.f;
        }
        float mx = -INFINITY;
#pragma unroll
        for (int s = 0; s < 8; ++s) mx = fmaxf(mx, m[s]);
        float lt = 0.f, o = 0.f;
#pragma unroll
        for (int s = 0; s < 8; ++s) {
            const float w = mx != -INFINITY && l[s] > 0.f ? expf(m[s] - mx) : 0.f;
            lt = fmaf(l[s], w, lt);
            o = fmaf(a[s], w, o);
        }
        if (rec == nullptr) {
            out[(long long)h * D + d] = gp_f2h(lt > 0.f ? o / lt : 0.f);
        } else {
            float* r = rec + h * rec_stride;
            if (d == 0) { r[0] = mx; r[1] = lt; }
            r[2 + d] = o;
        }
    }
}

__shared__ float gp_fdc_state[GP_FD_HPB * (128 + 2)];   // a CTA's state: max, sum, acc a head

// After the split block: this CTA's 1/S of the block's (head, dim) outputs merged over the
// cluster's states. Its indices are recomputed here, so nothing is held live across the block.
__device__ __noinline__ void gp_fdc_finish(unsigned short* __restrict__ out, int heads,
                                           int kv_heads, int head_dim) {
    const int2 cl = gp_cluster_rank_size();
    const gp_head_block hb = gp_decode_heads(blockIdx.y, heads, kv_heads);
    unsigned short* o = out + ((long long)blockIdx.z * heads + hb.h0) * head_dim;
    if (head_dim == 128) gp_fdc_merge<128>(o, gp_fdc_state, hb.nh, cl.x, cl.y);
    else gp_fdc_merge<64>(o, gp_fdc_state, hb.nh, cl.x, cl.y);
}

// grid (S, kv_heads * ceil(group / 4), batch) in clusters of (S, 1, 1), S <= 8;
// GP_FDC_WARPS * 32 threads; head_dim 64 or 128 (paged_attention.cluster_decode).
extern "C" __global__ void __launch_bounds__(GP_FDC_WARPS * 32, 1)
gp_flash_decode_paged_cluster(unsigned short* __restrict__ out, const unsigned short* __restrict__ q,
                              const unsigned short* __restrict__ pool,
                              const int* __restrict__ positions, const int* __restrict__ table,
                              int batch, int heads, int kv_heads, int head_dim, int layer,
                              int layers, int block_tokens, int max_blocks, float scale) {
    __shared__ float smem[GP_FDC_SMEM];
    const int2 cl = gp_cluster_rank_size();
    const int rank = cl.x, S = cl.y, b = blockIdx.z;
    const int nkeys = gp_paged_nkeys(positions, b, max_blocks * block_tokens);
    const int span = ((nkeys + S - 1) / S + 15) / 16 * 16;
    const int j0 = min(rank * span, nkeys), j1 = min(j0 + span, nkeys);
    const gp_head_block hb = gp_decode_heads(blockIdx.y, heads, kv_heads);
    const int hk = hb.hk, h0 = hb.h0, nh = hb.nh;
    const int* trow = table + (long long)b * max_blocks;
    const gp_kv_paged kr = gp_paged_rows(pool, trow, layer, layers, 0, hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, trow, layer, layers, 1, hk, block_tokens, kv_heads, head_dim);
    const long long row0 = (long long)b * heads * head_dim + (long long)h0 * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    if (head_dim == 128)
        gp_fd_split_block_mma<128, true, gp_kv_paged, GP_FDC_WARPS>(gp_fdc_state, q + row0, kr, vr, nh, j0,
                                                                   j1, sl, 130, smem, nkeys - 1);
    else
        gp_fd_split_block_mma<64, true, gp_kv_paged, GP_FDC_WARPS>(gp_fdc_state, q + row0, kr, vr, nh, j0,
                                                                  j1, sl, 66, smem, nkeys - 1);
    gp_cluster_sync();   // every CTA's state is written and visible to the cluster
    gp_fdc_finish(out, heads, kv_heads, head_dim);
    gp_cluster_sync();   // no CTA leaves while another still reads its state
}

// ---- gp_flash_decode_paged: split, cluster merge and combine in one kernel --------------------
// The split kernel's blocks in clusters of C (<= 8) consecutive splits. Each CTA runs the
// tensor-core split block over its span into its own shared memory; after a cluster barrier the
// cluster merges its C states through DSMEM (gp_fdc_merge). A row whose keys fit one cluster
// writes fp16 there. Otherwise each cluster writes its merged state as one record of the
// workspace (ceil(splits / C) records a row and head), every CTA counts itself in the group's
// arrival counter, and the CTA that arrives last merges the records in cluster order
// (gp_fd_final): no second kernel, and no hand-over to one.
//
// Hazard: the last CTA reads records other SMs wrote during this kernel. Contract: every writer
// fences (__threadfence) before it counts itself; the last CTA fences after it reads the count
// and loads the records with ld.global.cg (L2, never a stale L1 line). The counter is zero
// before the kernel (a new workspace is zeroed) and the last CTA puts it back to zero, so a
// graph replays it and the layers that share the workspace reuse it one after another.
// Cost: per CTA a cluster barrier, a fence and an atomic; per row and head block the last CTA's
// ld.global.cg of at most GP_FDF_MAX_RECORDS records (MAX_DECODE_SPLITS / 8).
#define GP_FDF_MAX_RECORDS 16

// out (nh heads of D, fp16) = the records' merge in record order; rec: head h's record c at
// rec + h * head_stride + c * (D + 2). 128 threads.
template <int D>
__device__ __forceinline__ void gp_fd_final(unsigned short* __restrict__ out, const float* rec,
                                            long long head_stride, int nh, int records,
                                            float* __restrict__ w_s) {
    constexpr int W = D + 2;
    const int tid = threadIdx.x;
    __shared__ float ml[GP_FD_HPB][GP_FDF_MAX_RECORDS][2];
    for (int i = tid; i < nh * records; i += blockDim.x) {
        const int h = i / records, c = i - h * records;
        const float2 v = __ldcg(reinterpret_cast<const float2*>(rec + h * head_stride + c * W));
        ml[h][c][0] = v.x;
        ml[h][c][1] = v.y;
    }
    __syncthreads();
    if (tid < nh) {   // head tid's weights and sum, in record order
        float mx = -INFINITY;
        for (int c = 0; c < records; ++c) mx = fmaxf(mx, ml[tid][c][0]);
        float lt = 0.f;
        for (int c = 0; c < records; ++c) {
            const float w = mx != -INFINITY && ml[tid][c][1] > 0.f ? expf(ml[tid][c][0] - mx) : 0.f;
            w_s[tid * GP_FDF_MAX_RECORDS + c] = w;
            lt = fmaf(ml[tid][c][1], w, lt);
        }
        w_s[GP_FD_HPB * GP_FDF_MAX_RECORDS + tid] = lt;
    }
    __syncthreads();
    for (int i = tid; i < nh * (D / 2); i += blockDim.x) {   // a pair of dims of one head
        const int h = i / (D / 2), d = 2 * (i - h * (D / 2));
        const float* base = rec + h * head_stride + 2 + d;
        float2 a[GP_FDF_MAX_RECORDS];
#pragma unroll
        for (int c = 0; c < GP_FDF_MAX_RECORDS; ++c)   // every load first: one L2 round trip
            a[c] = c < records ? __ldcg(reinterpret_cast<const float2*>(base + c * W)) : make_float2(0.f, 0.f);
        float o0 = 0.f, o1 = 0.f;
#pragma unroll
        for (int c = 0; c < GP_FDF_MAX_RECORDS; ++c) {
            const float w = c < records ? w_s[h * GP_FDF_MAX_RECORDS + c] : 0.f;
            o0 = fmaf(a[c].x, w, o0);
            o1 = fmaf(a[c].y, w, o1);
        }
        const float lt = w_s[GP_FD_HPB * GP_FDF_MAX_RECORDS + h];
        *reinterpret_cast<unsigned*>(out + (long long)h * D + d) =
            gp_pack_h2(lt > 0.f ? o0 / lt : 0.f, lt > 0.f ? o1 / lt : 0.f);
    }
}

// After the split block (its state in gp_fdc_state): the cluster's merge, and where the row has
// more than one cluster, the record, the arrival and (last CTA) the final merge. Indices are
// recomputed here, so nothing is held live across the block.
__device__ __noinline__ void gp_fdf_finish(unsigned short* __restrict__ out, float* __restrict__ ws,
                                           unsigned* __restrict__ arrivals,
                                           const int* __restrict__ positions, int heads,
                                           int kv_heads, int head_dim, int capacity, int span) {
    const int2 cl = gp_cluster_rank_size();
    const int rank = cl.x, C = cl.y, b = blockIdx.z, slots = gridDim.x / C;
    const int nkeys = gp_paged_nkeys(positions, b, capacity);
    const int records = max(1, ((nkeys + span - 1) / span + C - 1) / C);
    const gp_head_block hb = gp_decode_heads(blockIdx.y, heads, kv_heads);
    unsigned short* o = out + ((long long)b * heads + hb.h0) * head_dim;
    const int W = head_dim + 2;
    if (records == 1) {   // the row's keys in one cluster: its merge is the output
        if (head_dim == 128) gp_fdc_merge<128>(o, gp_fdc_state, hb.nh, rank, C);
        else gp_fdc_merge<64>(o, gp_fdc_state, hb.nh, rank, C);
        gp_cluster_sync();   // no CTA leaves while another still reads its state
        return;
    }
    float* rec = ws + ((long long)b * heads + hb.h0) * slots * W;
    const long long head_stride = (long long)slots * W;
    float* mine = rec + (long long)(blockIdx.x / C) * W;
    if (head_dim == 128) gp_fdc_merge<128>(o, gp_fdc_state, hb.nh, rank, C, mine, head_stride);
    else gp_fdc_merge<64>(o, gp_fdc_state, hb.nh, rank, C, mine, head_stride);
    __threadfence();     // this thread's record words, before the count
    gp_cluster_sync();   // (and no CTA leaves while another still reads its state)
    __shared__ int last;
    if (threadIdx.x == 0) {
        unsigned* a = arrivals + (long long)b * gridDim.y + blockIdx.y;
        last = atomicAdd(a, 1u) == (unsigned)(records * C - 1);
        if (last) atomicExch(a, 0u);   // every other CTA of the group has counted: back to zero
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* w_s = gp_fdc_state;   // this CTA's state is merged and no longer read by the cluster
    if (head_dim == 128) gp_fd_final<128>(o, rec, head_stride, hb.nh, records, w_s);
    else gp_fd_final<64>(o, rec, head_stride, hb.nh, records, w_s);
}

// grid (C * slots, kv_heads * ceil(group / 4), batch) in clusters of (C, 1, 1), 128 threads;
// split z = blockIdx.x covers keys [z * span, (z + 1) * span) of its row; head_dim 64 or 128.
// ws: slots = ceil(splits / C) records of head_dim + 2 floats a (row, query head); arrivals: one
// zeroed uint32 a (row, head block). paged_attention.launch_flash_decode_paged_fused.
extern "C" __global__ void __launch_bounds__(128, 4)
gp_flash_decode_paged(unsigned short* __restrict__ out, float* __restrict__ ws,
                      unsigned* __restrict__ arrivals, const unsigned short* __restrict__ q,
                      const unsigned short* __restrict__ pool, const int* __restrict__ positions,
                      const int* __restrict__ table, int batch, int heads, int kv_heads,
                      int head_dim, int layer, int layers, int block_tokens, int max_blocks,
                      int span, float scale) {
    __shared__ float smem[GP_FD_SMEM];
    const int C = gp_cluster_rank_size().y, b = blockIdx.z, sp = blockIdx.x;
    const int capacity = max_blocks * block_tokens;
    const int nkeys = gp_paged_nkeys(positions, b, capacity);
    // a cluster past the row's length leaves whole (cluster 0 of a row with no key stays: it
    // writes the zeros)
    if (sp / C > 0 && (sp / C) * C * span >= nkeys) return;
    const int j0 = min(sp * span, nkeys), j1 = min(j0 + span, nkeys);
    const gp_head_block hb = gp_decode_heads(blockIdx.y, heads, kv_heads);
    const int* trow = table + (long long)b * max_blocks;
    const gp_kv_paged kr = gp_paged_rows(pool, trow, layer, layers, 0, hb.hk, block_tokens, kv_heads, head_dim);
    const gp_kv_paged vr = gp_paged_rows(pool, trow, layer, layers, 1, hb.hk, block_tokens, kv_heads, head_dim);
    const unsigned short* qq = q + (long long)b * heads * head_dim + (long long)hb.h0 * head_dim;
    const float sl = scale * GP_FA_LOG2E;
    if (head_dim == 128)
        gp_fd_split_block_mma<128, true>(gp_fdc_state, qq, kr, vr, hb.nh, j0, j1, sl, 130, smem, nkeys - 1);
    else
        gp_fd_split_block_mma<64, true>(gp_fdc_state, qq, kr, vr, hb.nh, j0, j1, sl, 66, smem, nkeys - 1);
    gp_cluster_sync();   // every CTA's state is written and visible to the cluster
    gp_fdf_finish(out, ws, arrivals, positions, heads, kv_heads, head_dim, capacity, span);
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
