"""Artifact <-> protobuf, shared by the servicer, the client and the CLI (protobuf only, no grpc)."""
from __future__ import annotations

from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb

from cache_service.artifact import Artifact
from services.common.errors import InvalidArgument

_KIND_TO_PB = {"ptx": pb.ARTIFACT_KIND_PTX, "cubin": pb.ARTIFACT_KIND_CUBIN}
_PB_TO_KIND = {v: k for k, v in _KIND_TO_PB.items()}


def artifact_to_pb(artifact: Artifact) -> pb.Artifact:
    return pb.Artifact(
        data=artifact.data,
        sha256=artifact.sha256,
        kind=_KIND_TO_PB[artifact.kind],
        arch=artifact.arch,
        nvrtc_version=artifact.nvrtc_version,
        module_name=artifact.module_name,
        compile_seconds=artifact.compile_seconds,
    )


def artifact_from_pb(message: pb.Artifact) -> tuple[Artifact, str]:
    """The artifact and the digest the sender claimed (verified by the caller, not here)."""
    kind = _PB_TO_KIND.get(message.kind)
    if kind is None:
        raise InvalidArgument("artifact.kind must be ARTIFACT_KIND_PTX or ARTIFACT_KIND_CUBIN")
    artifact = Artifact(
        data=message.data,
        kind=kind,
        arch=message.arch,
        nvrtc_version=message.nvrtc_version,
        module_name=message.module_name,
        compile_seconds=message.compile_seconds,
    )
    return artifact, message.sha256
