"""Where a LoadModelRequest's `checkpoint` may point: only inside the worker's --model-root.

Hazard: the path comes from any client of the worker; without a root it would read any file the
worker can (`../../etc`, an absolute path, a symlink planted inside the root). Contract:
`resolve_checkpoint` resolves symlinks first and then requires the result to lie inside the
resolved root, so `..` and links out of the root are PERMISSION_DENIED; a worker without a model
root refuses every checkpoint (FAILED_PRECONDITION); a path inside the root that does not exist
is NOT_FOUND. Cost: a few stat calls.
"""
from __future__ import annotations

import pathlib

from services.common.errors import FailedPrecondition, NotFound, PermissionDenied


def resolve_checkpoint(model_root: pathlib.Path | None, checkpoint: str) -> pathlib.Path:
    """The real directory of `checkpoint` (relative to `model_root`, or absolute inside it)."""
    if model_root is None:
        raise FailedPrecondition("this worker has no --model-root (GPUPLANE_WORKER_MODEL_ROOT): "
                                 "it serves synthetic models only")
    root = pathlib.Path(model_root).resolve()
    path = pathlib.Path(checkpoint)
    resolved = (path if path.is_absolute() else root / path).resolve()
    if resolved != root and root not in resolved.parents:
        raise PermissionDenied(f"checkpoint {checkpoint!r} resolves outside the model root "
                               f"{str(root)!r}: only directories under it may be loaded",
                               checkpoint=checkpoint)
    if not resolved.is_dir():
        raise NotFound(f"checkpoint directory {checkpoint!r} does not exist under the model root "
                       f"{str(root)!r}", checkpoint=checkpoint)
    return resolved
