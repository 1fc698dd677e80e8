"""bench/step_anatomy_bench.py's accounting: steps split at the embedding gather, busy time as the
union of kernel intervals (overlap counted once), the gaps as what is left, and each int4
kernel named by the decode linear its launch order says it ran (the GPU run itself needs
torch)."""
from __future__ import annotations

from bench.step_anatomy_bench import busy_us, family, linear_names, span_us, split_steps
from gpu_worker.models.configs import get_config


def k(name: str, ts: float, dur: float, grid=(1, 1, 1), block=(256, 1, 1)) -> dict:
    return {"name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid), "block": list(block)}}


def test_overlapping_kernels_count_once_and_the_gaps_are_the_rest_of_the_span():
    step = [k("gp_embedding_gather", 0, 2), k("gp_rmsnorm_f16", 1, 4), k("gp_sample", 10, 2)]
    assert busy_us(step) == 7.0       # [0, 5) and [10, 12)
    assert span_us(step) == 12.0
    assert span_us(step) - busy_us(step) == 5.0


def test_steps_start_at_the_embedding_and_a_step_without_its_sample_is_dropped():
    kernels = [k("gp_rmsnorm_f16", 0, 1),                               # the tail of a step
               k("gp_embedding_gather", 5, 1), k("gp_sample", 9, 1),
               k("gp_embedding_gather", 20, 1), k("gp_int4_mma_rows", 22, 3)]  # cut short
    steps = split_steps(kernels)
    assert [[e["name"] for e in s] for s in steps] == [["gp_embedding_gather", "gp_sample"]]


def test_every_decode_linear_is_named_by_launch_order_whatever_kernel_serves_it():
    cfg = get_config("8b-int4")
    kernels = ("gp_int4_mma_rows", "gp_int4_mma_rows_async", "gp_int4_mma_xa", "gp_int4_mma_xk8")
    step = [k("gp_embedding_gather", 0, 1)]
    for i in range(4 * cfg.layers + 1):      # any kernel, any grid: a persistent one says nothing
        step.append(k(kernels[i % len(kernels)], 10 + 10 * i, 1, (528, 1, 1)))
        step.append(k("gp_rmsnorm_f16", 15 + 10 * i, 1))
    step.append(k("gp_sample", 1e6, 1))
    names = linear_names(step, cfg)
    assert names[:5] == ["wqkv", "wo", "w_gateup", "w_down", "wqkv"]
    assert names[-1] == "lm_head" and names.count("w_down") == cfg.layers
    assert linear_names(step[:-3], cfg) == ["int4 (unclassified)"] * (4 * cfg.layers), \
        "a step of another count of linears is not guessed at"


def test_families_group_the_step_kernels_and_name_anything_else():
    assert family("gp_flash_combine_paged") == family("gp_flash_decode_split_paged") == "attention"
    assert family("gp_int4_mma_xa") == "int4 linears"
    assert family("cutlass_gemm") == "other: cutlass_gemm"
