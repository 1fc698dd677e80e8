"""WorkerService over gRPC: a thin layer over `gpu_worker.core.runtime.WorkerRuntime`.

Each handler validates what the wire can get wrong, converts, calls the runtime and converts
back. Errors travel as `services.common.errors` exceptions, mapped to status codes by the common
interceptor. The runtime owns the domain checks (vocabulary, context, admission); the servicer
checks every size-bearing field against its bound first (O(1), before any work), then repeats
the cheap domain checks against the model's published limits so a bad request is refused before
it queues behind other requests.

Served on one grpc.aio event loop (services.common.aio_server): an open Generate stream costs a
task and a bounded token buffer, never a thread, so concurrency is bounded by `--max-batch-size`
and `--max-queued` (the scheduler) and by memory, not by threads. Hazard: a handler that blocks
the loop stalls every stream, so every runtime call that may wait runs in a thread pool, and the
pools are split so that no kind of call can starve another:
- reads (GetStats, ListModels) and admin calls (LoadModel, UnloadModel, OffloadModel, Trim) each
  have their own few threads: Generate streams and Embed batches never hold them;
- a Generate's admission (validation, tokenization, the scheduler's queue) runs on its own few
  threads and returns at once; its tokens then come from the engine thread through the stream's
  `TokenBuffer` (gpu_worker/core/token_stream.py), woken on the loop;
- calls that wait for the device (Embed, a single-sequence stream) share `--max-workers` threads;
  beyond `BLOCKING_BACKLOG_PER_THREAD` waiting calls per thread they are RESOURCE_EXHAUSTED.
Thread count is therefore flat in the number of streams.

Cancellation: a client that disconnects or whose deadline passes cancels the handler's task;
its `finally` closes the stream, which cancels the sequence (its KV blocks go within one engine
step). A reader that falls `--max-stream-buffer-tokens` behind is cancelled the same way by the
buffer (RESOURCE_EXHAUSTED once it reads again); a handler still parked in a write to that
reader `stalled_write_grace_s` later is cancelled too, so a client that never reads holds
nothing but its connection.
"""
from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from gpuplane.worker.v1 import worker_pb2, worker_pb2_grpc
from grpc_health.v1 import health_pb2
from opentelemetry import trace

from gpu_worker.core.token_stream import (
    DEFAULT_STREAM_BUFFER_TOKENS,
    StreamStats,
    TokenBuffer,
    TokenStream,
    Waker,
    overflow_error,
)
from gpu_worker.edge.access import ACCESS
from gpu_worker.edge.messages import load_response, model_info_message, stats_message
from gpu_worker.engines.scheduler.sampling import GREEDY
from gpu_worker.engines.scheduler.sampling import from_message as sampling_from_message
from services.common import errors
from services.common.aio_server import AioRunningServer, create_aio_server
from services.common.authz import table
from services.common.security import ServerSecurity
from services.common.server import ServiceRegistration

log = logging.getLogger(__name__)
T = TypeVar("T")

# -- request bounds (docs/worker.md "Bounds"), each checked before any work ----------------------
# Upper bound on one request's new tokens, far above any tiny or benchmark context; the runtime
# refuses anything that would not fit the model's context anyway. It keeps a typo (1e9) from
# reaching the runtime at all.
MAX_NEW_TOKENS_LIMIT = 1 << 20
# The engine checks every emitted token against the list: a bound keeps one request from
# slowing every stream of its model (and from costing the worker memory per entry).
MAX_STOP_TOKEN_IDS = 64
# A text prompt (or Embed text) longer than this many UTF-8 bytes per token of the model's
# context cannot fit it whatever the tokenizer does; refused before tokenizing.
MAX_TEXT_BYTES_PER_TOKEN = 16
MAX_EMBED_BATCH = 4096               # texts or sequences per Embed request
MAX_EMBED_TOKENS = 1 << 22           # token ids per Embed request, over all its sequences

# -- threads (the docstring says why there are several pools) ------------------------------------
READ_THREADS = 4                     # GetStats, ListModels
ADMIN_THREADS = 4                    # LoadModel, UnloadModel, OffloadModel, Trim
ADMIT_THREADS = 4                    # a Generate's validation, tokenization and queueing
BLOCKING_BACKLOG_PER_THREAD = 8      # waiting Embed calls per --max-workers thread
# How long a handler may stay parked in a write to a reader whose buffer overflowed before its
# task is cancelled (the client then sees no status: it is not reading one).
STALLED_WRITE_GRACE_S = 10.0
# The health service name that the liveness probe asks: SERVING while the server's loop
# answers, whatever readiness says (a worker the governor refuses is alive, not ready).
LIVENESS_SERVICE = "liveness"


@dataclass(frozen=True)
class EdgeLimits:
    """The edge's own bounds (the serve flags): threads for calls that wait for the device,
    tokens a stream may buffer for a lagging reader, and tokens a message carries after a
    stream's first (`stream_interval`, docs/worker.md "Tokens per message")."""

    max_workers: int = 32
    max_stream_buffer_tokens: int = DEFAULT_STREAM_BUFFER_TOKENS
    stalled_write_grace_s: float = STALLED_WRITE_GRACE_S
    stream_interval: int = 1

    def __post_init__(self) -> None:
        if self.max_workers < 1:
            raise errors.InvalidArgument(f"max_workers={self.max_workers} must be at least 1")
        TokenBuffer(self.max_stream_buffer_tokens, interval=self.stream_interval)   # validates
        if not 0 < self.stalled_write_grace_s <= 3600:
            raise errors.InvalidArgument("stalled_write_grace_s must be in (0, 3600] seconds")


class WorkerServicer(worker_pb2_grpc.WorkerServiceServicer):
    """gRPC handlers (coroutines on the server's loop); `runtime` is a started `WorkerRuntime`.
    `streams`: where the edge's stream latencies go (the Prometheus collector reads it)."""

    def __init__(self, runtime: Any, limits: EdgeLimits | None = None,
                 streams: StreamStats | None = None) -> None:
        self.runtime = runtime
        self.limits = limits or EdgeLimits()
        self.streams = streams if streams is not None else StreamStats()
        self._reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="edge-read")
        self._admin = ThreadPoolExecutor(ADMIN_THREADS, thread_name_prefix="edge-admin")
        self._admit = ThreadPoolExecutor(ADMIT_THREADS, thread_name_prefix="edge-admit")
        self._blocking = ThreadPoolExecutor(self.limits.max_workers,
                                            thread_name_prefix="edge-blocking")
        self._blocking_calls = 0          # Embed calls running or waiting for a thread
        self._blocking_backlog = self.limits.max_workers * (1 + BLOCKING_BACKLOG_PER_THREAD)
        self._waker: Waker | None = None  # made on the loop by the first Generate

    def close(self) -> None:
        """Stop the pools (after the server drained: nothing runs on them any more)."""
        for pool in (self._reads, self._admin, self._admit, self._blocking):
            pool.shutdown(wait=False, cancel_futures=True)

    @staticmethod
    async def _call(pool: ThreadPoolExecutor, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on `pool`, in this call's context (its span, for `_tag`)."""
        ctx = contextvars.copy_context()
        return await asyncio.get_running_loop().run_in_executor(pool, ctx.run, fn, *args)

    # -- models -----------------------------------------------------------------------------
    async def LoadModel(self, request: worker_pb2.LoadModelRequest,
                        context: grpc.aio.ServicerContext) -> worker_pb2.LoadModelResponse:
        return await self._call(self._admin, self._load_model, request)

    def _load_model(self, request: worker_pb2.LoadModelRequest) -> worker_pb2.LoadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to load")
        if request.checkpoint:
            _tag(model_id=request.model_id, checkpoint=request.checkpoint)
            loaded = self.runtime.load_checkpoint(request.model_id, request.checkpoint,
                                                  request.weight_format)
            return load_response(loaded)
        _require(request.family, "family is empty: use 'decoder' or 'encoder' (or a checkpoint)")
        _require(request.config, "config is empty: use a named size such as 'tiny'")
        if request.weight_format:
            raise errors.InvalidArgument("weight_format applies to checkpoints only")
        _tag(model_id=request.model_id, family=request.family, config=request.config)
        loaded = self.runtime.load_synthetic(request.model_id, request.family, request.config,
                                             int(request.seed))
        return load_response(loaded)

    async def UnloadModel(self, request: worker_pb2.UnloadModelRequest,
                          context: grpc.aio.ServicerContext) -> worker_pb2.UnloadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to unload")
        freed = await self._call(self._admin, self.runtime.unload_model, request.model_id)
        return worker_pb2.UnloadModelResponse(freed_bytes=int(freed))

    async def OffloadModel(self, request: worker_pb2.OffloadModelRequest,
                           context: grpc.aio.ServicerContext) -> worker_pb2.OffloadModelResponse:
        _require(request.model_id, "model_id is empty: name the model to offload")
        _tag(model_id=request.model_id)
        info, freed = await self._call(self._admin, self.runtime.offload_model, request.model_id)
        return worker_pb2.OffloadModelResponse(model=model_info_message(info), freed_bytes=int(freed))

    async def ListModels(self, request: worker_pb2.ListModelsRequest,
                         context: grpc.aio.ServicerContext) -> worker_pb2.ListModelsResponse:
        models = await self._call(self._reads, self.runtime.list_models)
        return worker_pb2.ListModelsResponse(models=[model_info_message(m) for m in models])

    # -- inference --------------------------------------------------------------------------
    async def Generate(self, request: worker_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext
                       ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        started = time.perf_counter()
        _check_generate_sizes(request)
        loop = asyncio.get_running_loop()
        if self._waker is None:
            self._waker = Waker(loop)
        # Fires on disconnect, cancellation and deadline expiry alike; the engine polls it
        # between steps (the task is cancelled too, and its `finally` closes the stream).
        gone = threading.Event()
        context.add_done_callback(lambda _: gone.set())
        task = asyncio.current_task()
        writing = False

        def overflowed() -> None:        # on the loop, once, when the reader fell behind
            self.streams.overflow()
            log.info("stream cancelled: its reader fell behind",
                     extra={"model_id": request.model_id,
                            "bound": self.limits.max_stream_buffer_tokens})
            if writing and task is not None:   # parked in a write: give the reader a grace
                loop.call_later(self.limits.stalled_write_grace_s,
                                lambda: writing and task.cancel())

        buffer = TokenBuffer(self.limits.max_stream_buffer_tokens, self._waker,
                             self.limits.stream_interval)
        buffer.on_overflow_loop = overflowed
        admitted = loop.run_in_executor(self._admit, contextvars.copy_context().run,
                                        self._open_generate, request, buffer, gone)
        try:
            stream, prompt_tokens, text, eos = await asyncio.shield(admitted)
        except asyncio.CancelledError:   # the client left while we queued it: close it then
            admitted.add_done_callback(_close_orphan)
            raise
        self.streams.opened()
        pump = loop.run_in_executor(self._blocking, stream.pump) if stream.needs_pump else None
        first = last = None
        count = 0
        last_token = None
        try:
            while True:
                taken = await buffer.take()
                if taken.overflowed:
                    raise overflow_error(buffer.limit)
                if taken.tokens:
                    response = worker_pb2.GenerateResponse(tokens=taken.tokens)
                    if text is not None:
                        response.text = text.push(taken.tokens)
                    last = time.perf_counter()
                    if first is None:
                        first = last
                        response.first_token_seconds = first - started
                        response.prompt_tokens = prompt_tokens
                    count += len(taken.tokens)
                    last_token = taken.tokens[-1]
                    self.streams.sent(len(taken.tokens))
                    writing = True
                    yield response
                    writing = False
                if taken.error is not None:
                    raise taken.error
                if taken.ended:
                    break
        finally:
            writing = False
            stream.close()     # cancels the sequence unless it finished; the runtime reports
            if pump is not None:
                pump.add_done_callback(_log_pump_failure)
            self.streams.closed()
            self.streams.finished(started, first, last, count)
        done = worker_pb2.GenerateResponse(done=True, prompt_tokens=prompt_tokens)
        done.stopped_at_eos = last_token in eos
        done.finish_reason = stream.finish_reason or ("stop" if last_token in eos else "length")
        if text is not None:
            done.text = text.finish()
        yield done

    def _open_generate(self, request: worker_pb2.GenerateRequest, buffer: TokenBuffer,
                       gone: threading.Event) -> tuple[TokenStream, int, Any, tuple[int, ...]]:
        """Validate, tokenize and queue (an admit thread): the stream, its prompt length, its
        text decoder (None for token prompts) and the model's EOS ids."""
        _tag(model_id=request.model_id)
        info = self._model(request.model_id)
        eos = self.runtime.eos_token_ids(request.model_id)  # now: the model may go mid-stream
        if request.prompt and request.prompt_tokens:
            raise errors.InvalidArgument("send prompt (text) or prompt_tokens, not both")
        max_context = info.max_context
        if request.prompt:
            _check_text_size(request.prompt, max_context, "prompt")
        elif max_context and len(request.prompt_tokens) > max_context:
            raise errors.InvalidArgument(
                f"{len(request.prompt_tokens)} prompt tokens exceed the context of model "
                f"{request.model_id!r} ({max_context} tokens)",
                prompt_tokens=len(request.prompt_tokens), max_context=max_context)
        # Text in means text out: a decoder per request keeps characters split across tokens
        # whole, so the stream's `text` fields concatenate to the decoded output.
        codec = self.runtime.codec(request.model_id) if request.prompt else None
        prompt = codec.encode(request.prompt) if codec else list(request.prompt_tokens)
        text = codec.stream() if codec else None
        _tag(prompt_tokens=len(prompt), max_new_tokens=request.max_new_tokens)
        # the prompt's one check (empty, context, vocabulary) is the runtime's, at submit
        sampling = GREEDY
        if request.HasField("sampling"):
            sp = request.sampling
            sampling = sampling_from_message(sp.temperature, sp.top_p, sp.top_k, sp.seed,
                                             list(sp.stop_token_ids))
        stream = self.runtime.generate(request.model_id, prompt, int(request.max_new_tokens),
                                       cancelled=gone.is_set, sampling=sampling, buffer=buffer)
        return stream, len(prompt), text, tuple(eos)

    async def Embed(self, request: worker_pb2.EmbedRequest, context: grpc.aio.ServicerContext
                    ) -> worker_pb2.EmbedResponse:
        _check_embed_sizes(request)
        if self._blocking_calls >= self._blocking_backlog:
            raise errors.ResourceExhausted(
                f"{self._blocking_calls} Embed calls are already running or waiting on this "
                f"worker ({BLOCKING_BACKLOG_PER_THREAD} per --max-workers thread, --max-workers "
                f"{self.limits.max_workers}); retry later", asked_bytes=0, free_bytes=0, zone="")
        gone = threading.Event()
        context.add_done_callback(lambda _: gone.set())
        self._blocking_calls += 1        # only the loop thread counts: no lock
        try:
            vectors = await self._call(self._blocking, self._embed, request, gone)
        finally:
            self._blocking_calls -= 1
        return worker_pb2.EmbedResponse(
            embeddings=[worker_pb2.Embedding(values=[float(x) for x in row]) for row in vectors])

    def _embed(self, request: worker_pb2.EmbedRequest, gone: threading.Event) -> Any:
        if request.texts:
            _tag(model_id=request.model_id, batch=len(request.texts))
            info = self._model(request.model_id)
            max_context = info.max_context
            for i, text in enumerate(request.texts):
                _check_text_size(text, max_context, f"texts[{i}]")
            return self.runtime.embed_texts(request.model_id, list(request.texts),
                                            cancelled=gone.is_set)
        sequences = [list(s.tokens) for s in request.sequences]
        _tag(model_id=request.model_id, batch=len(sequences),
             seq=len(sequences[0]) if sequences else 0)
        self._model(request.model_id)   # an empty or unknown id, before the sequences
        # lengths may differ (the encoder masks its padding); the runtime checks each sequence
        return self.runtime.embed(request.model_id, sequences, cancelled=gone.is_set)

    # -- operations -------------------------------------------------------------------------
    async def GetStats(self, request: worker_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> worker_pb2.GetStatsResponse:
        return stats_message(await self._call(self._reads, self.runtime.stats))

    async def Trim(self, request: worker_pb2.TrimRequest, context: grpc.aio.ServicerContext
                   ) -> worker_pb2.TrimResponse:
        if request.target_bytes < 0:
            raise errors.InvalidArgument(f"target_bytes={request.target_bytes} is negative")
        freed, ledger = await self._call(self._admin, self.runtime.trim, int(request.target_bytes))
        return worker_pb2.TrimResponse(freed_bytes=int(freed), ledger_bytes=int(ledger))

    def _model(self, model_id: str) -> Any:
        _require(model_id, "model_id is empty: name a loaded model (see ListModels)")
        return self.runtime.model_info(model_id)


def _close_orphan(admitted: asyncio.Future) -> None:
    """A stream admitted after its client left: close it (its sequence is cancelled already,
    `gone` is set; this runs the runtime's report)."""
    if not admitted.cancelled() and admitted.exception() is None:
        admitted.result()[0].close()


def _log_pump_failure(pump: asyncio.Future) -> None:
    if not pump.cancelled() and pump.exception() is not None:
        log.error("single-sequence stream failed after its client left", exc_info=pump.exception())


def _check_generate_sizes(request: worker_pb2.GenerateRequest) -> None:
    """The O(1) bounds of a Generate request, before anything else (docs/worker.md)."""
    if not 0 < request.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
        raise errors.InvalidArgument(
            f"max_new_tokens={request.max_new_tokens} must be between 1 and the model's context",
            max_new_tokens=request.max_new_tokens)
    stops = len(request.sampling.stop_token_ids) if request.HasField("sampling") else 0
    if stops > MAX_STOP_TOKEN_IDS:
        raise errors.InvalidArgument(
            f"sampling.stop_token_ids has {stops} entries; at most {MAX_STOP_TOKEN_IDS} are "
            "accepted", field="stop_token_ids", entries=stops, bound=MAX_STOP_TOKEN_IDS)


def _check_embed_sizes(request: worker_pb2.EmbedRequest) -> None:
    """The O(batch) bounds of an Embed request, before anything else (docs/worker.md)."""
    if request.texts and request.sequences:
        raise errors.InvalidArgument("send sequences (token ids) or texts, not both")
    batch = len(request.texts) or len(request.sequences)
    if not batch:
        raise errors.InvalidArgument("sequences is empty: send at least one token sequence")
    if batch > MAX_EMBED_BATCH:
        kind = "texts" if request.texts else "sequences"
        raise errors.InvalidArgument(
            f"{batch} {kind} exceed the batch limit of {MAX_EMBED_BATCH}", batch=batch,
            bound=MAX_EMBED_BATCH)
    tokens = sum(len(s.tokens) for s in request.sequences)
    if tokens > MAX_EMBED_TOKENS:
        raise errors.InvalidArgument(
            f"{tokens} token ids in one Embed request exceed the limit of {MAX_EMBED_TOKENS}; "
            "split the batch", tokens=tokens, bound=MAX_EMBED_TOKENS)


def _check_text_size(text: str, max_context: int, what: str) -> None:
    if not max_context:
        return
    limit = MAX_TEXT_BYTES_PER_TOKEN * max_context
    if len(text) > limit or len(text.encode()) > limit:
        raise errors.InvalidArgument(
            f"{what} is longer than {limit} UTF-8 bytes ({MAX_TEXT_BYTES_PER_TOKEN} per token of "
            f"the model's {max_context}-token context): it cannot fit", bound=limit)


def _tag(**attributes: str | int) -> None:
    """Domain attributes (model, shape) on the server span the tracing interceptor opened."""
    span = trace.get_current_span()
    for key, value in attributes.items():
        span.set_attribute(f"gpuplane.{key}", value)


def _require(value: str, message: str) -> None:
    if not value:
        raise errors.InvalidArgument(message)


def serve_worker(runtime: Any, listen: str, tracer_provider: Any, max_workers: int = 32,
                 security: ServerSecurity | None = None,
                 max_stream_buffer_tokens: int = DEFAULT_STREAM_BUFFER_TOKENS,
                 streams: StreamStats | None = None,
                 stalled_write_grace_s: float = STALLED_WRITE_GRACE_S,
                 stream_interval: int = 1) -> AioRunningServer:
    """Start WorkerService for `runtime` on `listen` (grpc.aio, one loop thread); the runtime is
    closed when the server stops. `max_workers`: threads for calls that wait for the device
    (Embed, single-sequence streams), not a bound on streams; `streams`: fed with the edge's
    stream latencies (pass the one the metrics collector reads); `stream_interval`: tokens a
    Generate message carries after the stream's first (EdgeLimits)."""
    servicer = WorkerServicer(runtime, EdgeLimits(max_workers, max_stream_buffer_tokens,
                                                  stalled_write_grace_s, stream_interval),
                              streams)
    registration = ServiceRegistration(
        full_name=worker_pb2.DESCRIPTOR.services_by_name["WorkerService"].full_name,
        servicer=servicer,
        add=worker_pb2_grpc.add_WorkerServiceServicer_to_server,
    )
    try:
        server = create_aio_server(listen, [registration], tracer_provider, security=security,
                                   access=table(registration.full_name, ACCESS))
    except BaseException:
        servicer.close()
        raise
    server.on_stop.append(runtime.close)
    server.on_stop.append(servicer.close)
    # Liveness asks its own name: readiness (the overall status) may be NOT_SERVING for a
    # worker that is alive and must not be restarted (the governor refuses its id).
    server.run(server.health.set(LIVENESS_SERVICE, health_pb2.HealthCheckResponse.SERVING))
    budget = getattr(runtime, "budget", None)
    if hasattr(budget, "deliver_standing"):  # NOT_SERVING while the governor refuses our id
        budget.on_standing = server.set_serving
        budget.deliver_standing()
    return server
