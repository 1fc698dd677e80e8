"""Tensor-core GEMM for the prefill linears: cuBLAS through ctypes (cuda), NumPy (sim).

Hazard: cuBLAS inside a captured graph. CuPy's wrappers refuse capture outright (they call
cublasSetStream, which CuPy 14.2 forbids while the stream captures), and a handle used naively
leaks device memory the ledger never sees: with no user workspace, cuBLAS 12.2+ allocates its own
through cudaMallocAsync, recording alloc/free nodes into the graph; handle creation and the lazy
loading of cuBLAS kernels at a shape's first call allocate device memory outside the arena.
Contract:
- one handle per Device, created outside any capture under the exclusive side of the capture gate,
  with the device memory it took (cuMemGetInfo before/after) booked in `context`, as for modules;
- one 32 MiB workspace (NVIDIA's figure for Hopper) from the arena, booked in `workspace`;
- every call sets the stream, then the workspace (cublasSetStream resets the workspace to the
  internal pool), so a call recorded into a graph never allocates;
- a shape's first call runs eagerly before any capture that contains it (`warm`), so heuristics and
  kernel loading happen outside capture; the memory a warm-up takes is booked in `context` too;
- alpha and beta are host scalars: read at capture time and baked into the graph.
Cost: cublasSetStream + cublasSetWorkspace + cublasGemmEx is ~10 us of host time per call; a
captured replay costs nothing on the host. 5502x4096x4096 fp16 runs at ~740 TFLOP/s on an H200.

The sim backend (test double) enqueues the same GEMM as a NumPy function on the stream, so it is
captured and replayed like a kernel: fp16 operands, fp32 accumulation, fp32 or fp16 output.

Layout: `gemm_nt(y, x, w, m, n, k, ldy)` computes y[m, n] (row stride ldy) = x[m, k] @ w[n, k]^T
(+ y when `accumulate`), row-major, x and w fp16. In cuBLAS's column-major terms that is
C(n x m, ldc=ldy) = op_T(W)(n x k) . X^T(k x m) with lda = ldb = k.
"""
from __future__ import annotations

import ctypes
import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable

import numpy as np

from gpu_worker.device.backend import DeviceError, i32, ptr
from services.common.errors import InvalidArgument

WORKSPACE_BYTES = 32 << 20

# cudaDataType / cublasComputeType_t / cublasGemmAlgo_t / cublasOperation_t values (cuBLAS headers)
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F = 68
CUBLAS_GEMM_DEFAULT = -1
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
OUT_DTYPES = {"f32": CUDA_R_32F, "f16": CUDA_R_16F}

_LIBRARY_CANDIDATES = ("libcublas.so.13", "/usr/local/cuda-13/lib64/libcublas.so.13",
                       "/usr/local/cuda/lib64/libcublas.so.13", "libcublas.so")


def _check_gemm_args(m: int, n: int, k: int, ldy: int, out_dtype: str) -> None:
    for name, v in (("m", m), ("n", n), ("k", k), ("ldy", ldy)):
        if not isinstance(v, int) or not 0 <= v < 2**31:
            raise InvalidArgument(f"gemm_nt: {name}={v!r} must be an int in [0, 2**31)")
    if ldy < n:
        raise InvalidArgument(f"gemm_nt: ldy={ldy} must be >= n={n}")
    if out_dtype not in OUT_DTYPES:
        raise InvalidArgument(f"gemm_nt: out_dtype must be one of {sorted(OUT_DTYPES)}, got {out_dtype!r}")


class Blas(ABC):
    """One per Device (`Device.blas`); calls are made from the thread that owns the stream."""

    def __init__(self, device) -> None:
        self.device = device
        self.workspace = device.arena.alloc(WORKSPACE_BYTES, "workspace", role="workspace")
        self.library_bytes = 0          # device memory the library took outside the arena
        self._warm: set[tuple] = set()
        self._lock = threading.Lock()
        self.calls = 0

    def gemm_nt(self, y: int, x: int, w: int, m: int, n: int, k: int, ldy: int | None = None,
                accumulate: bool = False, out_dtype: str = "f32", stream=None) -> None:
        """y[m, n] (+)= x[m, k] @ w[n, k]^T on `stream`: fp16 in, fp32 accumulate, f32/f16 out."""
        ldy = n if ldy is None else ldy
        _check_gemm_args(m, n, k, ldy, out_dtype)
        if m == 0 or n == 0:
            return
        self.calls += 1
        self._gemm(y, x, w, m, n, k, ldy, accumulate, out_dtype, self.device.stream_for(stream))

    def is_warm(self, shape: tuple) -> bool:
        return shape in self._warm

    def warm(self, shapes: Iterable[tuple], run: Callable[[], None], stream=None) -> bool:
        """If any of `shapes` (m, n, k) is new, run `run()` (launches that include those calls)
        eagerly now, before a capture records them, and book the device memory the first calls
        took; returns whether it ran (False: every shape was warm, `run` was not called)."""
        new = set(shapes) - self._warm
        if not new:
            return False
        device = self.device
        if device.gate.is_capturing_thread():
            raise DeviceError("blas.warm: called while this thread captures; warm up first")
        stream = device.stream if stream is None else stream
        with device.gate.exclusive():   # nothing else in the process allocates while we measure
            own0 = device.own_used_bytes()
            run()
            device.backend.synchronize_stream(stream)
            own1 = device.own_used_bytes()
        self._book(max(0, own1 - own0))
        self._warm |= new
        return True

    def _book(self, grown: int) -> None:
        if grown:
            self.device.ledger.adopt("context", grown)
            self.device.ledger.add_content("context", grown)
            with self._lock:
                self.library_bytes += grown

    def close(self) -> None:
        """Destroy the handle and free the workspace (the stream must be idle)."""
        self._destroy()
        if self.library_bytes:
            self.device.ledger.uncommit("context", self.library_bytes)
            self.device.ledger.remove_content("context", self.library_bytes)
            self.library_bytes = 0
        if self.workspace is not None:
            self.device.arena.free(self.workspace)
            self.workspace = None

    def stats(self) -> dict[str, int]:
        return {"calls": self.calls, "library_bytes": self.library_bytes,
                "workspace_bytes": WORKSPACE_BYTES if self.workspace is not None else 0,
                "warm_shapes": len(self._warm)}

    @abstractmethod
    def _gemm(self, y: int, x: int, w: int, m: int, n: int, k: int, ldy: int, accumulate: bool,
              out_dtype: str, stream) -> None: ...

    @abstractmethod
    def _destroy(self) -> None: ...


def _load_cublas() -> ctypes.CDLL:
    override = os.environ.get("GPUPLANE_CUBLAS_LIBRARY")
    errors = []
    for name in ((override,) if override else _LIBRARY_CANDIDATES):
        try:
            lib = ctypes.CDLL(name)
        except OSError as exc:
            errors.append(f"{name}: {exc}")
            continue
        vp, i, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
        lib.cublasDestroy_v2.argtypes = [vp]
        lib.cublasSetStream_v2.argtypes = [vp, vp]
        lib.cublasSetWorkspace_v2.argtypes = [vp, vp, sz]
        lib.cublasGemmEx.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        lib.cublasGetStatusName.argtypes = [i]
        lib.cublasGetStatusName.restype = ctypes.c_char_p
        return lib
    raise DeviceError("cuBLAS not found (set GPUPLANE_CUBLAS_LIBRARY): " + "; ".join(errors))


class CublasBlas(Blas):
    """libcublas through ctypes: no wrapper that sets the stream behind our back (CuPy's does)."""

    def __init__(self, device) -> None:
        self._lib = _load_cublas()
        self._handle = ctypes.c_void_p()
        if device.gate.is_capturing_thread():
            raise DeviceError("cublasCreate: refused while this thread captures (it allocates)")
        with device.gate.exclusive():
            own0 = device.own_used_bytes()
            self._check(self._lib.cublasCreate_v2(ctypes.byref(self._handle)), "cublasCreate_v2")
            own1 = device.own_used_bytes()
        try:
            super().__init__(device)
        except BaseException:
            self._lib.cublasDestroy_v2(self._handle)
            raise
        self._book(max(0, own1 - own0))
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        # a handle is not safe for concurrent use: set-stream, set-workspace and the GEMM of one
        # call must not interleave with another thread's (two models on one device)
        self._call_lock = threading.Lock()

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            name = self._lib.cublasGetStatusName(status)
            raise DeviceError(f"{call}: {name.decode() if name else status}")

    def _gemm(self, y, x, w, m, n, k, ldy, accumulate, out_dtype, stream) -> None:
        lib, h = self._lib, self._handle
        beta = self._one if accumulate else self._zero
        with self._call_lock:
            # Stream first, then workspace: cublasSetStream resets the workspace to cuBLAS's pool.
            self._check(lib.cublasSetStream_v2(h, ctypes.c_void_p(int(stream))), "cublasSetStream_v2")
            self._check(lib.cublasSetWorkspace_v2(h, ctypes.c_void_p(self.workspace.ptr),
                                                  WORKSPACE_BYTES), "cublasSetWorkspace_v2")
            self._check(lib.cublasGemmEx(
                h, CUBLAS_OP_T, CUBLAS_OP_N, n, m, k, ctypes.byref(self._one),
                ctypes.c_void_p(w), CUDA_R_16F, k, ctypes.c_void_p(x), CUDA_R_16F, k,
                ctypes.byref(beta), ctypes.c_void_p(y), OUT_DTYPES[out_dtype], ldy,
                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT), f"cublasGemmEx(m={m}, n={n}, k={k})")

    def _destroy(self) -> None:
        if self._handle:
            with self.device.gate.shared():   # cublasDestroy synchronizes
                self._check(self._lib.cublasDestroy_v2(self._handle), "cublasDestroy_v2")
            self._handle = ctypes.c_void_p()


def _sim_gemm(mem, grid, block, args) -> None:
    y, x, w, m, n, k, ldy, accumulate, f16_out = (a.value for a in args)
    xs = mem.view(x, m * k * 2).view(np.float16).reshape(m, k).astype(np.float32)
    ws = mem.view(w, n * k * 2).view(np.float16).reshape(n, k).astype(np.float32)
    r = (xs.astype(np.float64) @ ws.astype(np.float64).T).astype(np.float32)  # order-independent
    dt = np.float16 if f16_out else np.float32
    span = ((m - 1) * ldy + n) * np.dtype(dt).itemsize
    out = mem.view(y, span).view(dt)
    rows = np.lib.stride_tricks.as_strided(out, (m, n), (ldy * out.itemsize, out.itemsize))
    rows[:] = (rows.astype(np.float32) + r if accumulate else r).astype(dt)


class SimBlas(Blas):
    """Test double: the GEMM as a NumPy function launched on the stream (captured, replayed)."""

    def __init__(self, device) -> None:
        from gpu_worker.device.sim_backend import SimFunction

        super().__init__(device)
        self._fn = SimFunction("cublasGemmEx", _sim_gemm)

    def _gemm(self, y, x, w, m, n, k, ldy, accumulate, out_dtype, stream) -> None:
        self.device.launch(self._fn, (1, 1, 1), (1, 1, 1),
                           [ptr(y), ptr(x), ptr(w), i32(m), i32(n), i32(k), i32(ldy),
                            i32(1 if accumulate else 0), i32(1 if out_dtype == "f16" else 0)],
                           stream=stream)

    def _destroy(self) -> None:
        pass


def open_blas(device) -> Blas:
    """cuBLAS on the cuda backend, the NumPy double on the sim."""
    return CublasBlas(device) if device.backend.name == "cuda" else SimBlas(device)
