"""NVRTC: CUDA C source to PTX and CUBIN, through `cuda.bindings.nvrtc`. Needs no GPU.

One compile for a real arch (`--gpu-architecture=sm_90`) yields both artifacts: the CUBIN for
exactly that arch (loads in ~70 us) and the PTX (portable to newer archs, JIT-compiled by the driver
at load, ~100 ms per module on an H200). Every NVRTC call goes through `_check`, so a failure always
names the call, the module and the arch, and a compile failure carries NVRTC's log.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cuda.bindings import nvrtc

from services.common.errors import GpuplaneError, InvalidArgument

_ARCH_RE = re.compile(r"^sm_(\d+)[af]?$")


class NvrtcError(GpuplaneError):
    """NVRTC refused a module. A bug in the kernel source, so INTERNAL at the gRPC edge."""

    code = "INTERNAL"

    def __init__(self, message: str, *, module_name: str, arch: str, log: str, result: str) -> None:
        super().__init__(message, module_name=module_name, arch=arch, result=result)
        self.module_name = module_name
        self.arch = arch
        self.log = log
        self.result = result


@dataclass(frozen=True)
class NvrtcOutput:
    ptx: bytes  # NUL-terminated PTX text, as cuModuleLoadData wants it
    cubin: bytes  # ELF image for exactly the compile arch
    log: str  # NVRTC's warnings (empty when clean)
    seconds: float  # wall time of create + compile + fetch


def _result_name(result: object) -> str:
    err, text = nvrtc.nvrtcGetErrorString(result)
    return text.decode() if err == nvrtc.nvrtcResult.NVRTC_SUCCESS else str(result)


def _check(result: object, call: str, module_name: str, arch: str, log: str = "") -> None:
    if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        name = _result_name(result)
        detail = f"\n--- NVRTC log ---\n{log.rstrip()}" if log.strip() else ""
        raise NvrtcError(
            f"NVRTC {call} failed for module {module_name!r} ({arch}): {name}{detail}",
            module_name=module_name,
            arch=arch,
            log=log,
            result=name,
        )


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> str:
    """The NVRTC library's "major.minor" (e.g. "13.0"); part of every cache key."""
    err, major, minor = nvrtc.nvrtcVersion()
    _check(err, "nvrtcVersion", "-", "-")
    return f"{major}.{minor}"


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[str, ...]:
    """The real archs this NVRTC can emit CUBIN for, as "sm_NN" strings."""
    err, archs = nvrtc.nvrtcGetSupportedArchs()
    _check(err, "nvrtcGetSupportedArchs", "-", "-")
    return tuple(f"sm_{a}" for a in archs)


def validate_arch(arch: str) -> str:
    """`arch` if NVRTC can build a CUBIN for it, else InvalidArgument naming the ones it can."""
    m = _ARCH_RE.match(arch or "")
    if not m or f"sm_{m.group(1)}" not in supported_archs():
        raise InvalidArgument(
            f"arch {arch!r} is not a real arch NVRTC {nvrtc_version()} supports; "
            f"use one of {', '.join(supported_archs())}"
        )
    return arch


def arch_options(arch: str) -> list[str]:
    """The options the compiler adds by itself (covered by KEY_SCHEMA_VERSION, not by the key)."""
    return [f"--gpu-architecture={arch}"]


def _program_log(prog: object) -> str:
    err, size = nvrtc.nvrtcGetProgramLogSize(prog)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS or size <= 1:
        return ""
    buf = b" " * size
    (err,) = nvrtc.nvrtcGetProgramLog(prog, buf)
    return (
        buf.rstrip(b"\0").decode("utf-8", "replace")
        if err == nvrtc.nvrtcResult.NVRTC_SUCCESS
        else ""
    )


def compile_program(
    module_name: str,
    source: str,
    headers: Mapping[str, str],
    arch: str,
    options: Sequence[str],
) -> NvrtcOutput:
    """Compile one translation unit for `arch`; raises NvrtcError with NVRTC's log on failure."""
    start = time.perf_counter()
    names = [n.encode() for n in headers]
    contents = [headers[n].encode() for n in headers]
    err, prog = nvrtc.nvrtcCreateProgram(
        source.encode(), f"{module_name}.cu".encode(), len(names), contents, names
    )
    _check(err, "nvrtcCreateProgram", module_name, arch)
    try:
        opts = [o.encode() for o in (*arch_options(arch), *options)]
        (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
        log = _program_log(prog)
        _check(err, "nvrtcCompileProgram", module_name, arch, log)
        err, ptx_size = nvrtc.nvrtcGetPTXSize(prog)
        _check(err, "nvrtcGetPTXSize", module_name, arch)
        ptx = b" " * ptx_size
        (err,) = nvrtc.nvrtcGetPTX(prog, ptx)
        _check(err, "nvrtcGetPTX", module_name, arch)
        err, cubin_size = nvrtc.nvrtcGetCUBINSize(prog)
        _check(err, "nvrtcGetCUBINSize", module_name, arch)
        cubin = b" " * cubin_size
        (err,) = nvrtc.nvrtcGetCUBIN(prog, cubin)
        _check(err, "nvrtcGetCUBIN", module_name, arch)
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if not ptx.endswith(b"\0"):
        ptx += b"\0"
    return NvrtcOutput(ptx=ptx, cubin=cubin, log=log, seconds=time.perf_counter() - start)
