"""The loader's quantizer (checkpoints/quantize.py) is models.weights.quantize, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest

import gpu_worker.checkpoints.quantize as Q
from gpu_worker.checkpoints.safetensors import to_float32
from gpu_worker.models.weights import quantize


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return ((rng.standard_normal(shape, dtype=np.float32) * scale).view(np.uint32) >> 16).astype("<u2")


def _hard_rows(rows: int = 40, cols: int = 96) -> np.ndarray:
    """bf16 rows with every edge the format has: all-zero blocks, subnormal scales (fp16 and
    bf16), values whose scale overflows fp16, +-inf, NaN, ties at .5, sign mixes."""
    rng = np.random.default_rng(7)
    raw = _bf16(rng, (rows, cols), 0.02)
    raw[0, :32] = 0                                   # zero block: scale 0, nibbles 8
    raw[1, :32] = 0x8000                              # -0.0 everywhere
    raw[2, :32] = 0x0001                              # bf16 subnormals: scale rounds to 0
    raw[3, :32] = _bf16(rng, (32,), 1e-6)             # fp16-subnormal scales
    raw[4, :32] = 0x4780                              # 65536: absmax/7 fits fp16
    raw[5, :32] = _bf16(rng, (32,), 1e6)              # scale beyond fp16: inf
    raw[6, 5] = 0x7F80                                # +inf
    raw[7, 9] = 0xFF80                                # -inf
    raw[8, 3] = 0x7FC0                                # NaN
    halves = (np.arange(-7, 8, dtype=np.float32) + 0.5) / 7.0   # ties after dividing by the scale
    raw[9, :15] = (halves.view(np.uint32) >> 16).astype(np.uint16)
    raw[9, 15] = (np.float32(1.0).view(np.uint32) >> 16).astype(np.uint16)
    return raw


def _fast(raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = raw.shape
    packed = np.full((rows, cols // 2), 0xAB, np.uint8)   # garbage: every byte must be written
    scales = np.full((rows, cols // 32), np.nan, np.float16)
    Q.quantize_rows(raw, dtype, packed, scales)
    return packed, scales


def _assert_same(raw: np.ndarray, dtype: str) -> None:
    packed, scales = _fast(raw, dtype)
    with np.errstate(all="ignore"):
        want = quantize(to_float32(raw, dtype))
    np.testing.assert_array_equal(packed, want.packed)
    np.testing.assert_array_equal(scales.view(np.uint16), want.scales.view(np.uint16))  # bits


@pytest.mark.parametrize("dtype", ["BF16", "F16", "F32"])
def test_quantize_rows_writes_exactly_what_quantize_returns_for_every_stored_dtype(dtype):
    raw = _hard_rows()
    with np.errstate(all="ignore"):
        stored = {"BF16": raw, "F16": to_float32(raw, "BF16").astype(np.float16),
                  "F32": to_float32(raw, "BF16") * np.float32(3.7)}[dtype]
    _assert_same(stored, dtype)


@pytest.mark.parametrize("piece", [96, 2 * 96 + 50, 4 * 96, 5 * 96])
def test_the_piece_size_does_not_change_the_result(monkeypatch, piece):
    monkeypatch.setattr(Q, "PIECE_ELEMS", piece)   # 1, 2, 4, 5 rows a piece
    _assert_same(_hard_rows(rows=41), "BF16")          # 41 rows: the last piece is partial


def test_a_row_wider_than_a_piece_falls_back_to_the_same_result(monkeypatch):
    monkeypatch.setattr(Q, "PIECE_ELEMS", 64)
    _assert_same(_hard_rows(cols=128), "BF16")


def test_quantize_rows_matches_on_a_llama_sized_chunk():
    raw = _bf16(np.random.default_rng(1), (80, 14336), 0.02)   # several default pieces
    _assert_same(raw, "BF16")


def test_an_input_dimension_not_a_multiple_of_the_block_is_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        _fast(np.zeros((2, 48), np.float32), "F32")


def test_negative_control_a_reciprocal_multiply_would_be_caught():
    """The bit-for-bit check discriminates: x * (1 / scale) instead of x / scale, a tempting
    speed-up, changes nibbles of the llama-sized chunk."""
    x = to_float32(_bf16(np.random.default_rng(1), (80, 14336), 0.02), "BF16").reshape(80, -1, 32)
    scales = (np.abs(x).max(axis=2) / 7.0).astype(np.float16).astype(np.float32)[..., None]
    by_div = np.clip(np.rint(x / scales), -8, 7)
    by_mul = np.clip(np.rint(x * (np.float32(1) / scales)), -8, 7)
    assert (by_div != by_mul).sum() > 0


def test_ordinary_rows_take_the_fast_spelling_and_only_rows_with_odd_scales_the_exact_one(monkeypatch):
    """The fast piece needs no clip where every scale is a normal fp16 or zero; a row holding a
    subnormal, inf or NaN scale is redone by quantize()'s own sequence, and nothing else is."""
    redone: list[int] = []
    exact = Q._piece_exact
    monkeypatch.setattr(Q, "_piece_exact", lambda raw, *a: (redone.append(raw.shape[0]), exact(raw, *a)))
    _assert_same(_bf16(np.random.default_rng(1), (80, 14336), 0.02), "BF16")
    assert redone == [], "an ordinary chunk went through the exact spelling"
    _assert_same(_hard_rows(), "BF16")
    assert sum(redone) == 5, f"rows redone: {redone}"   # rows 3 (subnormal), 5 (inf scale), 6-8


def test_negative_control_without_the_exact_rows_the_edges_would_differ(monkeypatch):
    monkeypatch.setattr(Q, "_piece_exact", lambda *a: None)
    with pytest.raises(AssertionError):
        _assert_same(_hard_rows(), "BF16")
