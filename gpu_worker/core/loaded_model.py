"""What the runtime keeps of a loaded model: its public description (`ModelInfo`), the result of
a load, and `LoadedModel`, which is also what the reclaimer sees of a model
(gpu_worker.core.reclaim.IdleCandidate): busy or idle, what it can drop, its live residency."""
from __future__ import annotations

import dataclasses
import threading
import time
from dataclasses import dataclass, field

from gpu_worker.checkpoints.text import TextCodec
from gpu_worker.engines.embed_batcher import EmbedBatcher
from gpu_worker.engines.scheduler.scheduler import Scheduler
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models.configs import ModelConfig
from gpu_worker.models.decoder import DecoderModel
from gpu_worker.models.encoder import EncoderModel
from gpu_worker.models.paged import PagedDecoderModel


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    family: str
    config: str
    seed: int
    vocab_size: int
    max_context: int
    weight_bytes: int
    checkpoint: str = ""
    architecture: str = ""
    weight_format: str = ""
    has_tokenizer: bool = False
    resident_bytes: int = 0   # weight bytes mapped on the device now
    state: str = "resident"   # resident | partial | offloaded (weights on pinned host only)


@dataclass(frozen=True)
class LoadResult:
    info: ModelInfo
    load_seconds: float
    kernels_compiled: int
    kernels_from_cache: int


@dataclass(eq=False)
class LoadedModel:
    """A loaded model; also what the reclaimer sees of it (gpu_worker.core.reclaim.IdleCandidate)."""
    info: ModelInfo
    cfg: ModelConfig
    executor: ModelExecutor
    model: PagedDecoderModel | DecoderModel | EncoderModel
    lock: threading.Lock = field(default_factory=threading.Lock)
    scheduler: Scheduler | None = None      # decoders: the continuous-batching engine
    embed_batcher: EmbedBatcher | None = None  # encoders: requests merged into padded batches
    codec: TextCodec | None = None          # the checkpoint's tokenizer, if it has one
    eos_token_ids: tuple[int, ...] = ()     # generation stops after emitting one of these
    last_used: float = field(default_factory=time.monotonic)
    closed: bool = False

    @property
    def model_id(self) -> str:
        return self.info.model_id

    def busy(self) -> bool:
        """A decoder with running or waiting sequences: its weights are pinned between steps
        (the reclaimer may hold the request lock then, but must take nothing)."""
        return self.scheduler is not None and self.scheduler.busy()

    def drop_caches(self) -> int:
        """Plans and kernel variants, then (a paged decoder) the slot state their graphs baked."""
        if self.busy():
            return 0
        freed = self.executor.trim()
        release = getattr(self.model, "release_slots", None)
        return freed + (release() if release is not None else 0)

    def page_out(self) -> int:
        return 0 if self.busy() else self.executor.page_out()

    def preempt_kv(self) -> bool:
        """Reclaim's last step (lock held): the newest running sequence goes back to waiting."""
        return self.scheduler is not None and self.scheduler.preempt_newest()

    def release_cached_kv(self, need_bytes: int) -> int:
        """Reclaim's cached-KV step (lock held, or on the engine thread): cached prefix blocks
        from the top of the pool, never one in use; returns the bytes decommitted."""
        return self.scheduler.release_cached(need_bytes) if self.scheduler is not None else 0

    def kv_cached_bytes(self) -> int:
        """What release_cached_kv could decommit now (any thread)."""
        return self.scheduler.pool.cached_releasable_bytes() if self.scheduler is not None else 0

    def engine_is_current(self) -> bool:
        return self.scheduler is not None and self.scheduler.is_engine_thread()

    def kv_bytes(self) -> int:
        return self.scheduler.pool.committed if self.scheduler is not None else 0

    def reclaimable_bytes(self) -> int:
        if self.busy():
            return 0
        plans = self.executor.plans.stats()
        return (self.executor.resident_bytes() + plans["activation_bytes"] + plans["graph_bytes"]
                + self.executor.kernels.stats()["workspace_bytes"])

    def live_info(self) -> ModelInfo:
        resident = self.executor.resident_bytes()
        total = self.info.weight_bytes
        state = "resident" if resident >= total else "offloaded" if resident == 0 else "partial"
        return dataclasses.replace(self.info, resident_bytes=resident, state=state)
