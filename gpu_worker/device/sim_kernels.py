"""Registry of NumPy kernels the `sim` backend runs in place of NVRTC images.

A kernel library registers one function per extern "C" entry name:

    @register_sim_kernel("add_one")
    def add_one(mem, grid, block, args):
        n = args[1].value
        x = mem.view(args[0].value, n)   # raises IllegalAddress if any byte is unmapped
        x += 1

`mem.view(ptr, nbytes)` is a writable np.uint8 view over simulated device memory. The sim runs the
function on the stream's worker thread when the launch reaches the head of the stream.
"""
from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

import numpy as np

from gpu_worker.device.backend import KernelArg

# SimBackend.tensor_map's encoding: address, rank, element bytes, swizzle, then sizes (5),
# strides (4) and box (5), zero past the rank
SIM_TENSOR_MAP = "<QIII5Q4Q5I"


class SimTensorMap(NamedTuple):
    address: int
    sizes: tuple[int, ...]     # innermost first
    strides: tuple[int, ...]   # bytes, dimensions 1..
    box: tuple[int, ...]
    element_bytes: int
    swizzle: int


def sim_tensor_map(value: bytes) -> SimTensorMap:
    """The fields of a sim tensor map (a "tmap" argument)."""
    f = struct.unpack_from(SIM_TENSOR_MAP, value)
    address, rank, element_bytes, swizzle = f[:4]
    sizes, strides, box = f[4:9], f[9:13], f[13:18]
    return SimTensorMap(address, tuple(sizes[:rank]), tuple(strides[:rank - 1]), tuple(box[:rank]),
                        element_bytes, swizzle)


class SimMemory(Protocol):
    def view(self, ptr: int, nbytes: int) -> np.ndarray: ...


SimKernel = Callable[[SimMemory, tuple[int, int, int], tuple[int, int, int], Sequence[KernelArg]], None]

_REGISTRY: dict[str, SimKernel] = {}
_LOCK = threading.Lock()


def register_sim_kernel(entry: str) -> Callable[[SimKernel], SimKernel]:
    """Decorator: run `fn` when the sim launches the function named `entry`."""

    def deco(fn: SimKernel) -> SimKernel:
        with _LOCK:
            _REGISTRY[entry] = fn
        return fn

    return deco


def lookup_sim_kernel(entry: str) -> SimKernel | None:
    with _LOCK:
        return _REGISTRY.get(entry)
