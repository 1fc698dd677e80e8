"""NVRTC compilation with a stable cache key and two cache tiers (DESIGN 2.4).

from gpu_worker.compile import KernelSource, KernelCompiler, CompiledModule
"""

from gpu_worker.compile.compiler import CompiledModule, KernelCompiler
from gpu_worker.compile.nvrtc import NvrtcError, nvrtc_version
from gpu_worker.compile.source import KernelSource

__all__ = ["CompiledModule", "KernelCompiler", "KernelSource", "NvrtcError", "nvrtc_version"]
