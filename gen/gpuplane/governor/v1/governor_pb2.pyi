from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Zone(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ZONE_UNSPECIFIED: _ClassVar[Zone]
    ZONE_WEIGHTS: _ClassVar[Zone]
    ZONE_KV: _ClassVar[Zone]
    ZONE_WORKSPACE: _ClassVar[Zone]
    ZONE_ACTIVATIONS: _ClassVar[Zone]
    ZONE_GRAPHS: _ClassVar[Zone]
    ZONE_SCRATCH: _ClassVar[Zone]
    ZONE_TRANSIENT: _ClassVar[Zone]
    ZONE_CONTEXT: _ClassVar[Zone]
    ZONE_FOREIGN: _ClassVar[Zone]
ZONE_UNSPECIFIED: Zone
ZONE_WEIGHTS: Zone
ZONE_KV: Zone
ZONE_WORKSPACE: Zone
ZONE_ACTIVATIONS: Zone
ZONE_GRAPHS: Zone
ZONE_SCRATCH: Zone
ZONE_TRANSIENT: Zone
ZONE_CONTEXT: Zone
ZONE_FOREIGN: Zone

class Device(_message.Message):
    __slots__ = ("uuid", "total_bytes", "free_bytes", "granule_bytes", "name")
    UUID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    GRANULE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    total_bytes: int
    free_bytes: int
    granule_bytes: int
    name: str
    def __init__(self, uuid: _Optional[str] = ..., total_bytes: _Optional[int] = ..., free_bytes: _Optional[int] = ..., granule_bytes: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class Lease(_message.Message):
    __slots__ = ("lease_id", "worker_id", "device_uuid", "zone", "bytes", "expires_at_unix_ms")
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    lease_id: str
    worker_id: str
    device_uuid: str
    zone: Zone
    bytes: int
    expires_at_unix_ms: int
    def __init__(self, lease_id: _Optional[str] = ..., worker_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., zone: _Optional[_Union[Zone, str]] = ..., bytes: _Optional[int] = ..., expires_at_unix_ms: _Optional[int] = ...) -> None: ...

class ZoneUsage(_message.Message):
    __slots__ = ("zone", "committed_bytes", "content_bytes", "leased_bytes", "budget_bytes", "borrowed_bytes", "cached_bytes")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    BORROWED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    zone: Zone
    committed_bytes: int
    content_bytes: int
    leased_bytes: int
    budget_bytes: int
    borrowed_bytes: int
    cached_bytes: int
    def __init__(self, zone: _Optional[_Union[Zone, str]] = ..., committed_bytes: _Optional[int] = ..., content_bytes: _Optional[int] = ..., leased_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., borrowed_bytes: _Optional[int] = ..., cached_bytes: _Optional[int] = ...) -> None: ...

class Reclaim(_message.Message):
    __slots__ = ("zone", "bytes", "cached_only")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_ONLY_FIELD_NUMBER: _ClassVar[int]
    zone: Zone
    bytes: int
    cached_only: bool
    def __init__(self, zone: _Optional[_Union[Zone, str]] = ..., bytes: _Optional[int] = ..., cached_only: _Optional[bool] = ...) -> None: ...

class ZoneCap(_message.Message):
    __slots__ = ("zone", "bytes")
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    zone: Zone
    bytes: int
    def __init__(self, zone: _Optional[_Union[Zone, str]] = ..., bytes: _Optional[int] = ...) -> None: ...

class RegisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "device", "host", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device: Device
    host: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., device: _Optional[_Union[Device, _Mapping]] = ..., host: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class RegisterWorkerResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "device_budget_bytes", "leases", "zone_caps", "incarnation")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    DEVICE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ZONE_CAPS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    device_budget_bytes: int
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    zone_caps: _containers.RepeatedCompositeFieldContainer[ZoneCap]
    incarnation: str
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., device_budget_bytes: _Optional[int] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., zone_caps: _Optional[_Iterable[_Union[ZoneCap, _Mapping]]] = ..., incarnation: _Optional[str] = ...) -> None: ...

class AcquireRequest(_message.Message):
    __slots__ = ("worker_id", "device_uuid", "zone", "bytes", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device_uuid: str
    zone: Zone
    bytes: int
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., zone: _Optional[_Union[Zone, str]] = ..., bytes: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class AcquireResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ResizeRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "bytes", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    bytes: int
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., bytes: _Optional[int] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ResizeResponse(_message.Message):
    __slots__ = ("lease",)
    LEASE_FIELD_NUMBER: _ClassVar[int]
    lease: Lease
    def __init__(self, lease: _Optional[_Union[Lease, _Mapping]] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("worker_id", "lease_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    lease_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., lease_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("worker_id", "device_uuid", "device_used_bytes", "process_used_bytes", "zones", "incarnation", "host_weights_bytes", "host_kv_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZONES_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    HOST_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    device_uuid: str
    device_used_bytes: int
    process_used_bytes: int
    zones: _containers.RepeatedCompositeFieldContainer[ZoneUsage]
    incarnation: str
    host_weights_bytes: int
    host_kv_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., device_uuid: _Optional[str] = ..., device_used_bytes: _Optional[int] = ..., process_used_bytes: _Optional[int] = ..., zones: _Optional[_Iterable[_Union[ZoneUsage, _Mapping]]] = ..., incarnation: _Optional[str] = ..., host_weights_bytes: _Optional[int] = ..., host_kv_bytes: _Optional[int] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("lease_ttl_ms", "reregister", "reclaim", "zone_caps")
    LEASE_TTL_MS_FIELD_NUMBER: _ClassVar[int]
    REREGISTER_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    ZONE_CAPS_FIELD_NUMBER: _ClassVar[int]
    lease_ttl_ms: int
    reregister: bool
    reclaim: _containers.RepeatedCompositeFieldContainer[Reclaim]
    zone_caps: _containers.RepeatedCompositeFieldContainer[ZoneCap]
    def __init__(self, lease_ttl_ms: _Optional[int] = ..., reregister: _Optional[bool] = ..., reclaim: _Optional[_Iterable[_Union[Reclaim, _Mapping]]] = ..., zone_caps: _Optional[_Iterable[_Union[ZoneCap, _Mapping]]] = ...) -> None: ...

class WorkerResources(_message.Message):
    __slots__ = ("worker_id", "host", "leased_bytes", "committed_bytes", "content_bytes", "last_heartbeat_unix_ms", "zones", "process_used_bytes", "leases", "host_weights_bytes", "host_kv_bytes")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CONTENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    ZONES_FIELD_NUMBER: _ClassVar[int]
    PROCESS_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    HOST_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    host: str
    leased_bytes: int
    committed_bytes: int
    content_bytes: int
    last_heartbeat_unix_ms: int
    zones: _containers.RepeatedCompositeFieldContainer[ZoneUsage]
    process_used_bytes: int
    leases: _containers.RepeatedCompositeFieldContainer[Lease]
    host_weights_bytes: int
    host_kv_bytes: int
    def __init__(self, worker_id: _Optional[str] = ..., host: _Optional[str] = ..., leased_bytes: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., content_bytes: _Optional[int] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., zones: _Optional[_Iterable[_Union[ZoneUsage, _Mapping]]] = ..., process_used_bytes: _Optional[int] = ..., leases: _Optional[_Iterable[_Union[Lease, _Mapping]]] = ..., host_weights_bytes: _Optional[int] = ..., host_kv_bytes: _Optional[int] = ...) -> None: ...

class DeviceResources(_message.Message):
    __slots__ = ("uuid", "total_bytes", "budget_bytes", "leased_bytes", "device_used_bytes", "ledger_bytes", "unaccounted_bytes", "free_budget_bytes", "zones", "workers", "unaccounted_alert", "transient_headroom_bytes", "name", "granule_bytes")
    UUID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FREE_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZONES_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_ALERT_FIELD_NUMBER: _ClassVar[int]
    TRANSIENT_HEADROOM_BYTES_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GRANULE_BYTES_FIELD_NUMBER: _ClassVar[int]
    uuid: str
    total_bytes: int
    budget_bytes: int
    leased_bytes: int
    device_used_bytes: int
    ledger_bytes: int
    unaccounted_bytes: int
    free_budget_bytes: int
    zones: _containers.RepeatedCompositeFieldContainer[ZoneUsage]
    workers: _containers.RepeatedCompositeFieldContainer[WorkerResources]
    unaccounted_alert: bool
    transient_headroom_bytes: int
    name: str
    granule_bytes: int
    def __init__(self, uuid: _Optional[str] = ..., total_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., leased_bytes: _Optional[int] = ..., device_used_bytes: _Optional[int] = ..., ledger_bytes: _Optional[int] = ..., unaccounted_bytes: _Optional[int] = ..., free_budget_bytes: _Optional[int] = ..., zones: _Optional[_Iterable[_Union[ZoneUsage, _Mapping]]] = ..., workers: _Optional[_Iterable[_Union[WorkerResources, _Mapping]]] = ..., unaccounted_alert: _Optional[bool] = ..., transient_headroom_bytes: _Optional[int] = ..., name: _Optional[str] = ..., granule_bytes: _Optional[int] = ...) -> None: ...

class GetResourcesRequest(_message.Message):
    __slots__ = ("device_uuid",)
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    def __init__(self, device_uuid: _Optional[str] = ...) -> None: ...

class GetResourcesResponse(_message.Message):
    __slots__ = ("devices",)
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    devices: _containers.RepeatedCompositeFieldContainer[DeviceResources]
    def __init__(self, devices: _Optional[_Iterable[_Union[DeviceResources, _Mapping]]] = ...) -> None: ...

class WatchResourcesRequest(_message.Message):
    __slots__ = ("device_uuid",)
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    device_uuid: str
    def __init__(self, device_uuid: _Optional[str] = ...) -> None: ...

class DeregisterWorkerRequest(_message.Message):
    __slots__ = ("worker_id", "incarnation")
    WORKER_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    worker_id: str
    incarnation: str
    def __init__(self, worker_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class DeregisterWorkerResponse(_message.Message):
    __slots__ = ("released_bytes",)
    RELEASED_BYTES_FIELD_NUMBER: _ClassVar[int]
    released_bytes: int
    def __init__(self, released_bytes: _Optional[int] = ...) -> None: ...
