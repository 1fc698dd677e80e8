"""The targets a benchmark prints, and the exit status they imply.

Contract: a bench makes one `Targets`, calls `check` (a measured figure against a bound) or
`require` (a yes/no claim) for every target it prints, and ends with
`sys.exit(targets.exit_code())`. A target not met prints MISSED and makes the exit status 1, so
`python -m bench` (which runs every bench, then fails if any did) and `make bench` say so. A
figure that is not a number (NaN: nothing was measured) is MISSED, never met.
"""
from __future__ import annotations

import math
import operator
from collections.abc import Callable

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, "<": operator.lt, ">=": operator.ge, ">": operator.gt}


class Targets:
    def __init__(self, bench: str) -> None:
        self.bench = bench
        self.results: list[tuple[str, bool]] = []

    def check(self, name: str, value: float, op: str, bound: float, fmt: str = ".2f") -> bool:
        """Print `name: value (target op bound) met|MISSED`; returns whether it was met."""
        if op not in _OPS:
            raise ValueError(f"unknown comparison {op!r}; use one of {sorted(_OPS)}")
        ok = not math.isnan(value) and _OPS[op](value, bound)
        return self._record(name, ok, f"{value:{fmt}} (target {op} {bound:{fmt}})")

    def require(self, name: str, ok: bool, detail: str = "") -> bool:
        """A yes/no target (e.g. graph and eager produce identical tokens)."""
        return self._record(name, bool(ok), detail)

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
