"""What every kernel module shares: the KernelDef record, the common CUDA header, launch helpers.

A `KernelDef` is one `extern "C"` entry point. Several defs may share one `KernelSource` (one NVRTC
module per kernel family), so the executor compiles and loads a module once and looks up each entry
with `device.get_function(module, kdef.entry)`.

CUDA C lives in kernels/cu/: one `.cu` per family (its NVRTC module) and `.cuh` headers. A module's
KernelSource carries every header the `.cu` reaches by a quoted #include (cu_headers), so each one
enters the module's cache key: editing a header recompiles every module that includes it.

Pointers are plain ints (device virtual addresses); 0 stands for a null (optional) pointer.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from gpu_worker.device.backend import SIM_SM_COUNT
from services.common.errors import InvalidArgument

try:  # the compile package's public surface
    from gpu_worker.compile import KernelSource
except ImportError:  # its __init__ may not export it yet; the dataclass itself lives here
    from gpu_worker.compile.source import KernelSource

THREADS = 256            # threads per block for every kernel (8 warps)
GRID_1D_PER_SM = 32      # grid-stride kernels: ~32 blocks per SM is plenty to saturate HBM
NVRTC_OPTIONS = ("--std=c++17", "-lineinfo")  # -lineinfo: compute-sanitizer names source lines

COMMON_HEADER_NAME = "gpuplane_common.cuh"
CU_DIR = Path(__file__).resolve().parent / "cu"   # every kernel's CUDA C: *.cu modules, *.cuh headers
_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def _cu_text(name: str) -> str:
    path = CU_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"kernel source {name!r} is not in {CU_DIR}: every quoted "
                                f"#include must name a file there")
    return path.read_text(encoding="utf-8")


def cu_headers(text: str) -> dict[str, str]:
    """Every header `text` includes by a quoted #include, transitively, by name -> content: all
    of them go into the KernelSource (hence the cache key), so editing any header recompiles
    every module that reaches it."""
    found: dict[str, str] = {}
    todo = _INCLUDE.findall(text)
    while todo:
        name = todo.pop()
        if name not in found:
            found[name] = _cu_text(name)
            todo.extend(_INCLUDE.findall(found[name]))
    return found


def cu_source(module_name: str, filename: str) -> KernelSource:
    """The NVRTC module of kernels/cu/`filename`, with every header it includes."""
    text = _cu_text(filename)
    return KernelSource(module_name=module_name, source=text, headers=cu_headers(text),
                        options=NVRTC_OPTIONS)


COMMON_HEADER = _cu_text(COMMON_HEADER_NAME)


def _no_workspace(**_shapes: int) -> int:
    return 0


@dataclass(frozen=True, eq=False)  # identity equality: defs are module-level singletons
class KernelDef:
    """One kernel entry point of the library.

    `reference` is the NumPy oracle (gpu_worker.kernels.reference), `launcher` the typed
    `launch_<name>(device, function, ..., stream=None)`, `workspace` maps the kernel's shapes
    (keywords named in its module) to the device scratch bytes a caller must provide; `arches`
    limits an arch-specific module (sm_90a's wgmma) to the devices that load it.
    """

    name: str
    entry: str
    source: KernelSource
    reference: Callable[..., object]
    launcher: Callable[..., None]
    workspace: Callable[..., int] = field(default=_no_workspace)
    arches: tuple[str, ...] = ()   # the device archs its module loads on (empty: every arch)

    def loads_on(self, arch: str) -> bool:
        return not self.arches or arch in self.arches

    def workspace_bytes(self, **shapes: int) -> int:
        """Device scratch this kernel needs for these shapes (0 when it needs none)."""
        return int(self.workspace(**shapes))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


_SM_COUNTS: dict[tuple[str, int], int] = {}


def sm_count(device) -> int:
    """The device's multiprocessor count, read from the driver once per (backend, ordinal)
    (cuDeviceGetAttribute needs no context and is safe while a stream captures)."""
    backend = getattr(device, "backend", device)
    key = (getattr(backend, "name", "?"), int(device.info.ordinal))
    if key not in _SM_COUNTS:
        if key[0] == "cuda":
            from cuda.bindings import driver as d

            from gpu_worker.device.cuda_backend import check

            dev = check(d.cuDeviceGet(key[1]), "cuDeviceGet")
            _SM_COUNTS[key] = int(check(d.cuDeviceGetAttribute(
                d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dev),
                "cuDeviceGetAttribute"))
        else:
            _SM_COUNTS[key] = SIM_SM_COUNT
    return _SM_COUNTS[key]


def max_grid_1d(device) -> int:
    return GRID_1D_PER_SM * sm_count(device)


def grid_1d(device, n: int) -> tuple[int, int, int]:
    """A grid for a grid-stride loop over `n` items on `device`."""
    return (max(1, min(ceil_div(n, THREADS), max_grid_1d(device))), 1, 1)


BLOCK = (THREADS, 1, 1)


def require(condition: bool, message: str) -> None:
    """Launcher argument checks: a bad shape is refused before anything reaches the device."""
    if not condition:
        raise InvalidArgument(message)


def require_sizes(kernel: str, **sizes: int) -> None:
    for name, value in sizes.items():
        require(isinstance(value, int) and 0 <= value < 2**31,
                f"{kernel}: {name}={value!r} must be an int in [0, 2**31)")
