#pragma once
// gpuplane kernel library: helpers shared by every module. Blocks are GP_THREADS threads
// (a multiple of 32: the warp reductions use full-mask shuffles).
#define GP_THREADS 256
#ifndef INFINITY  // NVRTC has no <math.h>
#define INFINITY __int_as_float(0x7f800000)
#endif
#define GP_GRID_STRIDE(i, n) \
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (long long)(n); \
         i += (long long)gridDim.x * blockDim.x)

// fp16 bits -> float without cuda_fp16.h (NVRTC then needs no CUDA include path).
__device__ __forceinline__ float gp_half_to_float(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// fp16 storage without cuda_fp16.h: the bits in a 2-byte struct, so overloads on it cannot be
// confused with unsigned short. gp_ld / gp_st move a value of either storage type as a float.
struct __align__(2) gp_h { unsigned short x; };

__device__ __forceinline__ unsigned short gp_float_to_half(float f) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));   // round to nearest even
    return h;
}

__device__ __forceinline__ float gp_ld(const float* p) { return *p; }
__device__ __forceinline__ float gp_ld(const gp_h* p) { return gp_half_to_float(p->x); }
__device__ __forceinline__ void gp_st(float* p, float v) { *p = v; }
__device__ __forceinline__ void gp_st(gp_h* p, float v) { p->x = gp_float_to_half(v); }

// Four consecutive values at once (p 16-byte aligned for float, 8 for gp_h).
__device__ __forceinline__ void gp_st4(float* p, float4 v) { *reinterpret_cast<float4*>(p) = v; }
__device__ __forceinline__ void gp_st4(gp_h* p, float4 v) {
    const unsigned lo = gp_float_to_half(v.x) | ((unsigned)gp_float_to_half(v.y) << 16);
    const unsigned hi = gp_float_to_half(v.z) | ((unsigned)gp_float_to_half(v.w) << 16);
    *reinterpret_cast<uint2*>(p) = make_uint2(lo, hi);
}

__device__ __forceinline__ float gp_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float gp_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Block-wide reductions; every thread receives the result. `scratch` is 33 shared floats.
// The leading barrier lets a block call them back to back on the same scratch.
__device__ __forceinline__ float gp_block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = gp_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : 0.f;
        w = gp_warp_sum(w);
        if (lane == 0) scratch[32] = w;
    }
    __syncthreads();
    return scratch[32];
}

__device__ __forceinline__ float gp_block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = gp_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    if (warp == 0) {
        float w = lane < nwarps ? scratch[lane] : -INFINITY;
        w = gp_warp_max(w);
        if (lane == 0) scratch[32] = w;
    }
    __syncthreads();
    return scratch[32];
}

// cp.async (sm_80+): a 16- or 8-byte global -> shared copy (zeros when !in), its commit group and
// the wait for all but N_ groups.
__device__ __forceinline__ void gp_cp16(unsigned dst, const void* src, bool in) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void gp_cp8(unsigned dst, const void* src, bool in) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(dst), "l"(src), "r"(in ? 8 : 0)
                 : "memory");
}
__device__ __forceinline__ void gp_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N_>
__device__ __forceinline__ void gp_cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N_) : "memory"); }

// ---- Programmatic dependent launch (sm_90) ----------------------------------------------------
// Hazard: a kernel launched with Device.launch(..., pdl=True) may start while the kernel before it
// on the stream is still running. Contract: before gp_pdl_wait() such a kernel touches only what
// the kernel before it does not write: weights, and (the paged decode split) the positions and
// block table the host wrote before the step and every KV row but each row's newest, which the
// rope + append before it writes (everything older completed before that kernel passed its own
// wait, so at most the one kernel before runs meanwhile); gp_pdl_wait() returns once the previous kernel has
// completed and its writes are visible (at once for a launch without the attribute, and below
// sm_90, where both calls compile to nothing). gp_pdl_release() lets the next kernel, if it was
// launched with pdl, start its own prologue; every kernel that releases has waited first, so at
// most two kernels of a stream overlap. Cost: one instruction each; what it buys is the launch
// latency between kernels and, for the int4 linears, weight bytes streamed while the kernel
// before them (a norm, the attention) runs.
__device__ __forceinline__ void gp_pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void gp_pdl_release() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// the first statement of a pdl kernel with nothing to do before its inputs are ready
#define GP_PDL_ENTRY() \
    do {                 \
        gp_pdl_wait();   \
        gp_pdl_release(); \
    } while (0)

// ---- Asynchronous copies on an mbarrier (sm_90) ---------------------------------------------
// Hazard: a bulk copy (or a TMA box) writes shared memory through the async proxy, behind the
// thread's back. Contract: its readers wait on the mbarrier it completes (gp_mbar_wait, the
// phase's parity), which makes its bytes visible; a slot refilled after generic-proxy reads of
// it is fenced first (gp_fence_proxy_async, after every reader's reads). An mbarrier here
// counts one arrival a phase: gp_mbar_expect, the bytes the phase's copies will deliver, which
// may come before or after them. Cost: one instruction a copy, whatever its size, in place of
// a 16-byte load or cp.async a thread. Below sm_90 these compile to a trap.
__device__ __forceinline__ void gp_mbar_init(unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(bar) : "memory");
#else
    __trap();
#endif
}
// this thread's mbarrier inits, visible to the async proxy (before any copy names them)
__device__ __forceinline__ void gp_fence_mbar_init() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void gp_mbar_expect(unsigned bar, unsigned bytes) {
#if __CUDA_ARCH__ >= 900
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(bar), "r"(bytes)
                 : "memory");
#endif
}
__device__ __forceinline__ void gp_mbar_wait(unsigned bar, unsigned parity) {
#if __CUDA_ARCH__ >= 900
    unsigned done;
    do {
        asm volatile("{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n"
                     "selp.u32 %0, 1, 0, p;\n}\n" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
    } while (!done);
#endif
}
// `bytes` (a multiple of 16) from global src to shared dst (both 16-byte aligned), on mbarrier bar
__device__ __forceinline__ void gp_bulk_copy(unsigned dst, const void* src, unsigned bytes, unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n"
                 ::"r"(dst), "l"(src), "r"(bytes), "r"(bar) : "memory");
#else
    __trap();
#endif
}
// A tensor map (CUtensorMap, Device.tensor_map), a __grid_constant__ kernel parameter, and one
// box of it into shared memory (coordinates innermost first; 128-byte swizzled boxes need a
// 1 KiB aligned dst).
struct __align__(64) GpTmap { unsigned long long v[16]; };
__device__ __forceinline__ void gp_tma_2d(unsigned dst, const GpTmap* map, int c0, int c1, unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(bar)
                 : "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void gp_tma_5d(unsigned dst, const GpTmap* map, int c0, int c1, int c2,
                                          int c3, int c4, unsigned bar) {
#if __CUDA_ARCH__ >= 900
    asm volatile("cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5, %6}], [%7];\n"
                 ::"r"(dst), "l"(reinterpret_cast<unsigned long long>(map)), "r"(c0), "r"(c1), "r"(c2),
                   "r"(c3), "r"(c4), "r"(bar) : "memory");
#else
    __trap();
#endif
}
// this thread's earlier generic-proxy accesses of shared memory, ordered before its later copies
__device__ __forceinline__ void gp_fence_proxy_async() {
#if __CUDA_ARCH__ >= 900
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
#endif
}

// Thread-block clusters (sm_90): (this CTA's rank, the cluster's size); without a cluster
// launch a CTA is rank 0 of a cluster of one.
__device__ __forceinline__ int2 gp_cluster_rank_size() {
    unsigned rank = 0, size = 1;
#if __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_ctarank;\n"
                 "mov.u32 %1, %%cluster_nctarank;\n" : "=r"(rank), "=r"(size));
#endif
    return make_int2((int)rank, (int)size);
}
__device__ __forceinline__ void gp_cluster_sync() {  // every thread of every CTA of the cluster
#if __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.release.aligned;\n"
                 "barrier.cluster.wait.acquire.aligned;\n" ::: "memory");
#else
    __syncthreads();
#endif
}
// The float at shared-window address `local` of the cluster's CTA `rank`.
__device__ __forceinline__ float gp_ld_cluster(unsigned local, int rank) {
#if __CUDA_ARCH__ >= 900
    unsigned remote;
    float v;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(remote) : "r"(local), "r"(rank));
    asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(remote) : "memory");
    return v;
#else
    return 0.f;
#endif
}
