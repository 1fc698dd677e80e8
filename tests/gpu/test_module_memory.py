"""GPU: the device memory the driver takes for loaded modules is booked, not left unaccounted."""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

MIB = 1 << 20


def test_loading_the_kernel_library_books_what_the_driver_takes_for_it(tmp_path):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import Device
    from gpu_worker.device.cuda_backend import CudaBackend
    from gpu_worker.kernels import ALL_SOURCES

    d = Device(CudaBackend(0))
    try:
        compiler = KernelCompiler(d.info.arch, cache_dir=tmp_path)
        images = [compiler.compile(src).cubin for src in ALL_SOURCES]  # NVRTC before measuring
        unaccounted0 = d.unaccounted_bytes()
        context0 = d.ledger.snapshot()["context"][0]
        # The driver takes module memory in 2 MiB chunks, so one library load may fit in a chunk
        # it already holds; eight copies (56 modules) must take new chunks.
        modules = [d.load_module(image) for _ in range(8) for image in images]
        grown = d.ledger.snapshot()["context"][0] - context0
        drift = d.unaccounted_bytes() - unaccounted0
        print(f"\nmodules booked {grown / MIB:.1f} MiB; unaccounted moved {drift / MIB:+.1f} MiB")
        assert grown > 0, "56 module loads booked no device memory: the driver's share is missed"
        assert abs(drift) <= 2 * MIB, f"module loads left {drift / MIB:.1f} MiB unaccounted"
        for module in modules:
            d.unload_module(module)
        assert d.ledger.snapshot()["context"][0] == context0, "unloading must return the booking"
    finally:
        d.close()
