"""Per-request sampling parameters: validated once at submit, then passed to the `sample` op.

Greedy is temperature <= 0. A row's choice depends only on its logits, seed and position (the
op's counter-based hash), so a seeded stream is reproducible whatever shares its batch, and a
preempted sequence resampled at the same positions continues with the same tokens.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from services.common.errors import InvalidArgument

INT32_MAX = 2**31 - 1


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    def check(self, vocab_size: int) -> SamplingParams:
        """Self, or INVALID_ARGUMENT naming the bad field."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument(f"sampling.temperature={self.temperature} must be a finite "
                                  "number >= 0 (0: greedy)", field="temperature")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidArgument(f"sampling.top_p={self.top_p} must be in (0, 1]",
                                  field="top_p")
        if not 0 <= self.top_k <= vocab_size:
            raise InvalidArgument(f"sampling.top_k={self.top_k} must be in 0..{vocab_size} "
                                  "(0: all tokens)", field="top_k")
        if not -INT32_MAX - 1 <= self.seed <= INT32_MAX:
            raise InvalidArgument(f"sampling.seed={self.seed} must fit in int32", field="seed")
        bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidArgument(f"sampling.stop_token_ids: {bad[0]} is outside the vocabulary "
                                  f"(0..{vocab_size - 1})", field="stop_token_ids")
        return self


GREEDY = SamplingParams()


def from_message(temperature: float = 0.0, top_p: float = 0.0, top_k: int = 0, seed: int = 0,
                 stop_token_ids: tuple[int, ...] | list[int] = ()) -> SamplingParams:
    """Proto defaults to params: an unset top_p (0) means 1.0 (keep all)."""
    return SamplingParams(float(temperature), float(top_p) if top_p else 1.0, int(top_k),
                          int(seed), tuple(int(t) for t in stop_token_ids))
