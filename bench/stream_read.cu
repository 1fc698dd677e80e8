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
