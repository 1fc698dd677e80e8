"""The kernel library on a real device: every kernel against its NumPy reference (the same cases the
sim runs, gpu_worker.kernels.selfcheck.CASES, plus model-sized shapes), and every module loading
from both its CUBIN and its PTX.

Run on the GPU machine:
    python3 -m pytest -m gpu tests/gpu/test_kernels.py -v
    compute-sanitizer --tool memcheck python3 -m pytest -m gpu tests/gpu/test_kernels.py -q
"""
from __future__ import annotations

import numpy as np
import pytest

from gpu_worker.kernels import ALL_KERNELS, ALL_SOURCES
from gpu_worker.kernels.half import DEQUANT_WORDS_CHOICES
from gpu_worker.kernels.selfcheck import (
    CASES,
    Case,
    KernelHarness,
    attention_case_sizes,
    decode_case,
    int4_dequant_f16_case,
    int4_linear_case,
    int4_matmul_case,
    int4_quantize_case,
    matmul_nt_case,
    prefill_case,
    tensor_linear_case,
)

pytestmark = pytest.mark.gpu

# Shapes of the 8b-int4 / large reference models, cut down only where the NumPy reference
# would take more than a few seconds.
MODEL_CASES: list[Case] = [
    Case("int4_matmul", int4_matmul_case, {"m": 1, "n": 14336, "k": 4096}),
    Case("int4_matmul", int4_matmul_case, {"m": 4, "n": 4096, "k": 14336}),
    Case("int4_matmul", int4_matmul_case, {"m": 16, "n": 1024, "k": 8192, "bias": True}),
    Case("int4_linear", int4_linear_case, {"m": 257, "n": 1024, "k": 4096}),
    Case("int4_dequant_f16", int4_dequant_f16_case, {"n": 14336, "k": 4096, "row0": 4096,
                                                     "rows": 4096}),
    Case("int4_dequant_f16", int4_dequant_f16_case, {"n": 4096, "k": 14336, "row0": 13,
                                                     "rows": 1027, "wide": True}),
    Case("int4_dequant_f16", int4_dequant_f16_case, {"n": 301, "k": 4104, "row0": 7,
                                                     "rows": 250, "wide": True}),
    # every words-per-thread build: a pass that ends inside the tile, rows not a multiple of it
    *(Case("int4_dequant_f16", int4_dequant_f16_case, {"n": 4096, "k": 14336, "row0": 13,
                                                       "rows": 1027, "wide": True, "words": w})
      for w in DEQUANT_WORDS_CHOICES),
    # the loader's chunks: 512 rows of a q_proj, 73 rows of a down_proj with the edge blocks
    Case("int4_quantize", int4_quantize_case, {"rows": 512, "in_dim": 4096, "dtype": "BF16"}),
    Case("int4_quantize", int4_quantize_case, {"rows": 73, "in_dim": 14336, "dtype": "BF16",
                                               "hard": True}),
    Case("int4_quantize", int4_quantize_case, {"rows": 37, "in_dim": 4096, "dtype": "F32",
                                               "hard": True}),
    Case("tensor_linear", tensor_linear_case, {"m": 469, "n": 14336, "k": 4096,
                                               "tile_rows": 4096}),
    Case("tensor_linear", tensor_linear_case, {"m": 469, "n": 4096, "k": 14336,
                                               "tile_rows": 1152, "accumulate": True}),
    Case("matmul_nt", matmul_nt_case, {"m": 512, "n": 1000, "k": 4096}),
    Case("matmul_nt_large", matmul_nt_case, {"m": 515, "n": 1000, "k": 4100, "large": True}),
    Case("attention_prefill", prefill_case, attention_case_sizes(tokens=1024, heads=8, kv_heads=2)),
    Case("attention_prefill_kv16", prefill_case, attention_case_sizes(tokens=1024, heads=8, kv_heads=2)
         | {"past": 512, "kv16": True}),
    Case("attention_decode_kv16", decode_case, {"batch": 1, "heads": 32, "kv_heads": 8,
                                                "head_dim": 128, "lengths": [5502], "len_add": 1}),
]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.device import open_device

    device = open_device("cuda")
    compiler = KernelCompiler(device.info.arch, cache_dir=tmp_path_factory.mktemp("kernels"))
    h = KernelHarness(device, compiler)
    yield h
    h.close()
    device.close()


@pytest.mark.parametrize("case", CASES + MODEL_CASES, ids=[c.id for c in CASES + MODEL_CASES])
def test_cuda_kernel_matches_its_numpy_reference(harness, case) -> None:
    outcome = case.run(harness, np.random.default_rng(sum(map(ord, case.id))))
    failure = outcome.failure()
    assert failure is None, f"{case.id}: device result differs from the reference: {failure}"


def test_every_module_loads_from_its_cubin_and_from_its_ptx(harness) -> None:
    device, compiler = harness.device, harness.compiler
    for src in ALL_SOURCES:
        compiled = compiler.compile(src)
        entries = [k.entry for k in ALL_KERNELS if k.source is src]
        for kind, image in (("cubin", compiled.cubin), ("ptx", compiled.ptx)):
            module = device.load_module(image)
            try:
                for entry in entries:
                    assert device.get_function(module, entry) is not None, \
                        f"{src.module_name}: {entry} missing from the loaded {kind}"
            finally:
                device.unload_module(module)
