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
ARTIFACT_KIND_UNSPECIFIED: ArtifactKind
ARTIFACT_KIND_PTX: ArtifactKind
ARTIFACT_KIND_CUBIN: ArtifactKind

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
    __slots__ = ("entries", "total_bytes", "budget_bytes", "hits", "misses", "evictions", "stores", "corrupt", "digest_conflicts", "compile_seconds_saved", "db_file_bytes", "namespaces", "quarantined", "max_artifact_bytes", "low_watermark")
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
    def __init__(self, entries: _Optional[int] = ..., total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., stores: _Optional[int] = ..., corrupt: _Optional[int] = ..., digest_conflicts: _Optional[int] = ..., compile_seconds_saved: _Optional[float] = ..., db_file_bytes: _Optional[int] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ..., quarantined: _Optional[int] = ..., max_artifact_bytes: _Optional[int] = ..., low_watermark: _Optional[float] = ...) -> None: ...

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
