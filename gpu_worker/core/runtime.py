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

import os
import pathlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from gpu_worker.core.admission import admission_by_zone, weights_to_probe
from gpu_worker.checkpoints.text import TextCodec
from gpu_worker.engines.embed_batcher import EmbedBatcher, EmbedBatchStats
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.execution.kernel_cache import variants_per_node_from_env
from gpu_worker.execution.plans import max_plans_from_env
from gpu_worker.kernels.paged_attention import HEAD_DIMS as PAGED_HEAD_DIMS
from gpu_worker.core.loaded_model import LoadedModel, LoadResult, ModelInfo
from gpu_worker.models.configs import WEIGHT_FORMATS, ModelConfig, get_config
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel
from gpu_worker.models.paged import PagedDecoderModel
from gpu_worker.core.reclaim import Reclaimer
from gpu_worker.engines.scheduler.histogram import Histogram
from gpu_worker.engines.scheduler.sampling import GREEDY, SamplingParams
from gpu_worker.engines.scheduler.scheduler import Scheduler, Sequence
from gpu_worker.telemetry.spans import span
from gpu_worker.core.stats import scheduler_stats, worker_stats
from gpu_worker.core.token_stream import TokenBuffer, TokenStream
from services.common.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)

if TYPE_CHECKING:  # the runtime never imports grpc; the channels do, in the clients
    from services.common.tls import ChannelTLS


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


OFFLOAD_WAIT_S = 60.0   # how long OffloadModel waits for a decoder's batch to drain


@dataclass
class WorkerConfig:
    backend: str = "auto"
    governor: str | None = None
    cache: str | None = None
    cache_dir: pathlib.Path | None = None
    cache_namespace: str = ""           # the kernel cache service's namespace for our entries
    worker_id: str = field(default_factory=default_worker_id)
    variants_per_node: int = field(default_factory=variants_per_node_from_env)
    max_plans: int = field(default_factory=max_plans_from_env)
    cache_write_token: str | None = None
    tls: ChannelTLS | None = None       # outgoing calls (governor, cache); None = plaintext
    governor_token: str | None = None   # bearer token for the governor, without mutual TLS
    tracer_provider: object = None
    max_plan_bytes: int | None = None   # optional byte bound on one model's plans
    ordinal: int = 0
    capture: bool = True                # False: eager launches (benchmarks, debugging)
    model_root: pathlib.Path | None = None  # checkpoints load only from under here (None: none)
    checkpoint_context: int = 8192      # tokens served from a checkpoint (KV cache is f32)
    weight_budget_bytes: int | None = None      # resident weights cap (the governor's may be less)
    host_pinned_budget_bytes: int | None = None  # pinned host bytes for weight copies
    lease_chunk_bytes: int = 64 << 20            # governor lease growth unit (see its client)
    embed_batch_wait_ms: float = 2.0    # how long an Embed waits for others to share its batch
    embed_max_batch: int = 64           # sequences per Embed batch (1: one at a time)
    embed_max_batch_tokens: int = 32768  # padded tokens per Embed batch (one sequence always fits)
    # continuous batching (docs/scheduler.md)
    max_batch_size: int = 64            # running sequences per decoder
    max_step_tokens: int = 2048         # decode rows + prefill chunk tokens per engine step
    max_queued: int = 1024              # waiting requests per decoder; beyond: RESOURCE_EXHAUSTED
    kv_block_tokens: int = 16           # tokens per paged KV block
    kv_pool_bytes: int = 0              # KV pool VA per decoder; 0 = max_batch_size full contexts
    # False: decoders load as the single-sequence DecoderModel (one contiguous KV cache, requests
    # serialized by the model lock, greedy only): the per-sequence benchmarks measure that path
    batching: bool = True


class WorkerRuntime:
    def __init__(self, config: WorkerConfig) -> None:
        if config.variants_per_node < 1 or config.max_plans < 1:
            raise InvalidArgument("variants_per_node and max_plans must be at least 1")
        if (config.embed_batch_wait_ms < 0 or config.embed_max_batch < 1
                or config.embed_max_batch_tokens < 1):
            raise InvalidArgument("embed_batch_wait_ms must be >= 0, embed_max_batch and "
                                  "embed_max_batch_tokens at least 1")
        for name in ("weight_budget_bytes", "host_pinned_budget_bytes"):
            value = getattr(config, name)
            if value is not None and value <= 0:
                raise InvalidArgument(f"{name}={value} must be positive (or None: no budget)")
        self.config = config
        self.device = None
        self.budget = None
        self.cache_client = None
        self.compiler = None
        self.reclaimer: Reclaimer | None = None
        self._models: dict[str, LoadedModel] = {}
        self._lock = threading.Lock()      # guards the model table, not the models
        # Embed batching (gpu_worker/engines/embed_batcher.py): one batcher per loaded encoder, by model
        # id with the LoadedModel it serves (a reloaded id gets a fresh one); counters shared by all.
        self._embed_batchers: dict[str, tuple[LoadedModel, EmbedBatcher]] = {}
        self.embed_batch_stats = EmbedBatchStats()

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> WorkerRuntime:
        from gpu_worker.compile import KernelCompiler
        from gpu_worker.device import Device, open_backend
        cfg = self.config
        backend = open_backend(cfg.backend, cfg.ordinal)
        try:
            if cfg.governor:
                from services.governor.client import DeviceDescription, GovernorClient
                free, total = backend.mem_get_info()
                info = backend.info
                self.budget = GovernorClient(
                    cfg.governor, cfg.worker_id,
                    DeviceDescription(info.uuid, info.name, total, free, info.granule_bytes),
                    chunk_bytes=cfg.lease_chunk_bytes, tracer_provider=cfg.tracer_provider,
                    tls=cfg.tls, token=cfg.governor_token)
            self.device = Device(backend, self.budget, weight_budget_bytes=cfg.weight_budget_bytes)
            self.device.weights.host_budget_bytes = cfg.host_pinned_budget_bytes
            # A peer asked by the governor gives back on its next heartbeat (2 s by default).
            peer_wait = 2.5 * self.budget.heartbeat_s if self.budget is not None else 0.0
            self.reclaimer = Reclaimer(self.device, self._candidates, cfg.worker_id, peer_wait)
            self.device.arena.reclaimer = self.reclaimer.on_refusal
            if self.budget is not None:  # a reclaim ask is answered before the leases go back
                self.budget.on_reclaim = self.reclaimer.on_governor_ask
                # The weight budget is the smaller of the flag and the weights zone's cap.
                weights = self.device.weights
                self.budget.on_caps = lambda caps: weights.set_budget(caps.get("weights"),
                                                                      "governor")
                self.budget.deliver_caps()   # the registration's; later ones come by heartbeat
            if cfg.cache:
                from cache_service.client import KernelCacheClient
                self.cache_client = KernelCacheClient(cfg.cache, write_token=cfg.cache_write_token,
                                                      tracer_provider=cfg.tracer_provider,
                                                      tls=cfg.tls)
            # The compiler's spans sit between the worker's request span and the cache service's
            # span, so they must come from the worker's provider or the trace breaks in two.
            self.compiler = KernelCompiler(self.device.info.arch, cache_dir=cfg.cache_dir,
                                           remote=self.cache_client, namespace=cfg.cache_namespace,
                                           tracer_provider=cfg.tracer_provider)
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

    def _started(self):
        if self.device is None:
            raise FailedPrecondition("the worker runtime is not started (or already closed)")
        return self.device

    # -- models ----------------------------------------------------------------------------------
    def load_model(self, model_id: str, family: str, config: str, seed: int,
                   checkpoint: str = "", weight_format: str = "") -> LoadResult:
        """A synthetic model (family, config, seed), or a checkpoint directory under the model
        root (family/config/seed ignored). A failed load leaves nothing booked or listed."""
        self._started()
        if not model_id:
            raise InvalidArgument("model_id is empty")
        if checkpoint:
            return self._load_checkpoint(model_id, checkpoint, weight_format or "int4")
        if family not in ("decoder", "encoder"):
            raise InvalidArgument(f"family must be decoder or encoder, got {family!r}")
        cfg = get_config(config, family)
        return self._load(model_id, cfg, family, config, int(seed), None)

    def _load_checkpoint(self, model_id: str, checkpoint: str, weight_format: str) -> LoadResult:
        from gpu_worker.checkpoints import Checkpoint
        from gpu_worker.checkpoints.paths import resolve_checkpoint
        if weight_format not in WEIGHT_FORMATS:   # before the path: a bad request touches nothing
            raise InvalidArgument(f"weight_format {weight_format!r}: use 'int4' (or '' for it) "
                                  "or 'fp16'")
        directory = resolve_checkpoint(self.config.model_root, checkpoint)
        # the model root sandboxes every file the checkpoint reads, not only its directory
        codec = TextCodec.for_checkpoint(directory, self.config.model_root)
        with Checkpoint.open(directory, self.config.checkpoint_context, weight_format,
                             root=self.config.model_root) as ckpt:
            source = {"checkpoint": checkpoint, "architecture": ckpt.spec.architecture,
                      "weight_format": weight_format, "has_tokenizer": codec is not None}
            return self._load(model_id, ckpt.cfg, ckpt.cfg.family, ckpt.cfg.name, 0, ckpt.weights,
                              source, codec, ckpt.spec.eos_token_ids, ckpt.spec.normalize)

    def _load(self, model_id: str, cfg: ModelConfig, family: str, config: str, seed: int,
              weights, source: dict | None = None, codec: TextCodec | None = None,
              eos: tuple[int, ...] = (), normalize: bool = False) -> LoadResult:
        from gpu_worker.kernels import ALL_KERNELS, ALL_SOURCES
        device = self._started()
        with self._lock:
            if model_id in self._models:
                raise AlreadyExists(f"model {model_id!r} is already loaded; unload it first",
                                    model_id=model_id)
            self._models[model_id] = None  # type: ignore[assignment]  # reserve the id
        started = time.perf_counter()
        executor = ModelExecutor(device, self.compiler, self.config.variants_per_node,
                                 self.config.max_plans, self.config.max_plan_bytes,
                                 weight_namespace=f"{model_id}/")
        c = self.config
        model: PagedDecoderModel | DecoderModel | EncoderModel
        # the paged kernels support head_dim 16, 64 and 128 (i13 contract); another head dim (the
        # tiny test checkpoints' 8) runs the single-sequence decoder
        if family == "decoder" and (not c.batching or cfg.head_dim not in PAGED_HEAD_DIMS):
            model = DecoderModel(executor, cfg, seed, capture=c.capture, weights=weights)
        elif family == "decoder":
            model = PagedDecoderModel(executor, cfg, seed, block_tokens=c.kv_block_tokens,
                                      pool_bytes=c.kv_pool_bytes, max_batch_size=c.max_batch_size,
                                      capture=c.capture, weights=weights)
        else:
            model = EncoderModel(executor, cfg, seed, capture=self.config.capture, weights=weights,
                                 normalize=normalize, bucketed=True)
        try:
            with span(self.config.tracer_provider, "worker.load_model", model=model_id,
                       family=family, config=config):
                self._admit(device, cfg, model_id)
                self.compiler.prefetch(ALL_SOURCES)
                for kdef in ALL_KERNELS:  # load the whole kernel set now: no first-request stall
                    executor.function(kdef)
                model.load()
        except BaseException:
            executor.close()
            if isinstance(model, PagedDecoderModel):
                model.close()
            self._settle_releases()      # a failed load leaves nothing booked when it answers
            with self._lock:
                del self._models[model_id]
            raise
        # Counted per module of this load (a concurrent load's compiles are not ours).
        compiled = executor.module_tiers["compiled"]
        from_cache = sum(n for tier, n in executor.module_tiers.items() if tier != "compiled")
        info = ModelInfo(model_id, family, config, int(seed), cfg.vocab_size, cfg.max_context,
                         cfg.weight_bytes(), **(source or {}))
        loaded = LoadedModel(info, cfg, executor, model, codec=codec, eos_token_ids=eos)
        if isinstance(model, PagedDecoderModel):
            assert model.pool is not None
            loaded.scheduler = Scheduler(
                model, model.pool, max_batch_size=c.max_batch_size,
                max_step_tokens=c.max_step_tokens, max_queued=c.max_queued, eos_token_ids=eos,
                model_lock=loaded.lock, pin=executor.resident, settle=model.settle,
                name=model_id)
        with self._lock:
            self._models[model_id] = loaded
        self._report()
        return LoadResult(info, time.perf_counter() - started, compiled, from_cache)

    def _admit(self, device, cfg: ModelConfig, model_id: str) -> None:
        """Refuse a model that cannot fit before generating its host weights: a 36 GiB config
        would otherwise spend a minute and as much host memory only to be refused on the device.
        A probe commit per zone through the budget owner, released at once; a refused probe asks
        the reclaimer first (idle models' caches, then their weights), and is refused only when
        nothing more can go. A model whose weights exceed the weight budget streams (only the
        budget is probed), refused only when it cannot. What the probe counts:
        gpu_worker/core/admission.py."""
        need = admission_by_zone(cfg, device.info.granule_bytes)
        need["weights"] = weights_to_probe(cfg, device.info.granule_bytes,  # larger: it streams
                                           device.weights.budget_bytes, f"model {model_id!r}",
                                           need["weights"], device.weights.budget_source)
        booked: list[tuple[str, int]] = []
        try:
            for zone, nbytes in need.items():
                self.reclaimer.commit(zone, nbytes)   # reclaims before it refuses
                booked.append((zone, nbytes))
        finally:
            for zone, nbytes in booked:
                device.ledger.uncommit(zone, nbytes)

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
            models = [m for m in self._models.values() if m is not None]
        return [m.live_info() for m in models]

    def _candidates(self) -> list[LoadedModel]:
        """The loaded models, for the reclaimer (it try-locks each one)."""
        with self._lock:
            return [m for m in self._models.values() if m is not None]

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
            seq = Sequence(prompt, int(max_new_tokens), sampling, None, cancelled)  # type: ignore[arg-type]
            return TokenStream(loaded, seq, self.config.tracer_provider, self._report, buffer,
                               self._serial(loaded, seq))
        seq = loaded.scheduler.submit(prompt, int(max_new_tokens), sampling, cancelled,
                                      events=buffer)
        return TokenStream(loaded, seq, self.config.tracer_provider, self._report, buffer)

    def _serial(self, loaded: LoadedModel, seq: Sequence) -> Iterator[int]:
        """The single-sequence path: the model lock for the whole stream."""
        with loaded.lock:
            self._still_loaded(loaded)
            with loaded.executor.resident():
                for token in loaded.model.generate(seq.prompt, seq.max_new_tokens,
                                                   seq.is_cancelled):
                    seq.generated.append(token)
                    yield token
                    if seq.is_cancelled():
                        seq.state, seq.finish_reason = "finished", "cancelled"
                        return
                    if token in loaded.eos_token_ids or token in seq.sampling.stop_token_ids:
                        seq.state, seq.finish_reason = "finished", "stop"
                        return
        seq.state, seq.finish_reason = "finished", "length"

    def scheduler_histograms(self) -> dict[str, Histogram]:
        """Time to first token, time per output token and queue time, over the decoders."""
        out = {"ttft_seconds": Histogram(), "tpot_seconds": Histogram(),
               "queue_seconds": Histogram()}
        for m in self._candidates():
            if m.scheduler is not None:
                out["ttft_seconds"].merge(m.scheduler.ttft)
                out["tpot_seconds"].merge(m.scheduler.tpot)
                out["queue_seconds"].merge(m.scheduler.queue_time)
        return out

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
        return self._embed_batcher(loaded).submit(sequences, cancelled)

    def _embed_batcher(self, loaded: LoadedModel) -> EmbedBatcher:
        from gpu_worker.models.encoder import padded_shape
        cfg = self.config
        with self._lock:
            held = self._embed_batchers.get(loaded.model_id)
            if held is not None and held[0] is loaded:
                return held[1]
            for model_id, (other, _) in list(self._embed_batchers.items()):
                if other.closed:   # unloaded: its batcher goes with it (the counters stay)
                    del self._embed_batchers[model_id]
            max_context = loaded.cfg.max_context

            def padded_tokens(count: int, longest: int) -> int:
                batch, seq = padded_shape([longest] * count, max_context)
                return batch * seq

            batcher = EmbedBatcher(lambda seqs: self._embed_batch(loaded, seqs), padded_tokens,
                                   self.embed_batch_stats, cfg.embed_batch_wait_ms / 1000.0,
                                   cfg.embed_max_batch, cfg.embed_max_batch_tokens)
            self._embed_batchers[loaded.model_id] = (loaded, batcher)
            return batcher

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
            models = [m for m in self._models.values() if m is not None]
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
            models = [m for m in self._models.values() if m is not None]
        stats = worker_stats(device, [m.executor for m in models], self.compiler, self.reclaimer,
                             self.budget, self.config.variants_per_node)
        stats["embed_batch"] = self.embed_batch_stats.snapshot()
        stats["scheduler"] = scheduler_stats([m.scheduler for m in models if m.scheduler])
        return stats
