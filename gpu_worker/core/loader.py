"""Building a loaded model: admission, the executor, the model graph, its engine, the kernel set.

Hazard: a load that fails half way (refused admission, a bad checkpoint tensor, a compile error)
must leave nothing booked and nothing listed, or the ledger drifts from the device by a model.
Contract: `ModelLoader.build` either returns a `LoadedModel` wired to its batching engine (a
decoder's scheduler or an encoder's batcher, both made here, at load) or raises after closing
what it made and draining the releases it queued. The caller (the runtime) owns the model table:
it reserves the id before and publishes the model after. Cost: one probe commit per zone and
the kernel set's module loads (from the cache after the first host).
"""
from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

from gpu_worker.checkpoints.text import TextCodec
from gpu_worker.config import WorkerConfig
from gpu_worker.core.admission import admission_by_zone, weights_to_probe
from gpu_worker.core.loaded_model import LoadedModel, LoadResult, ModelInfo
from gpu_worker.engines.embed_batcher import EmbedBatcher, EmbedBatchStats
from gpu_worker.engines.scheduler.kv_swap import HostKVTier
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.kernels.paged_attention import HEAD_DIMS as PAGED_HEAD_DIMS
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel, padded_shape
from gpu_worker.models.paged import PagedDecoderModel
from gpu_worker.telemetry.spans import span
from gpu_worker.telemetry.step_trace import StepTrace
from services.common.errors import DeadlineExceeded


@dataclass(frozen=True)
class LoadSpec:
    """What to build: a model config and where its weights come from (a seed, or a checkpoint's
    streaming reader with the facts its files gave)."""
    cfg: ModelConfig
    config_name: str
    seed: int = 0
    weights: Callable | None = None          # a checkpoint's tensor stream; None: from the seed
    source: dict | None = None               # ModelInfo's checkpoint fields
    codec: TextCodec | None = None
    eos_token_ids: tuple[int, ...] = ()
    normalize: bool = False                  # encoders: L2-normalized embeddings

    @property
    def family(self) -> str:
        return self.cfg.family


class ModelLoader:
    def __init__(self, config: WorkerConfig, device, compiler, reclaimer,
                 embed_stats: EmbedBatchStats, settle_releases: Callable[[], None],
                 embed_run: Callable[[LoadedModel, list[list[int]]], object],
                 kv_host: HostKVTier | None = None,
                 step_trace: StepTrace | None = None) -> None:
        self.config, self.device, self.compiler, self.reclaimer = config, device, compiler, reclaimer
        self.kv_host = kv_host           # None: no host KV tier (preemption recomputes)
        self.embed_stats = embed_stats
        self.settle_releases = settle_releases
        self.embed_run = embed_run       # one padded batch through an encoder, under its lock
        self.step_trace = step_trace     # --step-trace's file (None: off)

    def build(self, model_id: str, spec: LoadSpec) -> tuple[LoadedModel, LoadResult]:
        from gpu_worker.kernels import ALL_KERNELS, ALL_SOURCES
        c, device = self.config, self.device
        started = time.perf_counter()
        deadline = time.monotonic() + c.load_timeout_s
        if spec.weights is not None:   # a checkpoint's files: slow storage must not hold a load
            spec = dataclasses.replace(spec, weights=_before(deadline, spec.weights, model_id,
                                                             c.load_timeout_s))
        executor = ModelExecutor(device, self.compiler, c.variants_per_node, c.max_plans,
                                 c.max_plan_bytes, weight_namespace=f"{model_id}/",
                                 dequant_tile_bytes=c.dequant_tile_bytes)
        model = self._model(executor, spec)
        try:
            with span(c.tracer_provider, "worker.load_model", model=model_id,
                      family=spec.family, config=spec.config_name):
                self.admit(spec.cfg, model_id)
                self.compiler.prefetch(ALL_SOURCES)
                for kdef in ALL_KERNELS:  # load the whole kernel set now: no first-request stall
                    executor.function(kdef)
                model.load()
                _check(deadline, model_id, c.load_timeout_s, "once its weights were placed")
        except BaseException:
            executor.close()
            if isinstance(model, PagedDecoderModel):
                model.close()
            self.settle_releases()      # a failed load leaves nothing booked when it answers
            raise
        # Counted per module of this load (a concurrent load's compiles are not ours).
        compiled = executor.module_tiers["compiled"]
        from_cache = sum(n for tier, n in executor.module_tiers.items() if tier != "compiled")
        cfg = spec.cfg
        info = ModelInfo(model_id, spec.family, spec.config_name, int(spec.seed), cfg.vocab_size,
                         cfg.max_context, cfg.weight_bytes(), **(spec.source or {}))
        loaded = LoadedModel(info, cfg, executor, model, codec=spec.codec,
                             eos_token_ids=spec.eos_token_ids)
        self._attach_engine(loaded)
        return loaded, LoadResult(info, time.perf_counter() - started, compiled, from_cache)

    def _model(self, executor: ModelExecutor, spec: LoadSpec
               ) -> PagedDecoderModel | DecoderModel | EncoderModel:
        c, cfg = self.config, spec.cfg
        if spec.family == "encoder":
            return EncoderModel(executor, cfg, spec.seed, capture=c.capture, weights=spec.weights,
                                normalize=spec.normalize, bucketed=True)
        # the paged kernels support head_dim 16, 64 and 128; another head dim (the tiny test
        # checkpoints' 8) runs the single-sequence decoder
        if not c.batching or cfg.head_dim not in PAGED_HEAD_DIMS:
            return DecoderModel(executor, cfg, spec.seed, capture=c.capture, weights=spec.weights,
                                prefill_chunk=c.prefill_chunk)
        return PagedDecoderModel(executor, cfg, spec.seed, block_tokens=c.kv_block_tokens,
                                 pool_bytes=c.kv_pool_bytes, max_batch_size=c.max_batch_size,
                                 capture=c.capture, weights=spec.weights,
                                 prefill_chunk=c.prefill_chunk)

    def _attach_engine(self, loaded: LoadedModel) -> None:
        """Both batching engines are made here, at load: a paged decoder's scheduler, an
        encoder's batcher. The single-sequence decoder has neither (its lock serializes)."""
        c, model = self.config, loaded.model
        if isinstance(model, PagedDecoderModel):
            assert model.pool is not None
            swap = (self.kv_host.swap_for(model.executor.device, model.pool,
                                          demotes=c.prefix_cache and c.kv_demote)
                    if self.kv_host is not None else None)
            loaded.scheduler = Scheduler(
                model, model.pool, max_batch_size=c.max_batch_size,
                max_step_tokens=c.max_step_tokens, max_queued=c.max_queued,
                min_prefill_share=c.min_prefill_share, prefill_order=c.prefill_order,
                eos_token_ids=loaded.eos_token_ids, model_lock=loaded.lock,
                pin=loaded.executor.resident, settle=model.settle, name=loaded.model_id,
                overlap=c.overlap, prefix_cache=c.prefix_cache, prefix_key=prefix_key(loaded.info),
                kv_swap=swap, kv_demote=c.kv_demote, prefill_tokens_per_s=c.kv_swap_prefill_rate,
                step_trace=(self.step_trace.writer(loaded.model_id)
                            if self.step_trace is not None else None))
        elif isinstance(model, EncoderModel):
            max_context = loaded.cfg.max_context

            def padded_tokens(count: int, longest: int) -> int:
                batch, seq = padded_shape([longest] * count, max_context)
                return batch * seq

            loaded.embed_batcher = EmbedBatcher(
                lambda seqs: self.embed_run(loaded, seqs), padded_tokens, self.embed_stats,
                c.embed_batch_wait_ms / 1000.0, c.embed_max_batch, c.embed_max_batch_tokens)

    def admit(self, cfg: ModelConfig, model_id: str) -> None:
        """Refuse a model that cannot fit before generating its host weights: a 36 GiB config
        would otherwise spend a minute and as much host memory only to be refused on the device.
        A probe commit per zone through the budget owner, released at once; a refused probe asks
        the reclaimer first (idle models' caches, then their weights), and is refused only when
        nothing more can go. A model whose weights exceed the weight budget streams (only the
        budget is probed), refused only when it cannot. What the probe counts:
        gpu_worker/core/admission.py."""
        device = self.device
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


def _check(deadline: float, model_id: str, timeout_s: float, where: str) -> None:
    if time.monotonic() > deadline:
        raise DeadlineExceeded(f"loading model {model_id!r} passed its {timeout_s:g} s deadline "
                               f"{where}; nothing stays booked. Check the model root's "
                               "storage, or raise --load-timeout-seconds")


def _before(deadline: float, weights: Callable, model_id: str, timeout_s: float) -> Callable:
    """`weights` (a checkpoint's tensor stream) checked against the load's deadline per tensor."""
    def stream():
        for n, item in enumerate(weights()):
            _check(deadline, model_id, timeout_s, f"after reading tensor {n} ({item[0]})")
            yield item
    return stream


def prefix_key(info: ModelInfo) -> str:
    """What a decoder's K/V depend on besides the tokens, for its prefix cache's keys: the model
    and its weights (a pool lives and dies with one load, so this guards, it does not separate)."""
    return "\x00".join((info.model_id, info.config, str(info.seed), info.checkpoint,
                        info.weight_format))
