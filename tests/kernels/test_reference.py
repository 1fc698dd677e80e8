"""The NumPy references themselves: int4 layout and arithmetic, attention and rotary semantics."""
from __future__ import annotations

import numpy as np

from gpu_worker.kernels import reference as ref
from gpu_worker.models import weights as model_weights


def _rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def test_int4_pack_unpack_round_trips_every_nibble_value() -> None:
    rng = _rng()
    for k in (32, 33, 64, 95):
        kb = ref.int4_blocks(k)
        q = rng.integers(-7, 8, (5, kb * 32)).astype(np.int8)
        q[:, k:] = 0
        q[:, ::32] = 7  # every block's absmax is 7 steps, so the scale is exactly the step
        step = np.float16(0.125)
        w = q[:, :k].astype(np.float32) * np.float32(step)
        packed, scales = ref.int4_quantize(w)
        assert packed.shape == (5, 16 * kb) and scales.shape == (5, kb), f"K={k}: wrong layout shape"
        assert np.array_equal(ref.int4_unpack(packed), q), f"K={k}: nibbles do not round-trip"
        assert np.array_equal(ref.int4_dequantize(packed, scales, k), w), \
            f"K={k}: dequantize(quantize(w)) != w for exactly representable weights"


def test_int4_covers_the_full_signed_range_with_zero_offset_8() -> None:
    packed = np.array([[0x80 | 0x0F] + [0x88] * 15], np.uint8)  # low nibble 15 (+7), high 8 (0)
    packed[0, 1] = 0x10  # low 0 (-8), high 1 (-7)
    assert ref.int4_unpack(packed)[0, :4].tolist() == [7, 0, -8, -7], "nibble n must mean n - 8"


def test_int4_padding_past_k_is_the_zero_nibble() -> None:
    packed, _ = ref.int4_quantize(_rng().standard_normal((3, 33)).astype(np.float32))
    assert np.all(ref.int4_unpack(packed)[:, 33:] == 0), "K padding must dequantize to 0"


def test_int4_layout_is_the_model_weights_layout_when_k_is_a_multiple_of_32() -> None:
    w = _rng(1).standard_normal((6, 96)).astype(np.float32)
    packed, scales = ref.int4_quantize(w)
    theirs = model_weights.quantize(w)
    assert np.array_equal(packed, theirs.packed) and np.array_equal(scales, theirs.scales), \
        "kernel int4 layout diverged from gpu_worker.models.weights"
    assert np.array_equal(ref.int4_dequantize(packed, scales, 96), theirs.dequantize())


def test_int4_quantization_error_is_at_most_half_a_step_per_block() -> None:
    w = _rng(2).standard_normal((8, 100)).astype(np.float32)
    packed, scales = ref.int4_quantize(w)
    err = np.abs(ref.int4_dequantize(packed, scales, 100) - w)
    step = np.repeat(scales.astype(np.float32), 32, axis=1)[:, :100]
    assert np.all(err <= 0.5 * step * (1 + 1e-3) + 1e-7), "quantization error exceeds half a step"


def test_quantized_matmul_reference_multiplies_fp16_x_by_fp16_rounded_weights() -> None:
    rng = _rng(3)
    for m, n, k in ((1, 7, 33), (5, 17, 256)):
        packed, scales = ref.int4_quantize(rng.standard_normal((n, k)).astype(np.float32))
        x16 = rng.standard_normal((m, k)).astype(np.float16)
        bias = rng.standard_normal(n).astype(np.float32)
        w = ref.int4_dequantize(packed, scales, k).astype(np.float16).astype(np.float64)
        want = x16.astype(np.float64) @ w.T + bias
        got = ref.int4_matmul(x16, packed, scales, bias)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), \
            f"({m},{n},{k}): int4_matmul differs from x16 @ f16(dequant(W)).T"
        exact = x16.astype(np.float64) @ ref.int4_dequantize(packed, scales, k).astype(np.float64).T
        assert not np.array_equal(got, (exact + bias).astype(np.float32)), \
            "the weights were not rounded to fp16"
        assert np.array_equal(ref.int4_linear_f16(x16.astype(np.float32), packed, scales),
                              ref.int4_matmul(x16, packed, scales)), "the prefill path's oracle differs"


def _naive_attention(q, k, v, q_pos, causal, n_valid):
    s, heads, d = q.shape
    group = heads // k.shape[1]
    out = np.zeros(q.shape, np.float64)
    for i in range(s):
        for h in range(heads):
            keys = [j for j in range(min(n_valid, k.shape[0])) if not causal or j <= q_pos[i]]
            if not keys:
                continue
            sc = np.array([q[i, h] @ k[j, h // group] for j in keys], np.float64) / np.sqrt(d)
            p = np.exp(sc - sc.max())
            out[i, h] = (p / p.sum()) @ v[keys, h // group].astype(np.float64)
    return out


def test_attention_reference_matches_a_per_query_loop_with_gqa_causality_and_padding() -> None:
    rng = _rng(4)
    q = rng.standard_normal((5, 4, 8)).astype(np.float32)
    k = rng.standard_normal((9, 2, 8)).astype(np.float32)
    v = rng.standard_normal((9, 2, 8)).astype(np.float32)
    for causal, n_valid, pos in ((True, 9, np.arange(4, 9)), (False, 6, np.arange(5)),
                                 (True, 9, np.array([-1, 0, 1, 2, 3]))):
        got = ref.attention(q, k, v, pos, causal, n_valid=n_valid)
        want = _naive_attention(q, k, v, pos, causal, n_valid)
        assert np.allclose(got, want, rtol=1e-5, atol=1e-5), \
            f"attention(causal={causal}, n_valid={n_valid}) differs from the per-query loop"
    assert np.all(ref.attention(q, k, v, np.full(5, -1), True)[0] == 0), \
        "a query that sees no key must get zeros, not NaN"


def test_rotary_is_identity_at_position_zero_and_preserves_pair_norms() -> None:
    x = _rng(5).standard_normal((3, 2, 16)).astype(np.float32)
    assert np.allclose(ref.rotary(x, np.zeros(3, int), 10000.0), x), "position 0 must not rotate"
    y = ref.rotary(x, np.array([1, 50, 4000]), 10000.0)
    norm = lambda a: a[..., :8] ** 2 + a[..., 8:] ** 2
    assert np.allclose(norm(y), norm(x), rtol=1e-5, atol=1e-6), "rotation changed a pair's norm"


def test_rotary_matches_the_model_reference_convention() -> None:
    from gpu_worker.models import reference as model_ref

    x = _rng(6).standard_normal((7, 3, 32)).astype(np.float32)
    pos = np.arange(11, 18)
    assert np.allclose(ref.rotary(x, pos, 500000.0), model_ref.rope(x, pos, 500000.0),
                       rtol=1e-6, atol=1e-6), "kernel rotary diverged from the model reference"


def test_argmax_breaks_ties_to_the_lowest_index_and_mean_pool_honours_lengths() -> None:
    x = np.array([[1, 3, 3, 0], [5, 5, 5, 5]], np.float32)
    assert ref.argmax(x).tolist() == [1, 0], "argmax ties must go to the lowest index"
    seq = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    pooled = ref.mean_pool(seq, np.array([1, 0]))
    assert np.array_equal(pooled[0], seq[0, 0]) and np.all(pooled[1] == 0), \
        "mean_pool must average only the first lens[b] rows (zeros for an empty sequence)"


def test_gelu_and_silu_gate_match_their_closed_forms() -> None:
    x = np.linspace(-6, 6, 101, dtype=np.float32)
    from math import erf, sqrt
    exact = np.array([0.5 * v * (1 + erf(v / sqrt(2))) for v in x.astype(np.float64)])
    assert np.max(np.abs(ref.gelu(x) - exact)) < 1e-3, "tanh-GELU strays from GELU"
    assert np.allclose(ref.silu_gate(x, np.full_like(x, 2.0)), 2 * x / (1 + np.exp(-x.astype(np.float64))),
                       rtol=1e-6, atol=1e-6), "silu_gate != silu(gate) * up"


def test_every_kernels_oracle_lives_in_reference_py() -> None:
    """The package's rule: one place holds every NumPy oracle, so a kernel family's module is
    only its launchers and shape helpers."""
    from gpu_worker.kernels import ALL_KERNELS

    elsewhere = {k.name: k.reference.__module__ for k in ALL_KERNELS
                 if k.reference.__module__ != ref.__name__}
    assert not elsewhere, f"oracles outside gpu_worker/kernels/reference.py: {elsewhere}"
