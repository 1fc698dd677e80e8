"""One activation arena shared by the plans of a class, which never run at once.

Hazard: every plan owns an arena for its whole graph's activations, so a plan class of many
shapes holds the sum of its shapes' activations although its plans run one after another: the
8b-int4 decoder's prefill graphs (one per chunk bucket, ~188 KiB a row) held 0.73 GiB for
buckets of powers of two and would hold 3.1 GiB for buckets 128 rows apart.
Contract:
- `share(kind, largest)`: the plans whose key is a tuple starting with `kind` take their
  activations from one allocation of `largest()` bytes (the class's largest layout), made with
  the first such plan and freed with the last one's release, which the plan cache makes only
  after synchronizing the model's stream (plans.py);
- a plan of the class whose layout is larger than that raises: `largest` was wrong;
- it is sound because a model's plans never run at once: `PlanCache.run` holds its lock across
  a run, every run is enqueued on the model's one stream, and nothing reads a plan's activations
  once the next run is enqueued (a prefill's sampled token is copied out on the stream by the
  run's `after`; `execute` reads its outputs back before returning).
Cost: none per run; the largest plan's bytes instead of the sum.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass


@dataclass
class _Shared:
    largest: Callable[[], int]
    alloc: object | None = None
    users: int = 0


class ClassArenas:
    """The shared activation arenas of one model's plan classes."""

    def __init__(self, arena) -> None:
        self._arena = arena
        self._classes: dict[Hashable, _Shared] = {}

    def share(self, kind: Hashable, largest: Callable[[], int]) -> None:
        """Plans of class `kind` share one arena of `largest()` bytes from now on."""
        if kind in self._classes and self._classes[kind].users:
            raise RuntimeError(f"plan class {kind!r} already shares an arena in use")
        self._classes[kind] = _Shared(largest)

    def _class(self, key: Hashable) -> _Shared | None:
        if isinstance(key, tuple) and key:
            return self._classes.get(key[0])
        return None

    def acquire(self, key: Hashable, nbytes: int) -> object | None:
        """The shared allocation for the plan `key` of `nbytes` activations (one more user), or
        None when its class does not share (the plan allocates its own)."""
        shared = self._class(key)
        if shared is None:
            return None
        if shared.alloc is None:
            size = max(int(shared.largest()), nbytes)
            shared.alloc = self._arena.alloc(size, "activations", role="plan")
        if nbytes > shared.alloc.size:
            raise RuntimeError(f"plan {key!r} needs {nbytes} bytes of activations, more than its "
                               f"class's shared arena of {shared.alloc.size}")
        shared.users += 1
        return shared.alloc

    def release(self, key: Hashable) -> int:
        """The plan `key` no longer uses its class's arena; returns the bytes freed (the
        arena's, when it was the last user)."""
        shared = self._class(key)
        assert shared is not None and shared.users > 0, f"release({key!r}) without acquire"
        shared.users -= 1
        if shared.users or shared.alloc is None:
            return 0
        alloc, shared.alloc = shared.alloc, None
        self._arena.free(alloc)
        return alloc.size

    def bytes(self) -> int:
        """Activation bytes the shared arenas hold now."""
        return sum(s.alloc.size for s in self._classes.values() if s.alloc is not None)
