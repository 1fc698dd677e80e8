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


def test_the_wtma_build_copies_a_stage_by_four_tma_boxes_and_no_thread_copies() -> None:
    """GP_WG_WTMA: in the tiled entry no thread copies weights (16-byte cp.async) or scales
    (8-byte cp.async) any more; two more TMA boxes an issue (the tiles' weights and scales)
    take their place beside x's two; the reference-layout entry is untouched, and neither
    spills."""
    import re

    from gpu_worker.kernels.int4_batched import wgmma_build

    stages = 6
    issues = stages - 2 + 1   # GP_WG_AHEAD prologue issues and the loop's

    def entries(wtma: bool) -> dict[str, tuple[int, int, int]]:
        s = wgmma_build(stages, 4, wtma=wtma, tiled=True).source
        out = compile_program(s.module_name, s.source, s.headers, "sm_90a",
                              (*s.options, "--ptxas-options=-v"))
        log = out.log if isinstance(out.log, str) else out.log.decode()
        assert set(re.findall(r"(\d+) bytes spill stores", log)) == {"0"}, log
        ptx = out.ptx.decode()
        found = {}
        for name, body in re.findall(r"\.entry (\w+)\((.*?)(?=\.entry|\Z)", ptx, re.DOTALL):
            found[name] = tuple(len(re.findall(p, body)) for p in (
                r"cp\.async\.cg\.shared\.global", r"cp\.async\.ca\.shared\.global",
                r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global"))
        return found
    plain, wtma = entries(False), entries(True)
    assert wtma["gp_int4_wgmma"] == plain["gp_int4_wgmma"], "the reference-layout entry changed"
    assert wtma["gp_int4_wgmma_tiled"] == (0, 0, 4 * issues), (plain, wtma)
    assert plain["gp_int4_wgmma_tiled"] == (2 * issues, issues, 2 * issues), plain


def test_a_threads_wgmma_copies_are_addressed_once_and_x_is_two_tma_boxes() -> None:
    """The k-group loop of gp_int4_wgmma issues each of a thread's pieces as one cp.async from a
    source addressed before the loop (GpWgCopies): 2 weight blocks (16-byte) and one row's
    scales (8-byte) a k-group, at each of the AHEAD unrolled prologue issues and the loop's
    one; x is two TMA boxes an issue, not 1,024 cp.async a CTA. The loops over a thread's
    copies the first replaced recomputed every 64-bit source each k-group: 840 SASS
    instructions a k-group against 289 (docs/kernels.md)."""
    import re

    from gpu_worker.kernels.int4_batched import wgmma_build

    stages = 6
    s = wgmma_build(stages, 4, tiled=True).source
    ptx = compile_program(s.module_name, s.source, s.headers, "sm_90a", s.options).ptx.decode()
    issues = stages - 2 + 1   # GP_WG_AHEAD prologue issues and the loop's
    for name, body in re.findall(r"\.entry (\w+)\((.*?)(?=\.entry|\Z)", ptx, re.DOTALL):
        cg = len(re.findall(r"cp\.async\.cg\.shared\.global", body))
        ca = len(re.findall(r"cp\.async\.ca\.shared\.global", body))
        tma = len(re.findall(r"cp\.async\.bulk\.tensor\.2d\.shared::cluster\.global", body))
        assert (cg, ca, tma) == (issues * 2, issues, issues * 2), (name, cg, ca, tma)


def test_the_32_row_build_runs_m64n32k16_on_half_the_x_bytes_without_spilling() -> None:
    """wgmma_build(x_rows=32): every wgmma is m64n32k16 (16 accumulators a thread, not 32), a
    stage's x is two 4 KiB boxes, and neither entry spills."""
    import re

    from gpu_worker.kernels.int4_batched import wgmma_build, wgmma_shared_bytes

    s = wgmma_build(4, 2, tiled=True, x_rows=32).source
    out = compile_program(s.module_name, s.source, s.headers, "sm_90a",
                          (*s.options, "--ptxas-options=-v"))
    log = out.log if isinstance(out.log, str) else out.log.decode()
    assert set(re.findall(r"(\d+) bytes spill stores", log)) == {"0"}, log
    ptx = out.ptx.decode()
    assert "m64n32k16" in ptx and "m64n64k16" not in ptx
    assert wgmma_shared_bytes(4, 2) - wgmma_shared_bytes(4, 2, x_rows=32) == 4 * 8192
