"""Message conversion for WorkerService: the runtime's domain objects to and from the wire.

ModelInfo and LoadModelResponse are plain field-by-field copies. GetStatsResponse is filled from
the runtime's nested stats dict by field name (`_fill`): the dict carries ~60 figures in nested
groups whose names are the proto's, and it may report more than the proto carries (ignored on
purpose), so a name-driven copy reads better there than sixty assignments.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from gpuplane.governor.v1 import governor_pb2
from gpuplane.worker.v1 import worker_pb2

from gpu_worker.core.loaded_model import LoadResult, ModelInfo
from services.common.zones import zone_value


def model_info_message(info: ModelInfo) -> worker_pb2.ModelInfo:
    return worker_pb2.ModelInfo(
        model_id=info.model_id, family=info.family, config=info.config, seed=int(info.seed),
        vocab_size=int(info.vocab_size), max_context=int(info.max_context),
        weight_bytes=int(info.weight_bytes), checkpoint=info.checkpoint,
        architecture=info.architecture, weight_format=info.weight_format,
        has_tokenizer=bool(info.has_tokenizer), resident_bytes=int(info.resident_bytes),
        state=info.state)


def load_response(result: LoadResult) -> worker_pb2.LoadModelResponse:
    return worker_pb2.LoadModelResponse(
        model=model_info_message(result.info), load_seconds=float(result.load_seconds),
        kernels_compiled=int(result.kernels_compiled),
        kernels_from_cache=int(result.kernels_from_cache))


def stats_message(stats: Mapping[str, Any]) -> worker_pb2.GetStatsResponse:
    """Map the runtime's nested stats dict onto GetStatsResponse (names match the proto)."""
    stats = dict(stats)
    zones = stats.pop("zones", None)
    response = _fill(worker_pb2.GetStatsResponse(), stats)
    for usage in zone_usages(zones):
        response.zones.append(usage)
    return response


def zone_usages(zones: Any) -> list[governor_pb2.ZoneUsage]:
    """Zones as `{zone: (committed, content)}`, `{zone: {...}}` or a list of dicts -> ZoneUsage."""
    if not zones:
        return []
    items: list[tuple[str, Any]]
    if isinstance(zones, Mapping):
        items = list(zones.items())
    else:
        items = [(_as_mapping(z)["zone"], _as_mapping(z)) for z in zones]
    out = []
    for name, value in sorted(items, key=lambda kv: _zone_enum(kv[0])):
        usage = governor_pb2.ZoneUsage(zone=_zone_enum(name))
        if isinstance(value, (tuple, list)):
            usage.committed_bytes, usage.content_bytes = int(value[0]), int(value[1])
        else:
            fields = {k: v for k, v in _as_mapping(value).items() if k != "zone"}
            _fill(usage, fields)
        out.append(usage)
    return out


def _zone_enum(name: Any) -> int:
    return name if isinstance(name, int) else zone_value(str(name))


def _as_mapping(obj: Any) -> Mapping[str, Any]:
    if isinstance(obj, Mapping):
        return obj
    if hasattr(obj, "__dataclass_fields__"):
        return {name: getattr(obj, name) for name in obj.__dataclass_fields__}
    return vars(obj)


def _fill(message: Message, values: Mapping[str, Any]) -> Message:
    """Copy matching keys into scalar and nested fields; unknown keys are ignored on purpose
    (the runtime may report more than the proto carries)."""
    fields = message.DESCRIPTOR.fields_by_name
    for key, value in values.items():
        field = fields.get(key)
        if field is None or value is None:
            continue
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            if not _repeated(field) and isinstance(value, Mapping):
                _fill(getattr(message, key), value)
            continue
        if _repeated(field):
            continue
        setattr(message, key, _coerce(field, value))
    return message


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 7 dropped `label` in favour of `is_repeated`; older runtimes only have `label`.
    if hasattr(field, "is_repeated"):
        return bool(field.is_repeated)
    return field.label == FieldDescriptor.LABEL_REPEATED


def _coerce(field: FieldDescriptor, value: Any) -> Any:
    if field.type in (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT):
        return float(value)
    if field.type == FieldDescriptor.TYPE_BOOL:
        return bool(value)
    if field.type == FieldDescriptor.TYPE_STRING:
        return str(value)
    return int(value)
