"""NVRTC 13.0 builds the wgmma probe (tests/gpu/wgmma_probe.cu) for sm_90a to CUBIN with no GPU,
and refuses it for plain sm_90: the CPU half of the wgmma question (the GPU half, whether
the driver loads and runs it, is tests/gpu/test_wgmma_sm90a.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from gpu_worker.compile.nvrtc import NvrtcError, compile_program

SOURCE = (Path(__file__).parents[1] / "gpu" / "wgmma_probe.cu").read_text()


def test_nvrtc_compiles_a_wgmma_kernel_for_sm_90a_to_ptx_and_cubin() -> None:
    out = compile_program("wgmma_probe", SOURCE, {}, "sm_90a", ("--std=c++17",))
    assert b".target sm_90a" in out.ptx and b"wgmma.mma_async" in out.ptx
    assert out.cubin[:4] == b"\x7fELF" and b"gp_wgmma_probe" in out.cubin


def test_plain_sm_90_refuses_wgmma() -> None:
    """Negative control: the instruction exists only for the arch-specific target."""
    with pytest.raises(NvrtcError, match="wgmma"):
        compile_program("wgmma_probe", SOURCE, {}, "sm_90", ("--std=c++17",))
