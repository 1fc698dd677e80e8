"""The kernel library's sources: real NVRTC for sm_90, one KernelDef per entry, a sim per entry."""
from __future__ import annotations

import re

import pytest

from gpu_worker import kernels
from gpu_worker.compile.key import artifact_key
from gpu_worker.compile.nvrtc import compile_program, nvrtc_version
from gpu_worker.device.sim_kernels import lookup_sim_kernel
from gpu_worker.kernels import ALL_KERNELS, ALL_SOURCES, COMMON_HEADER_NAME

_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+(?:void\s+)?(?:(?:__launch_bounds__|__maxnreg__)\([^)]*\)\s+)?'
                    r'(?:void\s+)?(\w+)\s*\(')


@pytest.fixture(scope="module")
def compiled() -> dict:
    return {s.module_name: compile_program(s.module_name, s.source, s.headers, "sm_90", s.options)
            for s in ALL_SOURCES}


def test_every_kernel_module_compiles_with_nvrtc_for_sm_90_to_ptx_and_cubin(compiled) -> None:
    for kdef in ALL_KERNELS:
        out = compiled[kdef.source.module_name]
        assert f".entry {kdef.entry}(".encode() in out.ptx, \
            f"{kdef.name}: entry {kdef.entry} missing from the PTX of {kdef.source.module_name}"
        assert out.cubin[:4] == b"\x7fELF", f"{kdef.source.module_name}: CUBIN is not an ELF image"
        assert kdef.entry.encode() in out.cubin, f"{kdef.name}: {kdef.entry} missing from the CUBIN"


def test_every_extern_c_kernel_in_the_sources_has_exactly_one_kernel_def() -> None:
    entries = [k.entry for k in ALL_KERNELS]
    assert len(entries) == len(set(entries)), "two KernelDefs share an entry point"
    assert len({k.name for k in ALL_KERNELS}) == len(ALL_KERNELS), "two KernelDefs share a name"
    in_sources = {m for s in ALL_SOURCES for m in _ENTRY.findall(s.source)}
    assert in_sources == set(entries), (
        f"kernels without a KernelDef: {sorted(in_sources - set(entries))}; "
        f"KernelDefs without a kernel: {sorted(set(entries) - in_sources)}")


def test_every_entry_has_a_sim_implementation_registered() -> None:
    missing = [k.entry for k in ALL_KERNELS if lookup_sim_kernel(k.entry) is None]
    assert not missing, f"entries the sim backend cannot launch: {missing}"


def test_every_kernel_def_names_a_reference_and_a_launcher() -> None:
    for k in ALL_KERNELS:
        assert callable(k.reference) and callable(k.launcher), f"{k.name}: reference/launcher missing"
        assert k.launcher.__name__ == f"launch_{k.name}", \
            f"{k.name}: launcher is {k.launcher.__name__}, expected launch_{k.name}"
        assert getattr(kernels, k.launcher.__name__) is k.launcher, \
            f"{k.launcher.__name__} is not exported by gpu_worker.kernels"


def test_every_header_travels_with_its_modules_and_enters_their_cache_keys() -> None:
    """Every module reaches the common header; editing any header a module includes (directly or
    through another header) changes that module's cache key."""
    for s in ALL_SOURCES:
        assert COMMON_HEADER_NAME in s.headers, f"{s.module_name}: common header not passed to NVRTC"
        fields = {"module_name": s.module_name, "source": s.source, "arch": "sm_90",
                  "options": s.options, "kind": "cubin", "nvrtc_version": nvrtc_version()}
        for name in s.headers:
            edited = dict(s.headers, **{name: s.headers[name] + "\n"})
            assert artifact_key(headers=s.headers, **fields) != artifact_key(headers=edited, **fields), \
                f"{s.module_name}: editing {name} does not change the cache key"


def test_the_cuda_source_lives_in_cu_files_and_every_one_is_a_module_or_a_header() -> None:
    """kernels/cu/ holds all the CUDA C: each module's source is its .cu file's text, the headers
    its .cu reaches are the .cuh files' text, and no file there is unused."""
    from gpu_worker.kernels.common import CU_DIR, cu_headers

    texts = {f.name: f.read_text() for f in CU_DIR.iterdir() if f.suffix in (".cu", ".cuh")}
    used_cu = {n for n, t in texts.items() for s in ALL_SOURCES if s.source == t and n.endswith(".cu")}
    used_h = {n for s in ALL_SOURCES for n in s.headers}
    assert len(used_cu) == len(ALL_SOURCES), "a module's source is not the text of a .cu file"
    assert used_cu | used_h == set(texts), f"unused kernel sources: {set(texts) - used_cu - used_h}"
    for s in ALL_SOURCES:
        assert dict(s.headers) == cu_headers(s.source), f"{s.module_name}: headers != its includes"
        assert all(s.headers[n] == texts[n] for n in s.headers)


def test_no_kernel_module_sizes_a_grid_by_a_constant_sm_count() -> None:
    """The SM count comes from the device (common.sm_count), not from a literal 132."""
    import re
    from pathlib import Path

    root = Path(kernels.__file__).parent
    for f in sorted(root.glob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            code = line.split("#")[0]
            assert not re.search(r"(?<![\w.])132(?![\w.])", code) or "SIM_SM_COUNT" in code, \
                f"{f.name}:{i}: a literal 132 (read the SM count from the device): {line.strip()}"


def test_all_sources_lists_each_module_once_and_covers_every_kernel() -> None:
    names = [s.module_name for s in ALL_SOURCES]
    assert len(names) == len(set(names)), f"a module is listed twice: {names}"
    assert {k.source.module_name for k in ALL_KERNELS} == set(names)


def test_public_surface_is_exported() -> None:
    for name in kernels.__all__:
        assert hasattr(kernels, name), f"gpu_worker.kernels.__all__ names {name} but lacks it"
