"""A kernel's CUDA C source and everything NVRTC needs besides the arch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType


@dataclass(frozen=True)
class KernelSource:
    """One NVRTC translation unit.

    `headers` maps include names to their content: NVRTC resolves `#include "name"` against them,
    and each one is part of the cache key, so editing a header recompiles every module using it.
    `options` is the exact NVRTC option list, in order (the arch is added by the compiler).
    """

    module_name: str
    source: str
    headers: Mapping[str, str] = field(default_factory=dict)
    options: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.module_name or not isinstance(self.module_name, str):
            raise ValueError("KernelSource.module_name must be a non-empty string")
        if not isinstance(self.source, str):
            raise TypeError(f"KernelSource {self.module_name!r}: source must be str")
        # Freeze a copy so a caller mutating its dict cannot change a source after it was keyed.
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        object.__setattr__(self, "options", tuple(self.options))

    def __hash__(self) -> int:
        return hash(
            (self.module_name, self.source, tuple(sorted(self.headers.items())), self.options)
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, KernelSource):
            return NotImplemented
        return (self.module_name, self.source, dict(self.headers), self.options) == (
            other.module_name,
            other.source,
            dict(other.headers),
            other.options,
        )
