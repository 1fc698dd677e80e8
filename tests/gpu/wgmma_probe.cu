// The smallest use of Hopper's warpgroup MMA (sm_90a only): one warpgroup of 128 threads computes
// D (64 x 8, f32) = A (64 x 16, f16, row-major, from registers) * B (16 x 8, f16, from shared
// memory through a matrix descriptor), by one wgmma.mma_async.m64n8k16. A probe, not a product
// kernel: it answers whether NVRTC's sm_90a CUBIN with wgmma loads and runs on the driver
// (tests/gpu/test_wgmma_sm90a.py; docs/kernels.md records the answer).
//
// B sits in shared memory as the no-swizzle canonical K-major layout: two 8 x 8 core matrices
// (k 0..7 and k 8..15), each 8 rows (n) of 16 contiguous bytes, 128 bytes apart. `lbo` / `sbo`
// are the descriptor's leading / stride byte offsets, given by the host so one run can try both
// readings of which offset steps along K.
extern "C" __global__ void __launch_bounds__(128)
gp_wgmma_probe(float* __restrict__ d, const unsigned short* __restrict__ a,
               const unsigned short* __restrict__ b, int lbo, int sbo) {
    // 1 KiB, the B tile in its first 256 bytes, zeros after: a descriptor read that steps past
    // the tile reads zeros (a wrong result), not unowned shared memory (a fault)
    __shared__ __align__(128) unsigned short bs[512];
    const int tid = threadIdx.x;
    for (int i = tid; i < 512; i += 128) bs[i] = 0;
    __syncthreads();
    {
        const int k = tid / 8, n = tid % 8;          // b is (k, n) row-major, 16 x 8
        bs[(k / 8) * 64 + n * 8 + (k % 8)] = b[tid];
    }
    // ordinary stores that the tensor cores (the async proxy) read next need this fence
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    __syncthreads();
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    const unsigned* a32 = reinterpret_cast<const unsigned*>(a);
    const unsigned a0 = a32[(r0 * 16 + 2 * t) / 2], a1 = a32[(r1 * 16 + 2 * t) / 2];
    const unsigned a2 = a32[(r0 * 16 + 2 * t + 8) / 2], a3 = a32[(r1 * 16 + 2 * t + 8) / 2];
    const unsigned addr = (unsigned)__cvta_generic_to_shared(bs);
    const unsigned long long desc = (unsigned long long)((addr & 0x3FFFF) >> 4)
                                    | ((unsigned long long)((lbo >> 4) & 0x3FFF) << 16)
                                    | ((unsigned long long)((sbo >> 4) & 0x3FFF) << 32);
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %9, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0, %1, %2, %3}, "
                 "{%4, %5, %6, %7}, %8, p, 1, 1, 0;\n}\n"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "r"(0));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    d[r0 * 8 + 2 * t] = d0;
    d[r0 * 8 + 2 * t + 1] = d1;
    d[r1 * 8 + 2 * t] = d2;
    d[r1 * 8 + 2 * t + 1] = d3;
}
