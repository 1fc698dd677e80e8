"""WorkerService over gRPC: a thin layer over `gpu_worker.core.runtime.WorkerRuntime`.

Each handler validates what the wire can get wrong, converts, calls the runtime and converts
back. Errors travel as `services.common.errors` exceptions, mapped to status codes by the common
interceptor. The runtime owns the domain checks (vocabulary, context, admission); the servicer
repeats the cheap ones against the model's published limits so a bad request is refused before it
queues behind other requests, and changes nothing either way.

Cancellation is the hazard here: a client that disconnects or whose deadline passes must not
leave its request's KV cache and activations booked. `Generate` hands the runtime a
`cancelled()` callable that turns true when the RPC is no longer active, and always closes the
token generator, so the runtime's cleanup runs on the handler thread before the handler returns.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message
from gpuplane.governor.v1 import governor_pb2
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc
from opentelemetry import trace

from gpu_worker.edge.access import ACCESS
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.sampling import from_message as sampling_from_message
from services.common import errors
from services.common.authz import table
from services.common.security import ServerSecurity
from services.common.server import RunningServer, ServiceRegistration, create_server

log = logging.getLogger(__name__)

# Upper bound on one request's new tokens, far above any tiny or benchmark context; the runtime
# refuses anything that would not fit the model's context anyway. It keeps a typo (1e9) from
# reaching the runtime at all.
MAX_NEW_TOKENS_LIMIT = 1 << 20
MAX_EMBED_BATCH = 4096


def model_info_message(info: Any) -> worker_pb2.ModelInfo:
    """The wire form of the runtime's ModelInfo-like object (dataclass or dict)."""
    return _fill(worker_pb2.ModelInfo(), _as_mapping(info))


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


def zone_name(zone: int) -> str:
    """ZONE_KV -> "kv": the Python spelling of a governor zone."""
    return governor_pb2.Zone.Name(zone).removeprefix("ZONE_").lower()


def _zone_enum(name: Any) -> int:
    if isinstance(name, int):
        return name
    return governor_pb2.Zone.Value("ZONE_" + str(name).upper())


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


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """gRPC handlers; `runtime` is a started `WorkerRuntime`."""

    def __init__(self, runtime: Any) -> None:
        self.runtime = runtime

    # -- models -----------------------------------------------------------------------------
    def LoadModel(self, request: worker_pb2.LoadModelRequest, context: grpc.ServicerContext
                  ) -> worker_pb2.LoadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to load")
        if request.checkpoint:
            _tag(model_id=request.model_id, checkpoint=request.checkpoint)
            started = time.perf_counter()
            loaded = self.runtime.load_model(request.model_id, "", "", 0,
                                             checkpoint=request.checkpoint,
                                             weight_format=request.weight_format)
            return self._loaded(loaded, started)
        _require(request.family, "family is empty: use 'decoder' or 'encoder' (or a checkpoint)")
        _require(request.config, "config is empty: use a named size such as 'tiny'")
        if request.weight_format:
            raise errors.InvalidArgument("weight_format applies to checkpoints only")
        _tag(model_id=request.model_id, family=request.family, config=request.config)
        started = time.perf_counter()
        loaded = self.runtime.load_model(request.model_id, request.family, request.config,
                                         int(request.seed))
        return self._loaded(loaded, started)

    @staticmethod
    def _loaded(loaded: Any, started: float) -> worker_pb2.LoadModelResponse:
        fields = dict(_as_mapping(loaded))
        info = fields.get("info") or fields.get("model") or loaded
        response = worker_pb2.LoadModelResponse(model=model_info_message(info))
        response.load_seconds = float(fields.get("load_seconds") or time.perf_counter() - started)
        response.kernels_compiled = int(fields.get("kernels_compiled") or 0)
        response.kernels_from_cache = int(fields.get("kernels_from_cache") or 0)
        return response

    def UnloadModel(self, request: worker_pb2.UnloadModelRequest, context: grpc.ServicerContext
                    ) -> worker_pb2.UnloadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to unload")
        return worker_pb2.UnloadModelResponse(freed_bytes=int(self.runtime.unload_model(request.model_id)))

    def OffloadModel(self, request: worker_pb2.OffloadModelRequest, context: grpc.ServicerContext
                     ) -> worker_pb2.OffloadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to offload")
        _tag(model_id=request.model_id)
        info, freed = self.runtime.offload_model(request.model_id)
        return worker_pb2.OffloadModelResponse(model=model_info_message(info), freed_bytes=int(freed))

    def ListModels(self, request: worker_pb2.ListModelsRequest, context: grpc.ServicerContext
                   ) -> worker_pb2.ListModelsResponse:
        return worker_pb2.ListModelsResponse(
            models=[model_info_message(m) for m in self.runtime.list_models()])

    # -- inference --------------------------------------------------------------------------
    def Generate(self, request: worker_pb2.GenerateRequest, context: grpc.ServicerContext
                 ) -> Iterator[worker_pb2.GenerateResponse]:
        _tag(model_id=request.model_id)
        info = self._model(request.model_id)
        eos = self.runtime.eos_token_ids(request.model_id)  # now: the model may go mid-stream
        if request.prompt and request.prompt_tokens:
            raise errors.InvalidArgument("send prompt (text) or prompt_tokens, not both")
        # Text in means text out: a decoder per request keeps characters split across tokens
        # whole, so the stream's `text` fields concatenate to the decoded output.
        codec = self.runtime.codec(request.model_id) if request.prompt else None
        prompt = codec.encode(request.prompt) if codec else list(request.prompt_tokens)
        text = codec.stream() if codec else None
        _tag(prompt_tokens=len(prompt), max_new_tokens=request.max_new_tokens)
        _check_prompt(prompt, info)
        if not 0 < request.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise errors.InvalidArgument(
                f"max_new_tokens={request.max_new_tokens} must be between 1 and the model's context",
                max_new_tokens=request.max_new_tokens)
        max_context = int(_as_mapping(info).get("max_context") or 0)
        if max_context and len(prompt) + request.max_new_tokens > max_context:
            raise errors.InvalidArgument(
                f"prompt of {len(prompt)} tokens + max_new_tokens={request.max_new_tokens} exceeds "
                f"the context of model {request.model_id!r} ({max_context} tokens)",
                prompt_tokens=len(prompt), max_context=max_context)

        # The callback fires on disconnect, cancellation and deadline expiry alike; the event
        # lets the runtime poll cheaply between decode steps.
        gone = threading.Event()
        context.add_callback(gone.set)
        started = time.perf_counter()
        sampling = GREEDY
        if request.HasField("sampling"):
            sp = request.sampling
            sampling = sampling_from_message(sp.temperature, sp.top_p, sp.top_k, sp.seed,
                                             list(sp.stop_token_ids))
        tokens = self.runtime.generate(request.model_id, prompt, int(request.max_new_tokens),
                                       cancelled=lambda: gone.is_set() or not context.is_active(),
                                       sampling=sampling)
        first = True
        last = None
        try:
            for chunk in tokens:
                if gone.is_set():
                    break
                response = worker_pb2.GenerateResponse(tokens=[int(t) for t in chunk])
                last = int(chunk[-1]) if chunk else last
                if text is not None:
                    response.text = text.push(chunk)
                if first:
                    response.first_token_seconds = time.perf_counter() - started
                    response.prompt_tokens = len(prompt)
                    first = False
                yield response
        finally:
            # Runs the runtime's cleanup now, on this thread, even when the client went away
            # mid-stream: the request's KV and activations are freed before the handler returns.
            close = getattr(tokens, "close", None)
            if close is not None:
                close()
        if not gone.is_set():
            done = worker_pb2.GenerateResponse(done=True, prompt_tokens=len(prompt))
            done.stopped_at_eos = last in eos
            done.finish_reason = getattr(tokens, "finish_reason", "") or (
                "stop" if last in eos else "length")
            if text is not None:
                done.text = text.finish()
            yield done

    def Embed(self, request: worker_pb2.EmbedRequest, context: grpc.ServicerContext
              ) -> worker_pb2.EmbedResponse:
        if request.texts:
            if request.sequences:
                raise errors.InvalidArgument("send sequences (token ids) or texts, not both")
            if len(request.texts) > MAX_EMBED_BATCH:
                raise errors.InvalidArgument(
                    f"{len(request.texts)} texts exceed the batch limit of {MAX_EMBED_BATCH}")
            _tag(model_id=request.model_id, batch=len(request.texts))
            self._model(request.model_id)
            vectors = self.runtime.embed_texts(request.model_id, list(request.texts),
                                               cancelled=_gone(context))
            return worker_pb2.EmbedResponse(
                embeddings=[worker_pb2.Embedding(values=[float(x) for x in row]) for row in vectors])
        sequences = [list(s.tokens) for s in request.sequences]
        _tag(model_id=request.model_id, batch=len(sequences),
             seq=len(sequences[0]) if sequences else 0)
        info = self._model(request.model_id)
        if not sequences:
            raise errors.InvalidArgument("sequences is empty: send at least one token sequence")
        if len(sequences) > MAX_EMBED_BATCH:
            raise errors.InvalidArgument(
                f"{len(sequences)} sequences exceed the batch limit of {MAX_EMBED_BATCH}")
        for seq in sequences:   # lengths may differ: the encoder masks its padding
            _check_prompt(seq, info)
        vectors = self.runtime.embed(request.model_id, sequences, cancelled=_gone(context))
        return worker_pb2.EmbedResponse(
            embeddings=[worker_pb2.Embedding(values=[float(x) for x in row]) for row in vectors])

    # -- operations -------------------------------------------------------------------------
    def GetStats(self, request: worker_pb2.GetStatsRequest, context: grpc.ServicerContext
                 ) -> worker_pb2.GetStatsResponse:
        return stats_message(self.runtime.stats())

    def Trim(self, request: worker_pb2.TrimRequest, context: grpc.ServicerContext
             ) -> worker_pb2.TrimResponse:
        if request.target_bytes < 0:
            raise errors.InvalidArgument(f"target_bytes={request.target_bytes} is negative")
        freed, ledger = self.runtime.trim(int(request.target_bytes))
        return worker_pb2.TrimResponse(freed_bytes=int(freed), ledger_bytes=int(ledger))

    def _model(self, model_id: str) -> Any:
        _require(model_id, "model_id is empty: name a loaded model (see ListModels)")
        for info in self.runtime.list_models():
            if _as_mapping(info).get("model_id") == model_id:
                return info
        raise errors.NotFound(f"model {model_id!r} is not loaded on this worker (see ListModels)",
                              model_id=model_id)


def _gone(context: grpc.ServicerContext) -> Callable[[], bool]:
    """True once the RPC is cancelled, disconnected or past its deadline (Embed's batcher polls
    it while the request waits for a batch)."""
    gone = threading.Event()
    context.add_callback(gone.set)
    return lambda: gone.is_set() or not context.is_active()


def _tag(**attributes: str | int) -> None:
    """Domain attributes (model, shape) on the server span the tracing interceptor opened."""
    span = trace.get_current_span()
    for key, value in attributes.items():
        span.set_attribute(f"gpuplane.{key}", value)


def _require(value: str, message: str) -> None:
    if not value:
        raise errors.InvalidArgument(message)


def _check_prompt(tokens: list[int], info: Any) -> None:
    fields = _as_mapping(info)
    if not tokens:
        raise errors.InvalidArgument("the token sequence is empty: send at least one token")
    vocab = int(fields.get("vocab_size") or 0)
    bad = [t for t in tokens if t < 0 or (vocab and t >= vocab)]
    if bad:
        raise errors.InvalidArgument(
            f"token {bad[0]} is outside the vocabulary of model {fields.get('model_id')!r} "
            f"(0..{vocab - 1})", token=bad[0], vocab_size=vocab)
    max_context = int(fields.get("max_context") or 0)
    if max_context and len(tokens) > max_context:
        raise errors.InvalidArgument(
            f"{len(tokens)} tokens exceed the context of model {fields.get('model_id')!r} "
            f"({max_context} tokens)", tokens=len(tokens), max_context=max_context)


def serve_worker(runtime: Any, listen: str, tracer_provider: Any, max_workers: int = 32,
                 security: ServerSecurity | None = None) -> RunningServer:
    """Start WorkerService for `runtime` on `listen`; the runtime is closed when the server stops."""
    servicer = WorkerServicer(runtime)
    registration = ServiceRegistration(
        full_name=worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
        servicer=servicer,
        add=worker_pb2_grpc.add_WorkerServiceServicer_to_server,
    )
    server = create_server(listen, [registration], tracer_provider, max_workers=max_workers,
                           security=security, access=table(registration.full_name, ACCESS))
    server.on_stop.append(runtime.close)
    budget = getattr(runtime, "budget", None)
    if hasattr(budget, "deliver_standing"):  # NOT_SERVING while the governor refuses our id
        budget.on_standing = server.set_serving
        budget.deliver_standing()
    return server
