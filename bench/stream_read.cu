// A plain read-only launch for bench/limits.same_bytes: every 16-byte word of a buffer read once
// with streaming loads, U loads in flight a thread, grid-stride over the whole buffer (a warp's
// loads 512 contiguous bytes, consecutive warps on consecutive lines). The words are folded by
// xor and stored only where the fold equals a constant (almost never), so no load can be dropped.
// Launched at 2048 threads an SM (1024 x 2 blocks): at 67 MB on an H100 that reads faster than
// any fewer threads or contiguous chunks a block (docs/kernels.md, "The copy limit at a launch's
// bytes").
#ifndef U
#define U 2
#endif

extern "C" __global__ void __launch_bounds__(1024)
gp_stream_read(const uint4* __restrict__ p, unsigned long long words, unsigned* out) {
    unsigned acc = 0;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (; i + (U - 1) * stride < words; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < words; i += stride) {
        const uint4 v = __ldcs(p + i);
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}

// gp_head_read: the same bytes in the paged decode's order, for the batch-1 decode's yardstick.
// The buffer is rows of `heads` 256-byte pieces (a KV row of the pool: one piece a KV head);
// CTA (r, h) of grid (ranks, heads) reads piece h of the r-th of `ranks` equal row ranges, as
// the cluster decode's CTA r of head h's cluster reads its keys: 256 contiguous bytes, then
// 256 x heads bytes on. A warp's 32 16-byte loads cover two rows' pieces; U loads in flight a
// thread. Folded and stored as gp_stream_read's.
extern "C" __global__ void __launch_bounds__(1024)
gp_head_read(const uint4* __restrict__ p, unsigned long long rows, int heads, unsigned* out) {
    const unsigned long long r0 = rows * blockIdx.x / gridDim.x;
    const unsigned long long r1 = rows * (blockIdx.x + 1) / gridDim.x;
    const unsigned long long words = (r1 - r0) * 16, stride = blockDim.x;
    const uint4* base = p + (r0 * heads + blockIdx.y) * 16;
    unsigned acc = 0;
    unsigned long long i = threadIdx.x;
    for (; i + (U - 1) * stride < words; i += U * stride) {
        uint4 v[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const unsigned long long w = i + u * stride;
            v[u] = __ldcs(base + (w >> 4) * heads * 16 + (w & 15));
        }
#pragma unroll
        for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < words; i += stride) {
        const uint4 v = __ldcs(base + (i >> 4) * heads * 16 + (i & 15));
        acc ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    if (acc == 0x9e3779b9u) out[0] = acc;
}
