"""What every kernel module shares: the KernelDef record, the common CUDA header, launch helpers.

A `KernelDef` is one `extern "C"` entry point. Several defs may share one `KernelSource` (one NVRTC
module per kernel family), so the executor compiles and loads a module once and looks up each entry
with `device.get_function(module, kdef.entry)`.

The common header travels as a KernelSource header, not as text pasted into each source, so it
enters every module's cache key: editing it recompiles every module that includes it.

Pointers are plain ints (device virtual addresses); 0 stands for a null (optional) pointer.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.common.errors import InvalidArgument

try:  # the compile package's public surface
    from gpu_worker.compile import KernelSource
except ImportError:  # its __init__ may not export it yet; the dataclass itself lives here
    from gpu_worker.compile.source import KernelSource

THREADS = 256            # threads per block for every kernel (8 warps)
MAX_GRID_1D = 132 * 32   # grid-stride kernels: ~32 blocks per H200 SM is plenty to saturate HBM
NVRTC_OPTIONS = ("--std=c++17", "-lineinfo")  # -lineinfo: compute-sanitizer names source lines

COMMON_HEADER_NAME = "gpuplane_common.cuh"
COMMON_HEADER = r"""
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
"""


def make_source(module_name: str, body: str) -> KernelSource:
    """A library module: `body` includes the common header, which travels with it (and its key)."""
    return KernelSource(
        module_name=module_name,
        source=f'#include "{COMMON_HEADER_NAME}"\n{body}',
        headers={COMMON_HEADER_NAME: COMMON_HEADER},
        options=NVRTC_OPTIONS,
    )


def _no_workspace(**_shapes: int) -> int:
    return 0


@dataclass(frozen=True, eq=False)  # identity equality: defs are module-level singletons
class KernelDef:
    """One kernel entry point of the library.

    `reference` is the NumPy oracle (gpu_worker.kernels.reference), `launcher` the typed
    `launch_<name>(device, function, ..., stream=None)`, `workspace` maps the kernel's shapes
    (keywords named in its module) to the device scratch bytes a caller must provide.
    """

    name: str
    entry: str
    source: KernelSource
    reference: Callable[..., object]
    launcher: Callable[..., None]
    workspace: Callable[..., int] = field(default=_no_workspace)

    def workspace_bytes(self, **shapes: int) -> int:
        """Device scratch this kernel needs for these shapes (0 when it needs none)."""
        return int(self.workspace(**shapes))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def grid_1d(n: int) -> tuple[int, int, int]:
    """A grid for a grid-stride loop over `n` items."""
    return (max(1, min(ceil_div(n, THREADS), MAX_GRID_1D)), 1, 1)


BLOCK = (THREADS, 1, 1)


def require(condition: bool, message: str) -> None:
    """Launcher argument checks: a bad shape is refused before anything reaches the device."""
    if not condition:
        raise InvalidArgument(message)


def require_sizes(kernel: str, **sizes: int) -> None:
    for name, value in sizes.items():
        require(isinstance(value, int) and 0 <= value < 2**31,
                f"{kernel}: {name}={value!r} must be an int in [0, 2**31)")
