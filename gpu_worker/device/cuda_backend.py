"""The `cuda` backend: the product. cuda-python driver API on the retained primary context.

- Every driver call goes through `check()`: a failure raises DeviceError (or IllegalAddress /
  CaptureInvalidated) naming the call and the driver's own error name and message.
- The primary context is retained once for the life of the process (a context whose refcount reaches
  zero is torn down, and teardown synchronizes: DESIGN 2.1) and made current in every thread that
  calls the driver, so CuPy (runtime API, primary context) and this module share one context.
- Streams are non-blocking; capture is always THREAD_LOCAL (CuPy's default is RELAXED).
- Every device byte is VMM: cuMemCreate + cuMemMap + cuMemSetAccess inside one reservation.
- With `keep_gil`, the calls that only enqueue or read a flag (event records and queries, graph
  launches, copies to and from pinned memory) keep the GIL (cuda_enqueue.py says why); every
  other call, and every call without it, releases the GIL as cuda-python does.

Importing this module never touches the driver (CI has cuda-bindings but no libcuda); the driver is
initialised when a CudaBackend is constructed.
"""
from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from gpu_worker.device.backend import (
    PORTABLE_CLUSTER_CTAS,
    TENSOR_MAP_BYTES,
    Backend,
    CaptureInvalidated,
    DeviceError,
    DeviceInfo,
    IllegalAddress,
    KernelArg,
)
from gpu_worker.device.cuda_enqueue import EnqueueCalls, PinnedSpans, handle

_driver: Any = None


def _drv() -> Any:
    global _driver
    if _driver is None:
        from cuda.bindings import driver  # lazy: see the module note

        _driver = driver
    return _driver


def check(result: Any, call: str) -> Any:
    """Unwrap a cuda-python result tuple; raise with the call's name and the driver's message."""
    d = _drv()
    err, rest = (result[0], result[1:]) if isinstance(result, tuple) else (result, ())
    if err != d.CUresult.CUDA_SUCCESS:
        _, name = d.cuGetErrorName(err)
        _, text = d.cuGetErrorString(err)
        name = name.decode() if isinstance(name, bytes) else str(err)
        text = text.decode() if isinstance(text, bytes) else ""
        msg = f"{call}: {name}: {text}"
        if err == d.CUresult.CUDA_ERROR_ILLEGAL_ADDRESS:
            raise IllegalAddress(msg)
        if err == d.CUresult.CUDA_ERROR_STREAM_CAPTURE_INVALIDATED:
            raise CaptureInvalidated(msg)
        raise DeviceError(msg)
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


def _held(err: int, call: str) -> None:
    """check() for the raw CUresult of an EnqueueCalls binding."""
    if err:
        check((_drv().CUresult(err),), call)


def cuda_device_count() -> int:
    """Number of CUDA devices, 0 when there is no driver or no device (never raises)."""
    try:
        d = _drv()
        (err,) = d.cuInit(0)
        if err != d.CUresult.CUDA_SUCCESS:
            return 0
        err, n = d.cuDeviceGetCount()
        return n if err == d.CUresult.CUDA_SUCCESS else 0
    except Exception:  # noqa: BLE001 - no libcuda at all
        return 0


DEFAULT_SHARED_BYTES = 48 << 10   # dynamic shared memory a launch may use without opting in
_pdl: Any = None


def _pdl_attribute() -> Any:
    """The launch attribute of a programmatic dependent launch (made once: it never changes)."""
    global _pdl
    if _pdl is None:
        d = _drv()
        attr = d.CUlaunchAttribute()
        attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        _pdl = attr
    return _pdl


_ARG_CTYPES = {"ptr": ctypes.c_uint64, "i32": ctypes.c_int32, "i64": ctypes.c_int64, "f32": ctypes.c_float}


class CudaBackend(Backend):
    name = "cuda"

    def __init__(self, ordinal: int = 0, keep_gil: bool = False) -> None:
        """`keep_gil`: make the calls that only enqueue without handing over the GIL."""
        d = _drv()
        check(d.cuInit(0), "cuInit")
        self._dev = check(d.cuDeviceGet(ordinal), "cuDeviceGet")
        # Retained for the life of the process on purpose: never released (DESIGN 2.1).
        self._ctx = check(d.cuDevicePrimaryCtxRetain(self._dev), "cuDevicePrimaryCtxRetain")
        self._tls = threading.local()
        self._active_clusters: dict[tuple[int, int, int], int] = {}
        self._current()
        name = check(d.cuDeviceGetName(256, self._dev), "cuDeviceGetName")
        name = name.split(b"\0", 1)[0].decode()
        raw = check(d.cuDeviceGetUuid(self._dev), "cuDeviceGetUuid").bytes
        raw = raw.encode("latin-1") if isinstance(raw, str) else bytes(raw)
        h = raw.hex().ljust(32, "0")
        uuid = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"
        total = check(d.cuDeviceTotalMem(self._dev), "cuDeviceTotalMem")
        attr = d.CUdevice_attribute
        major = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self._dev),
                      "cuDeviceGetAttribute")
        minor = check(d.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self._dev),
                      "cuDeviceGetAttribute")
        self._prop = d.CUmemAllocationProp()
        self._prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        self._prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._prop.location.id = ordinal
        granule = check(d.cuMemGetAllocationGranularity(
            self._prop, d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
            "cuMemGetAllocationGranularity")
        self._access = d.CUmemAccessDesc()
        self._access.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        self._access.location.id = ordinal
        self._access.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self.info = DeviceInfo(ordinal=ordinal, uuid=uuid, name=name, total_bytes=int(total),
                               arch=f"sm_{major}{minor}", granule_bytes=int(granule))
        self._pinned: dict[int, int] = {}  # array address -> host pointer, for cuMemFreeHost
        self._pinned_spans = PinnedSpans()
        self._enqueue = EnqueueCalls() if keep_gil else None
        self._reservations: list[tuple[int, int]] = []
        self._nvml = _nvml_handle(uuid)

    def _current(self) -> None:
        """Make the primary context current in the calling thread (once per thread)."""
        if getattr(self._tls, "ok", False):
            return
        check(_drv().cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")
        self._tls.ok = True

    # -- truth ---------------------------------------------------------------------------------
    def mem_get_info(self) -> tuple[int, int]:
        self._current()
        free, total = check(_drv().cuMemGetInfo(), "cuMemGetInfo")
        return int(free), int(total)

    def _nvml_usage(self) -> dict[int, int]:
        """pid -> device bytes of every compute process on this device; {} without NVML."""
        if self._nvml is None:
            return {}
        try:
            import pynvml

            return {p.pid: int(p.usedGpuMemory or 0)
                    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(self._nvml)}
        except Exception as exc:  # noqa: BLE001 - NVML is best effort (containers often hide pids)
            from gpu_worker.telemetry.survived import survived  # lazy: only on the fallback path

            survived("nvml_query", exc, _NVML_FALLBACK, device_uuid=self.info.uuid)
            return {}

    def process_used_bytes(self) -> int:
        return self._nvml_usage().get(os.getpid(), 0)

    def others_used_bytes(self) -> int:
        pid = os.getpid()
        return sum(used for p, used in self._nvml_usage().items() if p != pid)

    # -- VMM -----------------------------------------------------------------------------------
    def reserve(self, nbytes: int) -> int:
        self._current()
        va = int(check(_drv().cuMemAddressReserve(nbytes, 0, 0, 0), "cuMemAddressReserve"))
        self._reservations.append((va, nbytes))
        return va

    def create_physical(self, nbytes: int) -> Any:
        self._current()
        return check(_drv().cuMemCreate(nbytes, self._prop, 0), f"cuMemCreate({nbytes})")

    def map(self, va: int, handle: Any, nbytes: int) -> None:
        self._current()
        d = _drv()
        check(d.cuMemMap(va, nbytes, 0, handle, 0), f"cuMemMap({va:#x}, {nbytes})")
        try:
            check(d.cuMemSetAccess(va, nbytes, [self._access], 1), f"cuMemSetAccess({va:#x}, {nbytes})")
        except DeviceError:
            d.cuMemUnmap(va, nbytes)  # leave nothing half-mapped
            raise

    def unmap(self, va: int, nbytes: int) -> None:
        self._current()
        check(_drv().cuMemUnmap(va, nbytes), f"cuMemUnmap({va:#x}, {nbytes})")

    def release_physical(self, handle: Any) -> None:
        self._current()
        check(_drv().cuMemRelease(handle), "cuMemRelease")

    # -- streams and events --------------------------------------------------------------------
    def create_stream(self) -> Any:
        self._current()
        d = _drv()
        return check(d.cuStreamCreate(d.CUstream_flags.CU_STREAM_NON_BLOCKING), "cuStreamCreate")

    def destroy_stream(self, stream: Any) -> None:
        self._current()
        check(_drv().cuStreamDestroy(stream), "cuStreamDestroy")

    def create_event(self, timing: bool = False, blocking: bool = False) -> Any:
        self._current()
        d = _drv()
        flags = int(d.CUevent_flags.CU_EVENT_DEFAULT if timing else d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        if blocking:
            flags |= int(d.CUevent_flags.CU_EVENT_BLOCKING_SYNC)
        return check(d.cuEventCreate(flags), "cuEventCreate")

    def event_elapsed_ms(self, start: Any, end: Any) -> float:
        self._current()
        if self._enqueue is not None:
            err, ms = self._enqueue.event_elapsed(handle(start), handle(end))
            _held(err, "cuEventElapsedTime")
            return float(ms)
        return float(check(_drv().cuEventElapsedTime(start, end), "cuEventElapsedTime"))

    def destroy_event(self, event: Any) -> None:
        self._current()
        check(_drv().cuEventDestroy(event), "cuEventDestroy")

    def record_event(self, event: Any, stream: Any) -> None:
        self._current()
        if self._enqueue is not None:
            _held(self._enqueue.event_record(handle(event), handle(stream)), "cuEventRecord")
            return
        check(_drv().cuEventRecord(event, stream), "cuEventRecord")

    def stream_wait_event(self, stream: Any, event: Any) -> None:
        self._current()
        check(_drv().cuStreamWaitEvent(stream, event, 0), "cuStreamWaitEvent")

    def event_done(self, event: Any) -> bool:
        self._current()
        d = _drv()
        if self._enqueue is not None:
            err = d.CUresult(self._enqueue.event_query(handle(event)))
        else:
            (err,) = d.cuEventQuery(event)
        if err == d.CUresult.CUDA_ERROR_NOT_READY:
            return False
        check((err,), "cuEventQuery")
        return True

    def synchronize_event(self, event: Any) -> None:
        # an event that has completed needs no wait, and so no GIL hand-off
        if self._enqueue is not None and self.event_done(event):
            return
        self._current()
        check(_drv().cuEventSynchronize(event), "cuEventSynchronize")

    def synchronize_stream(self, stream: Any) -> None:
        self._current()
        check(_drv().cuStreamSynchronize(stream), "cuStreamSynchronize")

    def synchronize_context(self) -> None:
        self._current()
        check(_drv().cuCtxSynchronize(), "cuCtxSynchronize")

    # -- host memory and copies ----------------------------------------------------------------
    def alloc_pinned(self, nbytes: int) -> np.ndarray:
        self._current()
        p = int(check(_drv().cuMemHostAlloc(max(1, nbytes), 0), f"cuMemHostAlloc({nbytes})"))
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * max(1, nbytes)).from_address(p))[:nbytes]
        self._pinned[arr.ctypes.data] = p
        self._pinned_spans.add(p, nbytes)
        return arr

    def free_pinned(self, buf: np.ndarray) -> None:
        self._current()
        p = self._pinned.pop(buf.ctypes.data, None)
        if p is None:
            raise DeviceError("cuMemFreeHost: buffer was not allocated by alloc_pinned")
        self._pinned_spans.remove(p)
        check(_drv().cuMemFreeHost(p), "cuMemFreeHost")

    def copy_h2d_async(self, dst: int, src: np.ndarray, stream: Any) -> None:
        self._current()
        assert src.flags.c_contiguous, "copy_h2d_async: host source must be C-contiguous"
        if self._enqueue is not None and self._pinned_spans.holds(src.ctypes.data, src.nbytes):
            _held(self._enqueue.memcpy_htod(dst, src.ctypes.data, src.nbytes, handle(stream)),
                  "cuMemcpyHtoDAsync")
            return
        check(_drv().cuMemcpyHtoDAsync(dst, src.ctypes.data, src.nbytes, stream), "cuMemcpyHtoDAsync")

    def copy_d2h_async(self, dst: np.ndarray, src: int, stream: Any) -> None:
        self._current()
        assert dst.flags.c_contiguous, "copy_d2h_async: host destination must be C-contiguous"
        if self._enqueue is not None and self._pinned_spans.holds(dst.ctypes.data, dst.nbytes):
            _held(self._enqueue.memcpy_dtoh(dst.ctypes.data, src, dst.nbytes, handle(stream)),
                  "cuMemcpyDtoHAsync")
            return
        check(_drv().cuMemcpyDtoHAsync(dst.ctypes.data, src, dst.nbytes, stream), "cuMemcpyDtoHAsync")

    def copy_d2d_async(self, dst: int, src: int, nbytes: int, stream: Any) -> None:
        self._current()
        check(_drv().cuMemcpyDtoDAsync(dst, src, nbytes, stream), "cuMemcpyDtoDAsync")

    def memset_async(self, dst: int, byte: int, nbytes: int, stream: Any) -> None:
        self._current()
        check(_drv().cuMemsetD8Async(dst, byte & 0xFF, nbytes, stream), "cuMemsetD8Async")

    # -- modules and launches ------------------------------------------------------------------
    def load_module(self, image: bytes) -> Any:
        self._current()
        data = bytes(image)
        if not data.startswith(b"\x7fELF") and not data.endswith(b"\0"):
            data += b"\0"  # PTX text must be NUL-terminated
        d = _drv()
        module = check(d.cuModuleLoadData(data), "cuModuleLoadData")
        # Under lazy loading (the CUDA 12+ default) a kernel's code reaches the device at its first
        # launch, outside any measurement; load every function now, so that Device.load_module
        # sees and books what the module costs.
        count = check(d.cuModuleGetFunctionCount(module), "cuModuleGetFunctionCount")
        if count:
            functions = check(d.cuModuleEnumerateFunctions(count, module),
                              "cuModuleEnumerateFunctions")
            for function in functions:
                check(d.cuFuncLoad(function), "cuFuncLoad")
        return module

    def unload_module(self, module: Any) -> None:
        self._current()
        check(_drv().cuModuleUnload(module), "cuModuleUnload")
        self._active_clusters.clear()   # a later function may reuse an unloaded one's handle

    def get_function(self, module: Any, name: str) -> Any:
        self._current()
        return check(_drv().cuModuleGetFunction(module, name.encode()), f"cuModuleGetFunction({name})")

    def launch(
        self,
        function: Any,
        grid: tuple[int, int, int],
        block: tuple[int, int, int],
        args: Sequence[KernelArg],
        stream: Any,
        shared_bytes: int = 0,
        cluster: tuple[int, int, int] | None = None,
        pdl: bool = False,
    ) -> None:
        self._current()
        d = _drv()
        vals = [(ctypes.c_uint8 * TENSOR_MAP_BYTES).from_buffer_copy(a.value) if a.kind == "tmap"
                else _ARG_CTYPES[a.kind](a.value) for a in args]
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        if shared_bytes > DEFAULT_SHARED_BYTES:  # a function attribute, not a stream operation
            check(d.cuFuncSetAttribute(
                function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared_bytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
        # The launch copies the argument values (also into a graph node), so `vals` may die after.
        attrs = []
        if cluster is not None and cluster[0] * cluster[1] * cluster[2] > PORTABLE_CLUSTER_CTAS:
            check(d.cuFuncSetAttribute(   # 9..16 CTAs (sm_90): a function attribute, opt-in
                function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                1), "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")
        if cluster is not None and cluster != (1, 1, 1):
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = cluster
            attrs.append(attr)
        if pdl:
            attrs.append(_pdl_attribute())
        if not attrs:
            check(d.cuLaunchKernel(function, *grid, *block, shared_bytes, stream,
                                   ctypes.addressof(params), 0), "cuLaunchKernel")
            return
        config = d.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block
        config.sharedMemBytes = shared_bytes
        config.hStream = stream
        config.attrs = attrs
        config.numAttrs = len(attrs)
        check(d.cuLaunchKernelEx(config, function, ctypes.addressof(params), 0), "cuLaunchKernelEx")

    def tensor_map(self, address: int, sizes: tuple[int, ...], strides: tuple[int, ...],
                   box: tuple[int, ...], element_bytes: int = 2, swizzle: int = 128) -> bytes:
        d = _drv()
        t, sw = d.CUtensorMapDataType, d.CUtensorMapSwizzle
        m = check(d.cuTensorMapEncodeTiled(
            t.CU_TENSOR_MAP_DATA_TYPE_FLOAT16 if element_bytes == 2 else t.CU_TENSOR_MAP_DATA_TYPE_UINT64,
            len(sizes), address,
            [d.cuuint64_t(n) for n in sizes], [d.cuuint64_t(b) for b in strides],
            [d.cuuint32_t(b) for b in box], [d.cuuint32_t(1)] * len(sizes),
            d.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
            sw.CU_TENSOR_MAP_SWIZZLE_128B if swizzle else sw.CU_TENSOR_MAP_SWIZZLE_NONE,
            d.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            d.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE), "cuTensorMapEncodeTiled")
        return ctypes.string_at(m.getPtr(), TENSOR_MAP_BYTES)

    def max_active_clusters(self, function: Any, threads: int, ctas: int,
                            shared_bytes: int = 0) -> int:
        key = (int(function), threads, ctas, shared_bytes)
        if key not in self._active_clusters:   # a property of the function: asked once
            self._current()
            d = _drv()
            if shared_bytes > DEFAULT_SHARED_BYTES:   # as the launch sets it
                check(d.cuFuncSetAttribute(
                    function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared_bytes), "cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES)")
            if ctas > PORTABLE_CLUSTER_CTAS:
                check(d.cuFuncSetAttribute(
                    function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED,
                    1), "cuFuncSetAttribute(NON_PORTABLE_CLUSTER_SIZE_ALLOWED)")
            attr = d.CUlaunchAttribute()
            attr.id = d.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
            attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = ctas, 1, 1
            config = d.CUlaunchConfig()
            config.gridDimX, config.gridDimY, config.gridDimZ = ctas, 1, 1
            config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
            config.sharedMemBytes = shared_bytes
            config.attrs = [attr]
            config.numAttrs = 1
            self._active_clusters[key] = int(check(d.cuOccupancyMaxActiveClusters(function, config),
                                                   "cuOccupancyMaxActiveClusters"))
        return self._active_clusters[key]

    def set_shared_carveout(self, function: Any, percent: int) -> None:
        self._current()
        d = _drv()
        check(d.cuFuncSetAttribute(
            function, d.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            percent), "cuFuncSetAttribute(PREFERRED_SHARED_MEMORY_CARVEOUT)")

    # -- graphs --------------------------------------------------------------------------------
    def begin_capture(self, stream: Any) -> None:
        self._current()
        d = _drv()
        check(d.cuStreamBeginCapture(stream, d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
              "cuStreamBeginCapture")

    def end_capture(self, stream: Any) -> Any:
        self._current()
        return check(_drv().cuStreamEndCapture(stream), "cuStreamEndCapture")

    def is_capturing(self, stream: Any) -> bool:
        self._current()
        d = _drv()
        status = check(d.cuStreamIsCapturing(stream), "cuStreamIsCapturing")
        return status != d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE

    def instantiate(self, graph: Any) -> Any:
        self._current()
        return check(_drv().cuGraphInstantiate(graph, 0), "cuGraphInstantiate")

    def launch_graph(self, graph_exec: Any, stream: Any) -> None:
        self._current()
        if self._enqueue is not None:
            _held(self._enqueue.graph_launch(handle(graph_exec), handle(stream)), "cuGraphLaunch")
            return
        check(_drv().cuGraphLaunch(graph_exec, stream), "cuGraphLaunch")

    def destroy_graph(self, graph: Any) -> None:
        self._current()
        check(_drv().cuGraphDestroy(graph), "cuGraphDestroy")

    def destroy_graph_exec(self, graph_exec: Any) -> None:
        self._current()
        check(_drv().cuGraphExecDestroy(graph_exec), "cuGraphExecDestroy")

    def close(self) -> None:
        self._current()
        d = _drv()
        for va, n in self._reservations:
            d.cuMemAddressFree(va, n)  # best effort: everything in it was unmapped by the arena
        self._reservations.clear()


# What falling back changes: without per-process figures, others_used_bytes() is 0, so the context
# baseline the Device books (device used at start minus other processes) also counts every other
# process's memory on the card, and process_used_bytes() reports 0 to the governor.
_NVML_FALLBACK = ("NVML per-process memory unavailable: the context baseline now includes other "
                  "processes' device memory and process_used_bytes reports 0")


def _nvml_handle(uuid: str) -> Any:
    try:
        import pynvml

        pynvml.nvmlInit()
        return pynvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception as exc:  # noqa: BLE001 - NVML is optional (pynvml missing, no permission)
        from gpu_worker.telemetry.survived import survived

        survived("nvml_unavailable", exc, _NVML_FALLBACK, device_uuid=uuid)
        return None
