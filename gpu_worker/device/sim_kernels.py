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
from typing import Protocol

import numpy as np

from gpu_worker.device.backend import KernelArg

# SimBackend.tensor_map_2d's encoding: address, inner, outer, row bytes, box (inner, outer),
# element bytes, swizzle
SIM_TENSOR_MAP = "<QQQQIIII"


def sim_tensor_map(value: bytes) -> tuple[int, int, int, int, tuple[int, int], int, int]:
    """(address, inner, outer, row_bytes, box, element_bytes, swizzle) of a sim tensor map (a
    "tmap" argument)."""
    address, inner, outer, row_bytes, b0, b1, element_bytes, swizzle = struct.unpack_from(
        SIM_TENSOR_MAP, value)
    return address, inner, outer, row_bytes, (b0, b1), element_bytes, swizzle


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
