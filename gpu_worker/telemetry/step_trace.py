"""--step-trace: one JSON line per engine step of every decoder, for finding where a served
step's time goes (docs/scheduler.md, "Step trace").

Each line is `scheduler.trace_record` plus the model id:
    {"model": "m", "step": 812, "decode_rows": 36, "decode_graph_rows": 40, "chunks": [212, 48],
     "chunk_rows": [256, 64], "device_us": 17215, "host_us": 8650, "wait_us": 7102}
Cost: one `json.dumps` and a line write per step on the engine thread (a few µs beside a
step's milliseconds); off unless the flag names a file. A write that fails (a full disk) is
counted and logged by `survived` and the step goes on: the trace never fails a stream.
"""
from __future__ import annotations

import json
import pathlib
import threading
from collections.abc import Callable

from gpu_worker.telemetry.survived import survived


class StepTrace:
    """An append-only JSON-lines file shared by every decoder's engine thread."""

    def __init__(self, path: pathlib.Path) -> None:
        self.path = path
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - line-buffered
        self._lock = threading.Lock()

    def writer(self, model_id: str) -> Callable[[dict[str, object]], None]:
        """The scheduler's `step_trace` callback for `model_id`."""
        def write(record: dict[str, object]) -> None:
            line = json.dumps({"model": model_id, **record}, separators=(",", ":"))
            with self._lock:
                if self._file.closed:
                    return
                try:
                    self._file.write(line + "\n")
                except OSError as exc:   # a full disk loses trace lines, never a step
                    survived("step_trace", exc, "a --step-trace line was not written",
                             path=str(self.path))
        return write

    def close(self) -> None:
        with self._lock:
            self._file.close()
