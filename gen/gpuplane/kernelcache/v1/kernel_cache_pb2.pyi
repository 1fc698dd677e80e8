from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ArtifactKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ARTIFACT_KIND_UNSPECIFIED: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_PTX: _ClassVar[ArtifactKind]
    ARTIFACT_KIND_CUBIN: _ClassVar[ArtifactKind]

class ClaimOutcome(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLAIM_OUTCOME_UNSPECIFIED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_GRANTED: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_FOUND: _ClassVar[ClaimOutcome]
    CLAIM_OUTCOME_HELD: _ClassVar[ClaimOutcome]
ARTIFACT_KIND_UNSPECIFIED: ArtifactKind
ARTIFACT_KIND_PTX: ArtifactKind
ARTIFACT_KIND_CUBIN: ArtifactKind
CLAIM_OUTCOME_UNSPECIFIED: ClaimOutcome
CLAIM_OUTCOME_GRANTED: ClaimOutcome
CLAIM_OUTCOME_FOUND: ClaimOutcome
CLAIM_OUTCOME_HELD: ClaimOutcome

class Artifact(_message.Message):
    __slots__ = ("data", "sha256", "kind", "arch", "nvrtc_version", "module_name", "compile_seconds")
    DATA_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    ARCH_FIELD_NUMBER: _ClassVar[int]
    NVRTC_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODULE_NAME_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    sha256: str
    kind: ArtifactKind
    arch: str
    nvrtc_version: str
    module_name: str
    compile_seconds: float
    def __init__(self, data: _Optional[bytes] = ..., sha256: _Optional[str] = ..., kind: _Optional[_Union[ArtifactKind, str]] = ..., arch: _Optional[str] = ..., nvrtc_version: _Optional[str] = ..., module_name: _Optional[str] = ..., compile_seconds: _Optional[float] = ...) -> None: ...

class StoreRequest(_message.Message):
    __slots__ = ("key", "namespace", "artifact")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    key: str
    namespace: str
    artifact: Artifact
    def __init__(self, key: _Optional[str] = ..., namespace: _Optional[str] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ...) -> None: ...

class StoreResponse(_message.Message):
    __slots__ = ("stored", "digest_conflict", "evicted_entries")
    STORED_FIELD_NUMBER: _ClassVar[int]
    DIGEST_CONFLICT_FIELD_NUMBER: _ClassVar[int]
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    digest_conflict: bool
    evicted_entries: int
    def __init__(self, stored: _Optional[bool] = ..., digest_conflict: _Optional[bool] = ..., evicted_entries: _Optional[int] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("key", "namespace")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    key: str
    namespace: str
    def __init__(self, key: _Optional[str] = ..., namespace: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "artifact", "omitted")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    OMITTED_FIELD_NUMBER: _ClassVar[int]
    found: bool
    artifact: Artifact
    omitted: bool
    def __init__(self, found: _Optional[bool] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ..., omitted: _Optional[bool] = ...) -> None: ...

class BatchLookupRequest(_message.Message):
    __slots__ = ("keys", "namespace")
    KEYS_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    keys: _containers.RepeatedScalarFieldContainer[str]
    namespace: str
    def __init__(self, keys: _Optional[_Iterable[str]] = ..., namespace: _Optional[str] = ...) -> None: ...

class BatchLookupResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[LookupResponse]
    def __init__(self, results: _Optional[_Iterable[_Union[LookupResponse, _Mapping]]] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("namespace", "entries", "total_bytes", "budget_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    entries: int
    total_bytes: int
    budget_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., entries: _Optional[int] = ..., total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ...) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("entries", "total_bytes", "budget_bytes", "hits", "misses", "evictions", "stores", "corrupt", "digest_conflicts", "compile_seconds_saved", "db_file_bytes", "namespaces", "quarantined", "max_artifact_bytes", "low_watermark", "claims", "hot_entries", "hot_bytes", "hot_budget_bytes", "hot_hits", "bytes_served")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    STORES_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_FIELD_NUMBER: _ClassVar[int]
    DIGEST_CONFLICTS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_SAVED_FIELD_NUMBER: _ClassVar[int]
    DB_FILE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    MAX_ARTIFACT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LOW_WATERMARK_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_FIELD_NUMBER: _ClassVar[int]
    HOT_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HOT_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOT_HITS_FIELD_NUMBER: _ClassVar[int]
    BYTES_SERVED_FIELD_NUMBER: _ClassVar[int]
    entries: int
    total_bytes: int
    budget_bytes: int
    hits: int
    misses: int
    evictions: int
    stores: int
    corrupt: int
    digest_conflicts: int
    compile_seconds_saved: float
    db_file_bytes: int
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    quarantined: int
    max_artifact_bytes: int
    low_watermark: float
    claims: ClaimStats
    hot_entries: int
    hot_bytes: int
    hot_budget_bytes: int
    hot_hits: int
    bytes_served: int
    def __init__(self, entries: _Optional[int] = ..., total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stores: _Optional[int] = ..., corrupt: _Optional[int] = ..., digest_conflicts: _Optional[int] = ..., compile_seconds_saved: _Optional[float] = ..., db_file_bytes: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., quarantined: _Optional[int] = ..., max_artifact_bytes: _Optional[int] = ..., low_watermark: _Optional[float] = ..., claims: _Optional[_Union[ClaimStats, _Mapping]] = ..., hot_entries: _Optional[int] = ..., hot_bytes: _Optional[int] = ..., hot_budget_bytes: _Optional[int] = ..., hot_hits: _Optional[int] = ..., bytes_served: _Optional[int] = ...) -> None: ...

class ClaimStats(_message.Message):
    __slots__ = ("granted", "waits", "wait_hits", "expired", "released", "active", "waiting", "renewed")
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    WAITS_FIELD_NUMBER: _ClassVar[int]
    WAIT_HITS_FIELD_NUMBER: _ClassVar[int]
    EXPIRED_FIELD_NUMBER: _ClassVar[int]
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RENEWED_FIELD_NUMBER: _ClassVar[int]
    granted: int
    waits: int
    wait_hits: int
    expired: int
    released: int
    active: int
    waiting: int
    renewed: int
    def __init__(self, granted: _Optional[int] = ..., waits: _Optional[int] = ..., wait_hits: _Optional[int] = ..., expired: _Optional[int] = ..., released: _Optional[int] = ..., active: _Optional[int] = ..., waiting: _Optional[int] = ..., renewed: _Optional[int] = ...) -> None: ...

class PruneRequest(_message.Message):
    __slots__ = ("target_bytes",)
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_bytes: int
    def __init__(self, target_bytes: _Optional[int] = ...) -> None: ...

class PruneResponse(_message.Message):
    __slots__ = ("evicted_entries", "freed_bytes", "total_bytes")
    EVICTED_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    evicted_entries: int
    freed_bytes: int
    total_bytes: int
    def __init__(self, evicted_entries: _Optional[int] = ..., freed_bytes: _Optional[int] = ..., total_bytes: _Optional[int] = ...) -> None: ...

class ClaimRequest(_message.Message):
    __slots__ = ("key", "namespace", "holder", "ttl_s", "wait_s")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    key: str
    namespace: str
    holder: str
    ttl_s: float
    wait_s: float
    def __init__(self, key: _Optional[str] = ..., namespace: _Optional[str] = ..., holder: _Optional[str] = ..., ttl_s: _Optional[float] = ..., wait_s: _Optional[float] = ...) -> None: ...

class ClaimResponse(_message.Message):
    __slots__ = ("outcome", "artifact", "expires_in_s", "took_over", "retry_after_s", "waited")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    TOOK_OVER_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    WAITED_FIELD_NUMBER: _ClassVar[int]
    outcome: ClaimOutcome
    artifact: Artifact
    expires_in_s: float
    took_over: bool
    retry_after_s: float
    waited: bool
    def __init__(self, outcome: _Optional[_Union[ClaimOutcome, str]] = ..., artifact: _Optional[_Union[Artifact, _Mapping]] = ..., expires_in_s: _Optional[float] = ..., took_over: _Optional[bool] = ..., retry_after_s: _Optional[float] = ..., waited: _Optional[bool] = ...) -> None: ...

class ReleaseClaimRequest(_message.Message):
    __slots__ = ("key", "namespace", "holder")
    KEY_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    HOLDER_FIELD_NUMBER: _ClassVar[int]
    key: str
    namespace: str
    holder: str
    def __init__(self, key: _Optional[str] = ..., namespace: _Optional[str] = ..., holder: _Optional[str] = ...) -> None: ...

class ReleaseClaimResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...
