"""Linear layers: y = x @ W^T (+ bias) with W int4 block-quantized, two ways.

- Workspace path (prefill, many rows): `int4_dequant` expands W into a float32 workspace of
  N * K * 4 bytes (its `workspace_bytes(n=, k=)`), then `matmul_nt`, a shared-memory tiled matmul
  (64x64 tiles, K step 16, 4x4 outputs per thread), reads it. Dequantization is exact in float32
  (a 4-bit integer times an fp16 scale), so this path equals the reference up to summation order.
  `matmul_nt_large` is the same contract with 128x128 tiles and 8x8 outputs per thread for
  prefill-sized m and n (which of the two wins is for bench/kernels_bench.py [4] to say).
  This workspace is the "dequantization scratch" of DESIGN 1.1: it scales with the weight, so every
  per-node kernel variant that keeps one must have it booked in the `workspace` zone.
- Fused path (decode, few rows): `int4_matmul` reads the packed weight directly, one warp per
  output column, each lane one 32-bit word (8 weights) per step, so a batch-1 decode step reads
  0.56 bytes of HBM per weight instead of 8.5. Needs no workspace. It re-reads W once per 4 rows
  of x, so above FUSED_MAX_ROWS rows the workspace path is faster: see `int4_path`.

Layout (gpu_worker.kernels.reference): packed (N, 16 * ceil(K/32)) uint8, scales (N, ceil(K/32))
fp16. `packed` must be 16-byte aligned (each row is a whole number of 16-byte blocks); the fused
kernel loads x as float4 when K % 4 == 0 and x is 16-byte aligned, else scalar.
Shapes: x (M, K), y (M, N) f32, bias (N,) f32 or 0. `accumulate` adds into y (a fused residual).
"""
from __future__ import annotations

from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference
from gpu_worker.kernels.common import (
    BLOCK,
    KernelDef,
    ceil_div,
    grid_1d,
    make_source,
    require,
    require_sizes,
)

FUSED_MAX_ROWS = 16   # at or below: int4_matmul; above: the tensor-core path (int4_path)
TILE = 64             # matmul_nt output tile (rows and columns)
LARGE_TILE = 128      # matmul_nt_large output tile
FUSED_COLS = 8        # int4_matmul: output columns per block (one per warp)
FUSED_ROWS = 4        # int4_matmul: rows of x per block

SOURCE = make_source("gp_linear", r"""
extern "C" __global__ void gp_int4_dequant(float* __restrict__ w, const unsigned char* __restrict__ packed,
                                           const unsigned short* __restrict__ scales, int n, int k) {
    const int kb = (k + 31) >> 5;
    GP_GRID_STRIDE(i, (long long)n * k) {
        const int r = (int)(i / k), c = (int)(i % k);
        const unsigned char byte = packed[(size_t)r * kb * 16 + (c >> 1)];
        const int nib = (c & 1) ? (byte >> 4) : (byte & 15);
        w[i] = (float)(nib - 8) * gp_half_to_float(scales[(size_t)r * kb + (c >> 5)]);
    }
}

#define GP_TM 64
#define GP_TN 64
#define GP_TK 16
// y[M,N] = x[M,K] . w[N,K]^T (+ bias). Block 256 = 16x16 threads, each a 4x4 patch of a 64x64 tile.
extern "C" __global__ void __launch_bounds__(256)
gp_matmul_nt(float* y, const float* __restrict__ x, const float* __restrict__ w,
             const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ float xs[GP_TK][GP_TM + 4];
    __shared__ float ws[GP_TK][GP_TN + 4];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * GP_TM, n0 = blockIdx.x * GP_TN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += GP_TK) {
        for (int e = tid; e < GP_TM * GP_TK; e += 256) {
            const int r = e / GP_TK, kk = e % GP_TK, gk = k0 + kk;
            const int gm = m0 + r, gn = n0 + r;
            xs[kk][r] = (gm < M && gk < K) ? x[(size_t)gm * K + gk] : 0.f;
            ws[kk][r] = (gn < N && gk < K) ? w[(size_t)gn * K + gk] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < GP_TK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int gm = m0 + ty * 4 + i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int gn = n0 + tx * 4 + j;
            if (gn >= N) continue;
            float v = acc[i][j] + (bias ? bias[gn] : 0.f);
            float* yp = y + (size_t)gm * N + gn;
            *yp = accumulate ? *yp + v : v;
        }
    }
}

// matmul_nt_large: same contract as gp_matmul_nt with 128x128 tiles, K step 8, an 8x8 patch per
// thread (rows ty*4+i and 64+ty*4+i, columns likewise) read from shared memory as float4: twice
// the FLOPs per shared/global byte of the 64x64 kernel. For large M and N (prefill).
extern "C" __global__ void __launch_bounds__(256)
gp_matmul_nt_large(float* y, const float* __restrict__ x, const float* __restrict__ w,
                   const float* __restrict__ bias, int M, int N, int K, int accumulate) {
    __shared__ __align__(16) float xs[8][132];
    __shared__ __align__(16) float ws[8][132];
    const int tid = threadIdx.x, tx = tid & 15, ty = tid >> 4;
    const int m0 = blockIdx.y * 128, n0 = blockIdx.x * 128;
    float acc[8][8];
#pragma unroll
    for (int i = 0; i < 8; ++i)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[i][j] = 0.f;
    for (int k0 = 0; k0 < K; k0 += 8) {
#pragma unroll
        for (int e = tid; e < 1024; e += 256) {
            const int r = e >> 3, kk = e & 7, gk = k0 + kk;
            const int gm = m0 + r, gn = n0 + r;
            xs[kk][r] = (gm < M && gk < K) ? x[(size_t)gm * K + gk] : 0.f;
            ws[kk][r] = (gn < N && gk < K) ? w[(size_t)gn * K + gk] : 0.f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 8; ++kk) {
            const float4 a0 = *reinterpret_cast<const float4*>(&xs[kk][ty * 4]);
            const float4 a1 = *reinterpret_cast<const float4*>(&xs[kk][64 + ty * 4]);
            const float4 b0 = *reinterpret_cast<const float4*>(&ws[kk][tx * 4]);
            const float4 b1 = *reinterpret_cast<const float4*>(&ws[kk][64 + tx * 4]);
            const float a[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w};
            const float b[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
            for (int i = 0; i < 8; ++i)
#pragma unroll
                for (int j = 0; j < 8; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int gm = m0 + (i < 4 ? ty * 4 + i : 64 + ty * 4 + (i - 4));
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int gn = n0 + (j < 4 ? tx * 4 + j : 64 + tx * 4 + (j - 4));
            if (gn >= N) continue;
            const float v = acc[i][j] + (bias ? bias[gn] : 0.f);
            float* yp = y + (size_t)gm * N + gn;
            *yp = accumulate ? *yp + v : v;
        }
    }
}

// Fused int4 matmul for few rows: warp = one output column n; lane = one 32-bit word (8 weights
// of one quant block) per step, so a warp reads 128 contiguous bytes of W and 1 KB contiguous of
// each x row per step (a lane-per-16-byte-block split would make every x load touch 32 cache
// lines). Padding words past K read no x.
extern "C" __global__ void __launch_bounds__(256)
gp_int4_matmul(float* y, const float* __restrict__ x, const unsigned char* __restrict__ packed,
               const unsigned short* __restrict__ scales, const float* __restrict__ bias,
               int M, int N, int K, int accumulate) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int n = blockIdx.x * 8 + warp;
    const int m0 = blockIdx.y * 4;
    if (n >= N) return;  // warp-uniform; this kernel has no block barrier
    const int kb = (K + 31) >> 5;
    const int words = kb * 4;
    const unsigned int* prow = reinterpret_cast<const unsigned int*>(packed + (size_t)n * kb * 16);
    const unsigned short* srow = scales + (size_t)n * kb;
    const int mrows = min(4, M - m0);
    const bool vec = (K & 3) == 0 && (reinterpret_cast<size_t>(x) & 15) == 0;
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
    for (int wd = lane; wd < words; wd += 32) {
        const unsigned int qw = prow[wd];
        const float s = gp_half_to_float(srow[wd >> 2]);
        const int k0 = wd * 8;
        float q[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) q[j] = (float)((int)((qw >> (4 * j)) & 15u) - 8);
#pragma unroll
        for (int mi = 0; mi < 4; ++mi) {
            if (mi >= mrows) break;
            const float* xr = x + (size_t)(m0 + mi) * K + k0;
            float part = 0.f;
            if (vec && k0 + 8 <= K) {
                const float4 a = *reinterpret_cast<const float4*>(xr);
                const float4 b = *reinterpret_cast<const float4*>(xr + 4);
                part = a.x * q[0] + a.y * q[1] + a.z * q[2] + a.w * q[3]
                     + b.x * q[4] + b.y * q[5] + b.z * q[6] + b.w * q[7];
            } else {
#pragma unroll
                for (int j = 0; j < 8; ++j)
                    if (k0 + j < K) part = fmaf(xr[j], q[j], part);
            }
            acc[mi] = fmaf(part, s, acc[mi]);
        }
    }
#pragma unroll
    for (int mi = 0; mi < 4; ++mi) {
        if (mi >= mrows) break;
        float v = gp_warp_sum(acc[mi]);
        if (lane == 0) {
            v += bias ? bias[n] : 0.f;
            float* yp = y + (size_t)(m0 + mi) * N + n;
            *yp = accumulate ? *yp + v : v;
        }
    }
}
""")


def int4_path(m: int) -> str:
    """Which linear path serves `m` rows in a model graph: "fused" (int4_matmul, decode) or
    "tensor" (int4_dequant_f16 into a bounded tile, then cuBLAS fp16 GEMM: gpu_worker.kernels.half
    and gpu_worker.device.blas). The f32 dequant + matmul_nt path stays in the library as the
    measured baseline (bench/kernels_bench.py, docs/kernels.md)."""
    return "fused" if m <= FUSED_MAX_ROWS else "tensor"


def launch_int4_dequant(device, function, workspace: int, packed: int, scales: int, n: int, k: int,
                        stream=None) -> None:
    """Expand W (n, k) into `workspace` (n * k float32, see INT4_DEQUANT.workspace_bytes)."""
    require_sizes("int4_dequant", n=n, k=k, elements=n * k)
    if n == 0 or k == 0:
        return
    device.launch(function, grid_1d(n * k), BLOCK,
                  [ptr(workspace), ptr(packed), ptr(scales), i32(n), i32(k)], stream=stream)


def launch_matmul_nt(device, function, y: int, x: int, w: int, bias: int, m: int, n: int, k: int,
                     accumulate: bool = False, stream=None) -> None:
    require_sizes("matmul_nt", m=m, n=n, k=k)
    if m == 0 or n == 0:
        return
    require(ceil_div(m, TILE) < 65536, f"matmul_nt: m={m} exceeds {65535 * TILE} rows")
    device.launch(function, (ceil_div(n, TILE), ceil_div(m, TILE), 1), BLOCK,
                  [ptr(y), ptr(x), ptr(w), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def launch_matmul_nt_large(device, function, y: int, x: int, w: int, bias: int, m: int, n: int,
                           k: int, accumulate: bool = False, stream=None) -> None:
    """matmul_nt with 128x128 tiles (prefill-sized m and n); same arguments and result."""
    require_sizes("matmul_nt_large", m=m, n=n, k=k)
    if m == 0 or n == 0:
        return
    require(ceil_div(m, LARGE_TILE) < 65536, f"matmul_nt_large: m={m} exceeds {65535 * LARGE_TILE}")
    device.launch(function, (ceil_div(n, LARGE_TILE), ceil_div(m, LARGE_TILE), 1), BLOCK,
                  [ptr(y), ptr(x), ptr(w), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def launch_int4_matmul(device, function, y: int, x: int, packed: int, scales: int, bias: int,
                       m: int, n: int, k: int, accumulate: bool = False, stream=None) -> None:
    require_sizes("int4_matmul", m=m, n=n, k=k)
    require(packed % 16 == 0, f"int4_matmul: packed weight 0x{packed:x} must be 16-byte aligned")
    if m == 0 or n == 0:
        return
    require(ceil_div(m, FUSED_ROWS) < 65536, f"int4_matmul: m={m} too large; use the dequant path")
    device.launch(function, (ceil_div(n, FUSED_COLS), ceil_div(m, FUSED_ROWS), 1), BLOCK,
                  [ptr(y), ptr(x), ptr(packed), ptr(scales), ptr(bias), i32(m), i32(n), i32(k),
                   i32(1 if accumulate else 0)], stream=stream)


def _dequant_workspace(*, n: int, k: int, **_: int) -> int:
    return 4 * n * k


INT4_DEQUANT = KernelDef("int4_dequant", "gp_int4_dequant", SOURCE, reference.int4_dequantize,
                         launch_int4_dequant, workspace=_dequant_workspace)
MATMUL_NT = KernelDef("matmul_nt", "gp_matmul_nt", SOURCE, reference.matmul_nt, launch_matmul_nt)
MATMUL_NT_LARGE = KernelDef("matmul_nt_large", "gp_matmul_nt_large", SOURCE, reference.matmul_nt,
                            launch_matmul_nt_large)
INT4_MATMUL = KernelDef("int4_matmul", "gp_int4_matmul", SOURCE, reference.int4_matmul,
                        launch_int4_matmul)

KERNELS = [INT4_DEQUANT, MATMUL_NT, MATMUL_NT_LARGE, INT4_MATMUL]
