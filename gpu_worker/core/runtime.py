"""The worker runtime: one device, its budget owner, the kernel compiler and the loaded models.

This is the domain core behind WorkerService (gpu_worker/edge/servicer.py); it never imports grpc
itself (the governor and cache clients do, and are only created when configured). A decoder's
Generate requests go to its continuous-batching scheduler (gpu_worker/scheduler): one engine
thread per model runs iteration-level steps over a paged KV pool, taking the model's lock per
step (a plan's captured graph bakes its activation pointers, so steps of one model never
overlap) and keeping the weights pinned while it has sequences. Embed requests for one encoder
are first gathered into padded batches (gpu_worker/engines/embed_batcher.py), each batch one run under
the model's lock. Different models run concurrently; the capture gate orders their captures
against each other's syncs.

Memory pressure is answered by one policy object (gpu_worker/core/reclaim.py), wired here: the arena
hands it every refusal, load admission asks it before refusing, and the governor client hands it
every reclaim ask. A model's weights may be paged out only while it is idle; every request pins
them and pages back in what is missing (`ModelExecutor.resident`) before it launches anything.

Errors are services.common.errors: NotFound (unknown model), InvalidArgument (bad request,
unknown family/config), AlreadyExists (model id taken), ResourceExhausted (admission refused once
nothing could be reclaimed: the partial load is unwound, so the ledger is as before).
"""
from __future__ import annotations

import contextlib
import functools
import threading
import time
from collections.abc import Callable

import numpy as np

from gpu_worker.checkpoints.text import TextCodec
from gpu_worker.config import WorkerConfig
from gpu_worker.core.connections import open_budget, open_compiler, wire_reclaim
from gpu_worker.core.loaded_model import LoadedModel, LoadResult, ModelInfo
from gpu_worker.core.loader import LoadSpec, ModelLoader
from gpu_worker.core.reclaim import Reclaimer
from gpu_worker.core.stats import scheduler_histograms, scheduler_stats, worker_stats
from gpu_worker.core.token_stream import TokenBuffer, TokenStream
from gpu_worker.engines.embed_batcher import EmbedBatchStats
from gpu_worker.engines.scheduler.histogram import Histogram
from gpu_worker.engines.scheduler.kv_swap import HostKVBudget, HostKVTier
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.serial import SerialRequest, serial_tokens
from gpu_worker.models.configs import WEIGHT_FORMATS, get_config
from gpu_worker.telemetry.spans import span
from gpu_worker.telemetry.step_trace import StepTrace
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

OFFLOAD_WAIT_S = 60.0   # how long OffloadModel waits for a decoder's batch to drain


class WorkerRuntime:
    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = None
        self.budget = None
        self.cache_client = None
        self.compiler = None
        self.reclaimer: Reclaimer | None = None
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()      # guards the model table, not the models
        self._loading: set[str] = set()    # ids reserved by a load in progress
        # Embed batching counters, shared by every encoder's batcher (made at load)
        self.embed_batch_stats = EmbedBatchStats()
        # the host KV tier every decoder's preemptions swap into (None: --no-kv-swap or 0 bytes)
        self.kv_host = (HostKVTier(HostKVBudget(config.kv_swap_host_bytes),
                                   config.kv_swap_copy_rate)
                        if config.kv_swap and config.kv_swap_host_bytes > 0 else None)
        self.step_trace = StepTrace(config.step_trace) if config.step_trace is not None else None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> WorkerRuntime:
        from gpu_worker.device import Device, open_backend
        cfg = self.config
        backend = open_backend(cfg.backend, cfg.ordinal, keep_gil=cfg.enqueue_keeps_gil)
        try:
            self.budget = open_budget(cfg, backend)
            self.device = Device(backend, self.budget, weight_budget_bytes=cfg.weight_budget_bytes)
            self.device.weights.host_budget_bytes = cfg.host_pinned_budget_bytes
            self.device.dependent_launch = self.device.dependent_launch and cfg.dependent_launch
            self.reclaimer = wire_reclaim(cfg, self.device, self.budget, self._candidates,
                                          self.kv_host)
            self.cache_client, self.compiler = open_compiler(cfg, self.device.info.arch)
        except BaseException:
            self.close()
            backend.close()
            raise
        return self

    def close(self) -> None:
        for model_id in list(self._models):
            self.unload_model(model_id)
        if self.budget is not None:
            self.budget.on_reclaim = self.budget.on_caps = None
            if hasattr(self.budget, "on_reclaim_cached"):
                self.budget.on_reclaim_cached = None
            if hasattr(self.budget, "host_tier"):
                self.budget.host_tier = None
        if self.device is not None:
            self.device.arena.reclaimer = None
            self.device.close()
            self.device = None
        if self.cache_client is not None:
            self.cache_client.close()
            self.cache_client = None
        if self.budget is not None:
            self.budget.close()
            self.budget = None
        if self.step_trace is not None:
            self.step_trace.close()

    def _started(self):
        if self.device is None:
            raise FailedPrecondition("the worker runtime is not started (or already closed)")
        return self.device

    # -- models ----------------------------------------------------------------------------------
    def load_synthetic(self, model_id: str, family: str, config: str, seed: int) -> LoadResult:
        """A model of a named config (gpu_worker/models/configs.py) with weights from `seed`.
        A failed load leaves nothing booked or listed."""
        if family not in ("decoder", "encoder"):
            raise InvalidArgument(f"family must be decoder or encoder, got {family!r}")
        return self._install(model_id, LoadSpec(get_config(config, family), config, int(seed)))

    load_model = load_synthetic   # the name tests and benchmarks have always called

    def load_checkpoint(self, model_id: str, checkpoint: str, weight_format: str = "") -> LoadResult:
        """A Hugging Face checkpoint directory under the model root; every file it reads is
        sandboxed there (gpu_worker/checkpoints/paths.py). `weight_format` '' means int4."""
        from gpu_worker.checkpoints import Checkpoint
        from gpu_worker.checkpoints.paths import resolve_checkpoint
        weight_format = weight_format or "int4"
        if weight_format not in WEIGHT_FORMATS:   # before the path: a bad request touches nothing
            raise InvalidArgument(f"weight_format {weight_format!r}: use 'int4' (or '' for it) "
                                  "or 'fp16'")
        self._check_model_id(model_id)
        root = self.config.model_root
        directory = resolve_checkpoint(root, checkpoint)
        codec = TextCodec.for_checkpoint(directory, root)
        with self._checkpoint_quantizer() as quantizer, \
                Checkpoint.open(directory, self.config.checkpoint_context, weight_format,
                                root=root, quantizer=quantizer) as ckpt:
            source = {"checkpoint": checkpoint, "architecture": ckpt.spec.architecture,
                      "weight_format": weight_format, "has_tokenizer": codec is not None}
            # fused in the loader: q/k/v and gate/up converted straight into one tensor each
            weights = functools.partial(ckpt.weights, fuse=True)
            return self._install(model_id, LoadSpec(
                ckpt.cfg, ckpt.cfg.name, 0, weights, source, codec, ckpt.spec.eos_token_ids,
                ckpt.spec.normalize))

    def _checkpoint_quantizer(self) -> contextlib.AbstractContextManager:
        """What a checkpoint load quantizes with (--checkpoint-quantizer), for the load only."""
        from gpu_worker.checkpoints.device_quantizer import DeviceQuantizer
        from gpu_worker.checkpoints.quantize import HOST_QUANTIZER
        if self.config.checkpoint_quantizer == "host":
            return contextlib.nullcontext(HOST_QUANTIZER)
        return DeviceQuantizer(self._started(), self.compiler)

    def _check_model_id(self, model_id: str) -> None:
        self._started()
        if not model_id:
            raise InvalidArgument("model_id is empty: name the model to load")

    def _install(self, model_id: str, spec: LoadSpec) -> LoadResult:
        """Reserve the id, build the model, publish it: a concurrent load of the same id is
        ALREADY_EXISTS, and a failed build frees the id with nothing booked."""
        self._check_model_id(model_id)
        with self._lock:
            if model_id in self._models or model_id in self._loading:
                raise AlreadyExists(f"model {model_id!r} is already loaded; unload it first",
                                    model_id=model_id)
            self._loading.add(model_id)
        try:
            loaded, result = self._loader().build(model_id, spec)
            with self._lock:
                self._models[model_id] = loaded
        finally:
            with self._lock:
                self._loading.discard(model_id)
        self._report()
        return result

    def _loader(self) -> ModelLoader:
        return ModelLoader(self.config, self._started(), self.compiler, self.reclaimer,
                           self.embed_batch_stats, self._settle_releases, self._embed_batch,
                           self.kv_host, self.step_trace)

    def model_info(self, model_id: str) -> ModelInfo:
        """The loaded model's facts (NOT_FOUND for an unknown id): one lookup, no other lock."""
        return self._get(model_id).info

    def unload_model(self, model_id: str) -> int:
        loaded = self._get(model_id)
        if loaded.scheduler is not None:   # streams fail FAILED_PRECONDITION, the pool goes
            loaded.scheduler.close(f"model {model_id!r} was unloaded")
        with loaded.lock:
            with self._lock:
                if self._models.get(model_id) is not loaded:
                    raise NotFound(f"model {model_id!r} was unloaded already", model_id=model_id)
                del self._models[model_id]
            loaded.closed = True
            freed = loaded.executor.close()
        self._settle_releases()
        self._report()
        return freed

    def _settle_releases(self) -> None:
        """Run the releases a closed model left queued. They are fenced on both streams (weights
        page in on the copy stream): a sync of the compute stream alone leaves some pending, and
        a caller who reads the ledger after the reply would still see the model's bytes booked.
        The drain waits per event, never device-wide (another model's capture stays valid)."""
        self.device.synchronize()
        self.device.queue.drain()

    def offload_model(self, model_id: str) -> tuple[ModelInfo, int]:
        """Page a model's weights out to their pinned host copies and drop its plans and kernel
        variants; it stays loaded, and its next request pages the weights back in (a wake).
        Waits for a running request (a decoder: its whole batch) to finish, FAILED_PRECONDITION
        after OFFLOAD_WAIT_S of uninterrupted streams. Returns (info, bytes released)."""
        loaded = self._get(model_id)
        deadline = time.monotonic() + OFFLOAD_WAIT_S
        while True:
            with loaded.lock:
                self._still_loaded(loaded)
                if not loaded.busy():
                    freed = loaded.drop_caches() + loaded.page_out()
                    break
            # a decoder serving streams: wait for its batch to drain, as for a running request
            left = deadline - time.monotonic()
            if left <= 0 or not loaded.scheduler.wait_idle(min(left, 1.0)) and \
                    time.monotonic() >= deadline:
                raise FailedPrecondition(f"model {model_id!r} kept serving streams for "
                                         f"{OFFLOAD_WAIT_S:.0f} s; offload it once they end",
                                         model_id=model_id)
        self.device.synchronize()
        self.device.arena.collect()
        self._report()
        return loaded.live_info(), freed

    def list_models(self) -> list[ModelInfo]:
        with self._lock:
            models = list(self._models.values())
        return [m.live_info() for m in models]

    def _candidates(self) -> list[LoadedModel]:
        """The loaded models, for the reclaimer (it try-locks each one)."""
        with self._lock:
            return list(self._models.values())

    def _get(self, model_id: str, family: str | None = None) -> LoadedModel:
        self._started()
        with self._lock:
            loaded = self._models.get(model_id)
        if loaded is None:
            raise NotFound(f"model {model_id!r} is not loaded on this worker", model_id=model_id)
        if family is not None and loaded.info.family != family:
            raise InvalidArgument(f"model {model_id!r} is a {loaded.info.family}, not a {family}")
        return loaded

    def _report(self) -> None:
        """Hand the ledger and the device truth to the budget owner (sent with its heartbeat)."""
        if self.device is not None:
            self.device.report()

    def _still_loaded(self, loaded: LoadedModel) -> None:
        """Called under the model lock: an unload that won the lock first closed the executor."""
        with self._lock:
            if self._models.get(loaded.info.model_id) is not loaded:
                raise NotFound(f"model {loaded.info.model_id!r} was unloaded", model_id=loaded.info.model_id)

    # -- inference -------------------------------------------------------------------------------
    def generate(self, model_id: str, prompt_tokens: list[int], max_new_tokens: int,
                 cancelled: Callable[[], bool] = lambda: False,
                 sampling: SamplingParams = GREEDY,
                 buffer: TokenBuffer | None = None) -> TokenStream:
        """Validate and queue now (errors raise here, before streaming: a full queue is
        RESOURCE_EXHAUSTED), then stream one token per item from the model's scheduler.
        `buffer`: the stream's bounded token buffer (gpu_worker/core/token_stream.py; the edge
        passes one bound to its event loop), a default one when None."""
        buffer = buffer if buffer is not None else TokenBuffer()
        loaded = self._get(model_id, "decoder")
        prompt = [int(t) for t in prompt_tokens]
        loaded.model.check(prompt, int(max_new_tokens))
        sampling.check(loaded.cfg.vocab_size)
        if loaded.scheduler is None:     # batching off: one request at a time, greedy
            if not sampling.greedy:
                raise InvalidArgument("sampling needs the batching engine (this worker runs "
                                      "with batching off): send greedy requests")
            request = SerialRequest(prompt, int(max_new_tokens), sampling, cancelled)
            return TokenStream(loaded, request, self.config.tracer_provider, self._report, buffer,
                               serial_tokens(loaded, request, self._still_loaded))
        seq = loaded.scheduler.submit(prompt, int(max_new_tokens), sampling, cancelled,
                                      events=buffer)
        return TokenStream(loaded, seq, self.config.tracer_provider, self._report, buffer)

    def scheduler_histograms(self) -> dict[str, Histogram]:
        return scheduler_histograms([m.scheduler for m in self._candidates() if m.scheduler])

    def codec(self, model_id: str) -> TextCodec:
        """The model's tokenizer; FAILED_PRECONDITION for a model without one."""
        loaded = self._get(model_id)
        if loaded.codec is None:
            raise FailedPrecondition(f"model {model_id!r} has no tokenizer (synthetic, or its "
                                     "checkpoint lacks tokenizer.json): send token ids")
        return loaded.codec

    def eos_token_ids(self, model_id: str) -> tuple[int, ...]:
        return self._get(model_id).eos_token_ids

    def embed_texts(self, model_id: str, texts: list[str],
                    cancelled: Callable[[], bool] = lambda: False) -> np.ndarray:
        """Embeddings of `texts`, in order: tokenized, then embedded as `embed` does."""
        codec = self.codec(model_id)
        if not texts:
            raise InvalidArgument("texts is empty: send at least one text")
        return self.embed(model_id, [codec.encode(t) for t in texts], cancelled)

    def embed(self, model_id: str, sequences: list[list[int]],
              cancelled: Callable[[], bool] = lambda: False) -> np.ndarray:
        """(len(sequences), hidden) embeddings. Validated here, on the caller's thread, before
        the sequences join the model's batcher: a bad request fails alone and changes nothing.
        Sequences may differ in length (the encoder masks padding)."""
        loaded = self._get(model_id, "encoder")
        sequences = [[int(t) for t in s] for s in sequences]
        loaded.model.check(sequences)
        assert loaded.embed_batcher is not None, "an encoder's batcher is made at load"
        return loaded.embed_batcher.submit(sequences, cancelled)

    def _embed_batch(self, loaded: LoadedModel, sequences: list[list[int]]) -> np.ndarray:
        """One batch through the encoder, under the model lock (validated sequences)."""
        with loaded.lock, span(self.config.tracer_provider, "worker.embed",
                                model=loaded.model_id, batch=len(sequences),
                                seq=max(len(s) for s in sequences)):
            self._still_loaded(loaded)
            try:
                with loaded.executor.resident():
                    return loaded.model.embed(sequences)
            finally:
                loaded.last_used = time.monotonic()
                self._report()

    # -- operations ------------------------------------------------------------------------------
    def trim(self, target_bytes: int) -> tuple[int, int]:
        """Drop plans and kernel variants, model by model, then the arena's retained handles,
        stopping as soon as the ledger is at or under `target_bytes`; returns (freed, ledger)."""
        device = self._started()
        if target_bytes < 0:
            raise InvalidArgument(f"target_bytes={target_bytes} is negative")
        freed = 0
        with self._lock:
            models = list(self._models.values())
        for loaded in models:
            if device.ledger.total_committed() <= target_bytes:
                break
            with loaded.lock:
                freed += loaded.executor.trim()
            device.synchronize()
            device.arena.collect()
        if device.ledger.total_committed() > target_bytes:
            freed += device.arena.release_pool()  # freed handles land in the pool first
        self._report()
        return freed, device.ledger.total_committed()

    def stats(self) -> dict:
        """Nested dict with worker.proto GetStatsResponse field names."""
        device = self._started()
        with self._lock:
            models = list(self._models.values())
        stats = worker_stats(device, [m.executor for m in models], self.compiler, self.reclaimer,
                             self.budget, self.config.variants_per_node)
        stats["embed_batch"] = self.embed_batch_stats.snapshot()
        stats["scheduler"] = scheduler_stats([m.scheduler for m in models if m.scheduler])
        return stats
