"""Rotary frequencies: the default `theta^(-2i/d)` and Llama 3.1's "llama3" rescaling.

llama3 keeps high frequencies (wavelength < original / high_freq_factor), divides low ones
(wavelength > original / low_freq_factor) by `factor`, and blends linearly in between; the
attention scale stays 1. A model with scaling carries the table as a weight (`rope.inv_freq`),
read by the rotary kernel in place of the formula.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Llama3Scaling:
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


def inv_freq(head_dim: int, theta: float, scaling: Llama3Scaling | None = None) -> np.ndarray:
    """float64 (head_dim // 2,) inverse frequencies."""
    inv = np.float64(theta) ** (-np.arange(0, head_dim // 2, dtype=np.float64) * 2.0 / head_dim)
    if scaling is None:
        return inv
    orig = float(scaling.original_max_position_embeddings)
    low_wl, high_wl = orig / scaling.low_freq_factor, orig / scaling.high_freq_factor
    wavelen = 2.0 * np.pi / inv
    smooth = (orig / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor
                                                          - scaling.low_freq_factor)
    blended = (1.0 - smooth) * inv / scaling.factor + smooth * inv
    return np.where(wavelen < high_wl, inv, np.where(wavelen > low_wl, inv / scaling.factor, blended))
