"""Scan- and loop-resistant residency for weight slots (a 2Q variant, by bytes).

Why not LRU: a decode step sweeps every layer in order; with a budget that holds 60 % of the
weights, LRU evicts exactly the layer needed next and gets zero hits on every sweep.

Policy: a key seen for the first time enters *probation* (FIFO). Evicted probation keys leave a
*ghost*. A key referenced again while ghosted is promoted to *protected* (LRU) if protected has
room (at most `protected_fraction` of the byte budget), or if protected's least recent key went
unreferenced for a whole window of `window` references (it is demoted to probation). Victims
come from probation first. Under a cyclic sweep the protected set stays fixed and hits every
sweep, so the hit rate approaches protected_fraction x budget / total instead of zero.
An owner that knows its loop (a streamed model: gpu_worker/execution/streaming.py) does better:
it `demote`s each key it streams right after its last use in the sweep, so those are the next
victims (most recently demoted first: MRU, optimal for a loop) and the keys it means to keep
resident are never evicted to make room for them.
"""
from __future__ import annotations

from collections import OrderedDict


class ResidencyPolicy:
    def __init__(self, capacity_bytes: int | None, protected_fraction: float = 0.75) -> None:
        self.capacity_bytes = capacity_bytes
        self.protected_fraction = protected_fraction
        self.window = 1  # set by the owner to the number of keys it manages
        self._tick = 0
        self._probation: OrderedDict[str, int] = OrderedDict()          # key -> bytes, FIFO
        self._protected: OrderedDict[str, tuple[int, int]] = OrderedDict()  # key -> (bytes, last tick)
        self._ghost: OrderedDict[str, None] = OrderedDict()

    def _protected_bytes(self) -> int:
        return sum(b for b, _ in self._protected.values())

    def touch(self, key: str) -> None:
        """A hit on a resident key."""
        self._tick += 1
        if key in self._protected:
            b, _ = self._protected.pop(key)
            self._protected[key] = (b, self._tick)

    def admit(self, key: str, nbytes: int) -> None:
        """A key just became resident."""
        self._tick += 1
        if key in self._ghost:
            del self._ghost[key]
            cap = None if self.capacity_bytes is None else self.capacity_bytes * self.protected_fraction
            if cap is None or self._protected_bytes() + nbytes <= cap:
                self._protected[key] = (nbytes, self._tick)
                return
            old_key, (old_b, last) = next(iter(self._protected.items()))
            if last < self._tick - self.window:
                del self._protected[old_key]
                self._probation[old_key] = old_b
                self._protected[key] = (nbytes, self._tick)
                return
        self._probation[key] = nbytes

    def demote(self, key: str) -> None:
        """`key` (resident) is not needed again before every other key: make it the next victim."""
        if key in self._probation or key in self._protected:
            nbytes = self._probation.pop(key, None)
            if nbytes is None:
                nbytes = self._protected.pop(key)[0]
            self._probation[key] = nbytes
            self._probation.move_to_end(key, last=False)

    def victim(self, exclude: set[str]) -> str | None:
        for k in self._probation:
            if k not in exclude:
                return k
        for k in self._protected:
            if k not in exclude:
                return k
        return None

    def evicted(self, key: str) -> None:
        if key in self._probation:
            del self._probation[key]
            self._ghost[key] = None
            while len(self._ghost) > max(1, self.window):
                self._ghost.popitem(last=False)
        else:
            self._protected.pop(key, None)

    def forget(self, key: str) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)
        self._ghost.pop(key, None)
