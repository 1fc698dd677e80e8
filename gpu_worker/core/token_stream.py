"""One Generate stream as the runtime hands it to the servicer."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from gpu_worker.core.loaded_model import LoadedModel
from gpu_worker.engines.scheduler.scheduler import Sequence
from gpu_worker.telemetry.spans import span


class TokenStream:
    """One Generate stream: `[token]` items from the scheduler, then `finish_reason`. Closing it
    early (the client went away) cancels the sequence; its KV is freed within one step."""

    def __init__(self, loaded: LoadedModel, seq: Sequence, tracer_provider: object,
                 on_end: Callable[[], None], tokens: Iterator[int] | None = None) -> None:
        """`on_end` runs once the stream ended, however (the runtime reports its memory then);
        `tokens` replaces the scheduler's stream (the single-sequence path)."""
        self._loaded, self.seq = loaded, seq
        self._tracer_provider, self._on_end = tracer_provider, on_end
        self._tokens = seq.stream() if tokens is None else tokens
        self._gen = self._run()

    def _run(self) -> Iterator[list[int]]:
        loaded = self._loaded
        with span(self._tracer_provider, "worker.generate",
                   model=loaded.info.model_id, prompt_tokens=len(self.seq.prompt),
                   max_new_tokens=self.seq.max_new_tokens):
            try:
                for token in self._tokens:
                    yield [token]
            finally:
                self._cancel()
                loaded.last_used = time.monotonic()
                self._on_end()

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> list[int]:
        return next(self._gen)

    def close(self) -> None:
        self._gen.close()
        self._cancel()      # closed before its first item: the generator never started

    def _cancel(self) -> None:
        if self.seq.state != "finished":
            self.seq.cancel()
            if self._loaded.scheduler is not None:
                self._loaded.scheduler.wake()

    @property
    def finish_reason(self) -> str:
        """"length", "stop" or "cancelled" once the stream ended ("" before)."""
        reason = self.seq.finish_reason
        return reason if reason in ("length", "stop", "cancelled") else ""
