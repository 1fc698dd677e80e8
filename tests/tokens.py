"""Greedy tokens against the NumPy reference, allowing fp16 near-ties.

Every int4 linear rounds its x to fp16 (kernels.reference.int4_matmul), so an f32 ulp of
difference upstream (attention's summation order, a split-K sum) that straddles an fp16 rounding
boundary moves a logit by ~1e-4..1e-3. Where the reference's best two logits are closer than
that, the executor may take the other one, and an exact comparison of whole sequences then
fails on everything after it. Teacher forcing checks each token given the executor's own earlier
tokens: each must be the reference's argmax or within `tol` of its logit.
"""
from __future__ import annotations

import numpy as np

NEAR_TIE = 5e-3


def assert_greedy_tokens_of(reference, prompt: list[int], got: list[int], tol: float = NEAR_TIE,
                            what: str = "") -> None:
    """`reference` is a fresh models.reference.DecoderReference; `got` the executor's tokens."""
    logits = reference.forward(list(prompt), 0)[-1]
    pos = len(prompt)
    for i, tok in enumerate(got):
        best = int(np.argmax(logits))
        gap = float(logits[best] - logits[tok])
        assert gap <= tol, (f"{what}token {i}: {tok} is {gap:.3g} below the reference's {best} "
                            f"(tokens {got})")
        logits = reference.forward([tok], pos)[-1]
        pos += 1
