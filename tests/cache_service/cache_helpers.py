"""Helpers shared by the kernel cache tests (a module, not conftest, so tests can import it)."""
from __future__ import annotations

import os

from cache_service.artifact import Artifact

TOKEN = "s3cret-token"


def make_artifact(size: int = 4096, seed: int = 0, kind: str = "cubin") -> Artifact:
    data = (seed.to_bytes(4, "little") + os.urandom(28)) * (size // 32 + 1)
    return Artifact(data=data[:size], kind=kind, arch="sm_90", nvrtc_version="13.0",
                    module_name=f"mod{seed}", compile_seconds=0.08)
