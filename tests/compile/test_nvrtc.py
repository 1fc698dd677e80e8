"""Real NVRTC (no GPU needed): artifacts, headers, options, and errors that say what failed."""

from __future__ import annotations

import re

import pytest

from gpu_worker.compile.nvrtc import NvrtcError, compile_program, nvrtc_version, validate_arch
from services.common.errors import InvalidArgument

SOURCE = """
#include "scale.h"
extern "C" __global__ void scale(float* x, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= SCALE;
}
"""
HEADERS = {"scale.h": "#ifndef SCALE\n#define SCALE 3.0f\n#endif\n"}


def test_nvrtc_compiles_a_kernel_to_sm90_ptx_and_an_elf_cubin() -> None:
    out = compile_program("scale_mod", SOURCE, HEADERS, "sm_90", ())
    ptx = out.ptx.decode()
    assert ".target sm_90" in ptx, "PTX was not generated for sm_90"
    assert ".entry scale(" in ptx, 'the extern "C" entry is missing from the PTX'
    assert out.ptx.endswith(b"\0"), "cuModuleLoadData needs NUL-terminated PTX"
    assert out.cubin[:4] == b"\x7fELF", "the CUBIN is not an ELF image"
    assert out.seconds > 0, "compile time must be measured"


def test_included_headers_and_options_reach_nvrtc() -> None:
    default = compile_program("scale_mod", SOURCE, HEADERS, "sm_90", ()).ptx
    defined = compile_program("scale_mod", SOURCE, HEADERS, "sm_90", ("-DSCALE=5.0f",)).ptx
    # 3.0f = 0f40400000, 5.0f = 0f40A00000 in PTX's hex float spelling.
    assert b"0f40400000" in default and b"0f40A00000" in defined, "the -D option did not apply"


def test_compile_error_names_the_module_and_carries_the_nvrtc_log() -> None:
    bad = 'extern "C" __global__ void broken(float* x) { x[0] = not_declared_anywhere; }'
    with pytest.raises(NvrtcError) as info:
        compile_program("broken_mod", bad, {}, "sm_90", ())
    message = str(info.value)
    assert "broken_mod" in message, "the error does not name the module"
    assert "not_declared_anywhere" in message and "undefined" in message, "the NVRTC log is missing"
    assert "NVRTC_ERROR_COMPILATION" in message, "the NVRTC status is missing"
    assert info.value.module_name == "broken_mod" and "not_declared_anywhere" in info.value.log


def test_a_missing_header_is_a_compile_error_with_the_log() -> None:
    with pytest.raises(NvrtcError, match="nowhere.h"):
        compile_program("needs_header", '#include "nowhere.h"\n', {}, "sm_90", ())


def test_nvrtc_version_is_major_dot_minor() -> None:
    assert re.fullmatch(r"\d+\.\d+", nvrtc_version()), nvrtc_version()


@pytest.mark.parametrize("arch", ["sm_1", "compute_90", "", "sm90", "sm_9000"])
def test_an_arch_nvrtc_cannot_build_is_refused_with_the_supported_list(arch: str) -> None:
    with pytest.raises(InvalidArgument, match="sm_90"):
        validate_arch(arch)
