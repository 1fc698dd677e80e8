"""A compiled kernel artifact (PTX or CUBIN) and its digest: the unit the cache stores and serves."""
from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass

from services.common.errors import InvalidArgument

KINDS = ("ptx", "cubin")


def sha256_hex(data: bytes) -> str:
    """Lowercase hex SHA-256, the only digest spelling used on the wire and in the database."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Artifact:
    """Compiled NVRTC output. `sha256` is derived from `data`, so it can never disagree with it."""

    data: bytes
    kind: str  # "ptx" | "cubin"
    arch: str  # e.g. "sm_90"
    nvrtc_version: str  # e.g. "13.0"
    module_name: str
    compile_seconds: float = 0.0  # what a hit saves the caller

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"artifact kind must be one of {KINDS}, got {self.kind!r}")
        if not isinstance(self.data, bytes):
            # memoryview/bytearray would hash fine but could change under the cache's feet.
            object.__setattr__(self, "data", bytes(self.data))

    @functools.cached_property
    def sha256(self) -> str:
        return sha256_hex(self.data)

    @classmethod
    def hashed(cls, data: bytes, digest: str, **fields: object) -> Artifact:
        """An artifact whose digest the caller has just computed from `data` itself (a hashing
        pass saved on the hot read path). Never pass a digest that came from anywhere else."""
        artifact = cls(data=data, **fields)  # type: ignore[arg-type]
        artifact.__dict__["sha256"] = digest  # what cached_property would have stored
        return artifact

    @property
    def size(self) -> int:
        return len(self.data)
