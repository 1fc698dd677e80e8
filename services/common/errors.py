"""Domain errors, one class per gRPC status the contract promises.

Domain code raises these and never imports grpc; `services.common.interceptors.ErrorInterceptor`
turns them into status codes in one place. Anything else that escapes a handler becomes a plain
INTERNAL with a reference id, and its traceback goes to the server log only.

    GpuplaneError
    +-- InvalidArgument      INVALID_ARGUMENT    the request itself is wrong; nothing changed
    +-- NotFound             NOT_FOUND           unknown key / model / lease / worker
    +-- AlreadyExists        ALREADY_EXISTS
    +-- ResourceExhausted    RESOURCE_EXHAUSTED  admission refused; carries what was asked and free
    +-- FailedPrecondition   FAILED_PRECONDITION the system is in the wrong state for this call
    +-- Unavailable          UNAVAILABLE         draining or a dependency is down; retry later
    +-- Unauthenticated      UNAUTHENTICATED     no credential
    +-- PermissionDenied     PERMISSION_DENIED   a credential, but the wrong one
    +-- DeadlineExceeded     DEADLINE_EXCEEDED
"""
from __future__ import annotations

from dataclasses import dataclass, field


class GpuplaneError(Exception):
    """Base class; `code` names the grpc.StatusCode attribute the interceptor uses."""

    code = "INTERNAL"

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details


class InvalidArgument(GpuplaneError):
    code = "INVALID_ARGUMENT"


class NotFound(GpuplaneError):
    code = "NOT_FOUND"


class AlreadyExists(GpuplaneError):
    code = "ALREADY_EXISTS"


class FailedPrecondition(GpuplaneError):
    code = "FAILED_PRECONDITION"


class Unavailable(GpuplaneError):
    code = "UNAVAILABLE"


class Unauthenticated(GpuplaneError):
    code = "UNAUTHENTICATED"


class PermissionDenied(GpuplaneError):
    code = "PERMISSION_DENIED"


class DeadlineExceeded(GpuplaneError):
    code = "DEADLINE_EXCEEDED"


@dataclass(frozen=True)
class QuotaViolation:
    """One reason an admission was refused (mirrors google.rpc.QuotaFailure.Violation)."""

    subject: str      # e.g. "device:GPU-1234/zone:kv"
    description: str  # e.g. "asked 64 MiB, 12 MiB free of a 70 GiB budget"


@dataclass(frozen=True)
class ReclaimHint:
    """Memory that could be given back to satisfy a refused request."""

    worker_id: str
    zone: str
    bytes: int
    cached_bytes: int = 0  # of `bytes`: cached content (zone kv), given back with no live work harmed


# How long a refused caller waits before trying again when the refusing code names no better
# figure: long enough for a reclaim ask or a queue to move, short next to any client deadline.
DEFAULT_RETRY_AFTER_S = 1.0


@dataclass
class ResourceExhausted(GpuplaneError):
    """Admission refused. Carries numbers so a caller can decide what to evict, and when to try
    again (`retry_after_s`, sent as google.rpc.RetryInfo)."""

    message: str
    asked_bytes: int = 0
    free_bytes: int = 0
    zone: str = ""
    violations: list[QuotaViolation] = field(default_factory=list)
    reclaimable: list[ReclaimHint] = field(default_factory=list)
    retry_after_s: float = DEFAULT_RETRY_AFTER_S

    code = "RESOURCE_EXHAUSTED"

    def __post_init__(self) -> None:
        Exception.__init__(self, self.message)
        if not 0 <= self.retry_after_s <= 3600:  # also false for nan
            raise ValueError(f"retry_after_s={self.retry_after_s} is not in [0, 3600] seconds")
        self.details = {"asked_bytes": self.asked_bytes, "free_bytes": self.free_bytes, "zone": self.zone}

    def __str__(self) -> str:
        return self.message
