"""Tuning sweep behind gp_int4_matmul's constants (issue 12 part D): the kernel compiled with other
values of its macros (GP_I4_WARPS, GP_I4_NC, GP_I4_U, GP_I4_PREFETCH, GP_I4_ROWS), each
timed as bench/kernels_bench.py times the library kernel (one graph of `reps` launches, median
replay / reps, each launch taking the next of enough weight copies that none is read from the
L2: bench/limits.rotation) on the 8b-int4 decode shapes, as a fraction of the copy limit measured
in the same run (bench/limits.py: 1 GiB device-to-device through torch, read + write).
Every variant's 1-row result is checked against the NumPy reference (a mismatch prints "!" and
the process exits 1). No target here: the target lives in kernels_bench.py [2].

    python3 bench/int4_gemv_sweep.py          # GPU only
"""
from __future__ import annotations

import dataclasses
import itertools
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import limits as bench_limits
from bench.kernels_bench import timed
from gpu_worker.compile import KernelCompiler
from gpu_worker.device import open_device
from gpu_worker.device.backend import i32, ptr
from gpu_worker.kernels import reference as ref
from gpu_worker.kernels.linear import SOURCE
from gpu_worker.kernels.selfcheck import KernelHarness

# (warps per block, columns per warp, quant blocks per lane per chunk, prefetch, rows)
VARIANTS = [(8, 4, 2, 0, 4), (4, 4, 2, 0, 4), (8, 2, 2, 0, 4), (8, 4, 2, 1, 4), (8, 4, 2, 0, 1),
            (8, 4, 4, 0, 1)]
SHAPES = [("wq", 1, 4096, 4096), ("w_gate", 1, 14336, 4096), ("w_down", 1, 4096, 14336),
          ("wk", 1, 1024, 4096), ("wq4", 4, 4096, 4096), ("wq16", 16, 4096, 4096)]
MACROS = ("GP_I4_WARPS", "GP_I4_NC", "GP_I4_U", "GP_I4_PREFETCH", "GP_I4_ROWS")


def variant_source(v: tuple[int, ...]):
    opts = (*SOURCE.options, *(f"-D{name}={val}" for name, val in zip(MACROS, v)))
    return dataclasses.replace(SOURCE, module_name="gp_i4_" + "_".join(map(str, v)), options=opts)


def main() -> int:
    dev = open_device("cuda")
    comp = KernelCompiler(dev.info.arch, cache_dir=Path(tempfile.mkdtemp()))
    with ThreadPoolExecutor(8) as ex:
        compiled = list(ex.map(lambda v: comp.compile(variant_source(v)), VARIANTS))
    wrong = 0
    limits = bench_limits.measure()
    if limits is None:
        print("int4_gemv_sweep: no copy limit (torch missing): nothing to divide by")
        return 1
    copy = limits.copy_gbs * 1e9
    with KernelHarness(dev, comp) as h:
        print("cells: time per launch, fraction of the copy limit")
        rng = np.random.default_rng(1)
        data = {}
        for name, m, n, k in SHAPES:
            kb = -(-k // 32)
            pk = rng.integers(0, 256, (n, kb * 16), dtype=np.uint8)
            sc = (rng.standard_normal((n, kb)) * 0.01).astype(np.float16)
            x = rng.standard_normal((m, k), dtype=np.float32).astype(np.float16)
            want = ref.int4_matmul(x, pk, sc) if m == 1 and n <= 4096 else None
            # the first copy is the checked one; the rest only keep the weight out of the L2
            weights = [(h.put(pk), h.put(sc)) for _ in range(bench_limits.rotation(n * kb * 18))]
            data[name] = (m, n, k, weights, h.put(x), h.put(np.zeros((m, n), np.float32)), want,
                          n * kb * 18)
        print(f"{'warps/nc/u/pf/rows':>22} " + " ".join(f"{s[0]:>14}" for s in SHAPES))
        for v, c in zip(VARIANTS, compiled):
            warps, nc, rows = v[0], v[1], v[4]
            fn = dev.get_function(dev.load_module(c.cubin), "gp_int4_matmul")
            row = f"{v!s:>22} "
            for m, n, k, weights, x, y, want, wbytes in data.values():
                grid = (-(-n // (warps * nc)), -(-m // rows), 1)
                turn = itertools.count()

                def launch(s, fn=fn, grid=grid, block=(32 * warps, 1, 1), weights=weights, x=x,
                           y=y, m=m, n=n, k=k, turn=turn):
                    pk, sc = weights[next(turn) % len(weights)]
                    dev.launch(fn, grid, block, [ptr(y), ptr(x), ptr(pk), ptr(sc), ptr(0), i32(m),
                                                 i32(n), i32(k), i32(0)], stream=s)
                t = timed(dev, launch, max(20, len(weights)), 5)
                if want is not None:   # the check reads the first copy's result
                    pk, sc = weights[0]
                    dev.launch(fn, grid, (32 * warps, 1, 1), [ptr(y), ptr(x), ptr(pk), ptr(sc),
                                                              ptr(0), i32(m), i32(n), i32(k), i32(0)])
                bad = want is not None and not np.allclose(h.get(y, (m, n)), want, 1e-4, 1e-4)
                wrong += bad
                row += f" {t * 1e6:6.1f}us {wbytes / t / copy:4.2f}{'!' if bad else ''}"
            print(row, flush=True)
    dev.close()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
