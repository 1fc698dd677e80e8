"""The single-sequence engine: a decoder served one request at a time under its model lock.

It serves decoders the paged kernels do not cover (head dims other than 16, 64 and 128, such as
the tiny test checkpoints' 8) and workers run with batching off (the per-sequence benchmarks).
Greedy only: the lock is held for the whole stream, so a second request waits for the first.
"""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from gpu_worker.engines.scheduler.sampling import SamplingParams


@dataclass(eq=False)
class SerialRequest:
    """What a token stream reads of its request (the scheduler's Sequence has the same names)."""
    prompt: list[int]
    max_new_tokens: int
    sampling: SamplingParams
    cancelled_fn: Callable[[], bool] = lambda: False
    generated: list[int] = field(default_factory=list)
    state: str = "waiting"                   # waiting | running | finished
    finish_reason: str = ""
    _cancel: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancel.set()

    def is_cancelled(self) -> bool:
        return self._cancel.is_set() or self.cancelled_fn()


def serial_tokens(loaded, request: SerialRequest, still_loaded: Callable[[object], None]
                  ) -> Iterator[int]:
    """`request`'s tokens, the model lock held for the whole stream and the weights resident;
    `still_loaded(loaded)` raises once an unload won the lock first."""
    with loaded.lock:
        still_loaded(loaded)
        request.state = "running"
        with loaded.executor.resident():
            for token in loaded.model.generate(request.prompt, request.max_new_tokens,
                                               request.is_cancelled):
                request.generated.append(token)
                yield token
                if request.is_cancelled():
                    request.state, request.finish_reason = "finished", "cancelled"
                    return
                if token in loaded.eos_token_ids or token in request.sampling.stop_token_ids:
                    request.state, request.finish_reason = "finished", "stop"
                    return
    request.state, request.finish_reason = "finished", "length"
