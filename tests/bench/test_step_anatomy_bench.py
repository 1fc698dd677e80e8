"""bench/step_anatomy_bench.py's accounting: steps split at the embedding gather, busy time as the
union of kernel intervals (overlap counted once), the gaps as what is left, and each int4
kernel named by the decode linear its grid belongs to (the GPU run itself needs torch)."""
from __future__ import annotations

from bench.step_anatomy_bench import busy_us, family, linear_shape, span_us, split_steps
from gpu_worker.kernels.int4_batched import xa_plan, xa_tile
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


def test_every_decode_linear_of_the_8b_model_is_named_from_its_grid():
    cfg = get_config("8b-int4")
    qkv = (cfg.heads + 2 * cfg.kv_heads) * cfg.head_dim
    rows = {"wqkv": (qkv, 256), "wo": (cfg.hidden, 256), "w_gateup": (2 * cfg.ffn, 256),
            "w_down": (cfg.hidden, 512), "lm_head": (cfg.vocab_size, 256)}
    for name, (n, threads) in rows.items():   # the rows kernels: ceil(n / 16) blocks
        assert linear_shape(k("gp_int4_mma_rows", 0, 1, (-(-n // 16), 1, 1), (threads, 1, 1)),
                            cfg) == name
    for name, (n, kk) in {"wqkv": (qkv, cfg.hidden), "w_gateup": (2 * cfg.ffn, cfg.hidden),
                          "lm_head": (cfg.vocab_size, cfg.hidden),
                          "wo | w_down": (cfg.hidden, cfg.ffn)}.items():
        for m in (24, 64):                    # the xa kernel: (split, tiles) from its plan
            nt, split = xa_plan(m, n, kk, 132)
            grid = (split, -(-n // xa_tile(m, nt)[0]), 1)
            assert linear_shape(k("gp_int4_mma_xa", 0, 1, grid), cfg) == name, (name, m, grid)


def test_families_group_the_step_kernels_and_name_anything_else():
    assert family("gp_flash_combine_paged") == family("gp_flash_decode_split_paged") == "attention"
    assert family("gp_int4_mma_xa") == "int4 linears"
    assert family("cutlass_gemm") == "other: cutlass_gemm"
