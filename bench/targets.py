"""The targets a benchmark prints, and the exit status they imply.

Contract: a bench makes one `Targets`, calls `check` (a measured figure against a bound) or
`require` (a yes/no claim) for every target it prints, `figure` for every other figure a doc may
quote, and ends with `sys.exit(targets.exit_code())`. With a recorder (the bench's `--record`
flag, bench/record.py) every check, requirement and figure is also one line of the record. A target not met prints MISSED and makes the exit status 1, so
`python -m bench` (which runs every bench, then fails if any did) and `make bench` say so. A
figure that is not a number (NaN: nothing was measured) is MISSED, never met.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable

from bench.record import Recorder

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


class Targets:
    def __init__(self, bench: str, args: object = None, record: Recorder | None = None,
                 variant: str = "") -> None:
        """`args`: parsed flags; its `record` (a directory, from add_record_flag) makes the
        recorder unless one is given; `variant`: a run off the bench's defaults (e.g. "stream
        interval 4"), appended to every name in parentheses so its figures never stand in for
        the default run's."""
        self.bench = bench
        self.suffix = f" ({variant})" if variant else ""
        self.results: list[tuple[str, bool]] = []
        directory = getattr(args, "record", None)
        self.recorder = record or (Recorder(bench, directory) if directory else None)

    def check(self, name: str, value: float, op: str, bound: float, fmt: str = ".2f",
              unit: str = "", peer: float | None = None, limit: float | None = None) -> bool:
        """Print `name: value (target op bound) met|MISSED`; returns whether it was met."""
        if op not in _OPS:
            raise ValueError(f"unknown comparison {op!r}; use one of {sorted(_OPS)}")
        ok = not math.isnan(value) and _OPS[op](value, bound)
        name += self.suffix
        if self.recorder:
            self.recorder.add(name, value, unit, peer, limit, f"{op} {bound:g}", ok)
        return self._record(name, ok, f"{value:{fmt}} (target {op} {bound:{fmt}})")

    def require(self, name: str, ok: bool, detail: str = "") -> bool:
        """A yes/no target (e.g. graph and eager produce identical tokens)."""
        name += self.suffix
        if self.recorder:
            self.recorder.add(name, 1.0 if ok else 0.0, "yes/no", target="== 1", met=bool(ok))
        return self._record(name, bool(ok), detail)

    def figure(self, name: str, value: float, unit: str, peer: float | None = None,
               limit: float | None = None) -> None:
        """A figure without a target (a rate, a limit, the peer's own figure): recorded only."""
        name += self.suffix
        if self.recorder:
            self.recorder.add(name, value, unit, peer, limit)

    def _record(self, name: str, ok: bool, detail: str) -> bool:
        self.results.append((name, ok))
        print(f"target {name}: {detail}{' ' if detail else ''}{'met' if ok else 'MISSED'}",
              flush=True)
        return ok

    @property
    def missed(self) -> list[str]:
        return [name for name, ok in self.results if not ok]

    def exit_code(self) -> int:
        """0 when every target printed was met, else 1 (after a one-line summary)."""
        missed = self.missed
        print(f"{self.bench}: {len(self.results) - len(missed)} of {len(self.results)} targets met"
              + (f"; MISSED: {', '.join(missed)}" if missed else ""), flush=True)
        return 1 if missed else 0

# bench/decode_attention_bench.py: the paged split-K decode reads a KV larger than the L2 at >= 0.8
# of the device-to-device copy limit measured in the same run (bench/limits.py), at every batch:
# at ctx 8192, doubled where a batch's KV there fits in the L2 (batch 1: 16384; target_ctx).
DECODE_ATTENTION_OF_COPY = 0.8
DECODE_ATTENTION_CTX = 8192
