"""Programmatic dependent launch: a kernel launched with pdl=True may start while the previous
kernel still runs, so it must wait for it itself (gp_pdl_wait in gpuplane_common.cuh). These
tests hold that contract on the sources and on what the decode path really launches; the tokens
with and without it are compared on the device (tests/gpu/test_batching.py)."""
from __future__ import annotations

import re

import pytest

from gpu_worker.device import Device
from gpu_worker.device.sim_backend import SimBackend
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels import ALL_KERNELS, ALL_SOURCES
from gpu_worker.kernels.common import cu_headers
from gpu_worker.models.configs import CONFIGS
from gpu_worker.models.paged import PagedDecoderModel
from tests.sim_fixtures import compiler, device, kernel_cache_dir  # noqa: F401

_WAITS = ("gp_pdl_wait", "GP_PDL_ENTRY")
_ATTRIBUTES = {"__launch_bounds__", "__maxnreg__", "__align__"}
_MACRO = re.compile(r"^\s*#define\s+(\w+)\([^)]*\)((?:[^\n]*\\\n)*[^\n]*)$", re.MULTILINE)
_IDENT = re.compile(r"\b([A-Za-z_]\w*)\s*(?:<[^<>;{}]*>)?\s*\(")


def _functions(text: str) -> dict[str, str]:
    """Every top-level function and function-like macro of a CUDA text: name -> body (template
    specializations and overloads merged). Good enough for our sources: no braces in strings."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", "", text, flags=re.DOTALL)
    # a function-like macro is a function whose body is its replacement text
    out: dict[str, str] = {m[0]: m[1] for m in _MACRO.findall(text)}
    text = _MACRO.sub("", text)
    text = re.sub(r"^\s*#.*$", "", text, flags=re.MULTILINE)   # the other preprocessor lines
    depth, start, header_from = 0, 0, 0
    for i, ch in enumerate(text):
        if ch == "{":
            if depth == 0:
                start, header = i, text[header_from:i]
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                names = [n for n in _IDENT.findall(header) if n not in _ATTRIBUTES]
                if names and "struct" not in header.split("(")[0]:
                    out[names[0]] = out.get(names[0], "") + text[start:i + 1]
                header_from = i + 1
        elif ch == ";" and depth == 0:
            header_from = i + 1
    return out


def _all_functions() -> dict[str, str]:
    funcs: dict[str, str] = {}
    for s in ALL_SOURCES:
        for text in (s.source, *cu_headers(s.source).values()):
            for name, body in _functions(text).items():
                funcs.setdefault(name, body)
    return funcs


def _waits(entry: str, funcs: dict[str, str]) -> bool:
    """Whether `entry`'s body, or a function it reaches, waits for the previous kernel."""
    seen, todo = set(), [entry]
    while todo:
        name = todo.pop()
        if name in seen or name not in funcs:
            continue
        seen.add(name)
        body = funcs[name]
        if any(w in body for w in _WAITS):
            return True
        todo.extend(_IDENT.findall(body))
    return False


def test_the_source_walker_sees_both_a_waiting_and_a_serialized_kernel() -> None:
    funcs = _all_functions()
    assert _waits("gp_rmsnorm_f16", funcs) and _waits("gp_int4_mma_rows", funcs)
    assert _waits("gp_int4_mma_xa", funcs)
    assert _waits("gp_int4_wgmma", funcs) and _waits("gp_int4_wgmma_tiled", funcs)
    assert not _waits("gp_layernorm", funcs), "gp_layernorm never waits: the walker is blind"


class _Recorder(SimBackend):
    """The sim backend, noting which entries were launched with pdl."""

    def __init__(self) -> None:
        super().__init__()
        self.pdl_entries: set[str] = set()
        self.serial_entries: set[str] = set()

    def launch(self, function, grid, block, args, stream, shared_bytes=0, cluster=None,
               pdl=False) -> None:
        (self.pdl_entries if pdl else self.serial_entries).add(function.name)
        super().launch(function, grid, block, args, stream, shared_bytes, cluster, pdl)


def _serve_a_few(dev: Device, compiler) -> None:  # noqa: F811
    cfg = CONFIGS["tiny"]
    model = PagedDecoderModel(ModelExecutor(dev, compiler), cfg, 4, max_batch_size=8,
                              prefill_chunk=32)
    model.load()
    sched = Scheduler(model, model.pool, thread=False, max_batch_size=8, max_step_tokens=64)
    try:
        seqs = [sched.submit([(i * 7 + k * 13 + 1) % cfg.vocab_size for k in range(n)], 4, GREEDY)
                for i, n in enumerate((3, 40, 17))]
        for _ in range(200):
            if not sched.busy():
                break
            sched.step()
        assert all(len(s.generated) == 4 for s in seqs)
    finally:
        sched.close()
        model.executor.close()
        model.close()


@pytest.fixture
def recorded(compiler):  # noqa: F811
    backend = _Recorder()
    dev = Device(backend)
    try:
        _serve_a_few(dev, compiler)
    finally:
        dev.close()
    return backend


def test_every_kernel_launched_with_pdl_waits_for_the_previous_one_itself(recorded) -> None:
    funcs = _all_functions()
    assert recorded.pdl_entries, "the paged decode path launched nothing with pdl"
    blind = sorted(e for e in recorded.pdl_entries if not _waits(e, funcs))
    assert not blind, f"launched with pdl but never call gp_pdl_wait: {blind}"


def test_the_decode_steps_kernels_are_launched_with_pdl(recorded) -> None:
    """Every kernel of a paged decode layer overlaps its predecessor's tail (not only some)."""
    want = {"gp_embedding_gather", "gp_rmsnorm_f16", "gp_qkv_rope_append_paged",
            "gp_flash_decode_split_paged", "gp_flash_combine_paged", "gp_silu_gate_f16",
            "gp_sample", "gp_int4_mma_rows_tiled"}
    assert want <= recorded.pdl_entries, f"serialized: {sorted(want - recorded.pdl_entries)}"


def test_dependent_launch_off_serializes_every_launch(compiler) -> None:  # noqa: F811
    backend = _Recorder()
    dev = Device(backend)
    dev.dependent_launch = False
    try:
        _serve_a_few(dev, compiler)
    finally:
        dev.close()
    assert not backend.pdl_entries and backend.serial_entries


def test_every_kernel_def_entry_is_found_by_the_walker() -> None:
    funcs = _all_functions()
    missing = sorted(k.entry for k in ALL_KERNELS if k.entry not in funcs)
    assert not missing, f"the source walker cannot find {missing}"


@pytest.mark.parametrize("m", [1, 8, 9, 16, 32, 40, 64])
def test_every_int4_linear_the_step_routes_to_is_launched_with_pdl(m: int) -> None:
    """The paged decode above runs at most 8 rows, so it never reaches the kernels that serve
    more (xa from 9, wgmma from 40 on sm_90): each routed entry, both weight layouts, is
    launched with pdl here, at the 8b shapes' N and K."""
    from gpu_worker.kernels.int4_batched import MMA_KERNELS, MMA_KERNELS_TILED, mma_kernel

    class Recorder:
        info = type("Info", (), {"ordinal": 0})()
        name = "sim"

        def __init__(self) -> None:
            self.pdl: list[bool] = []

        def launch(self, fn, grid, block, args, stream=None, shared_bytes=0, cluster=None,
                   pdl=False) -> None:
            self.pdl.append(pdl)

        def tensor_map_2d(self, address, inner, outer, row_bytes, box, element_bytes=2,
                          swizzle=128) -> bytes:
            return bytes(128)

    kind = mma_kernel(m, "sm_90")
    for kernels in (MMA_KERNELS, MMA_KERNELS_TILED):
        for n, k in ((6144, 4096), (28672, 4096), (4096, 14336)):
            dev = Recorder()
            kernels[kind].launcher(dev, None, 16, 16, 16, 16, 0, m, n, k)
            assert dev.pdl == [True], f"{kernels[kind].entry} at {m} rows launched serialized"
