"""`WorkerConfig`: everything a worker runtime is started with, frozen and validated on construction.

The environment is never read here or below: `python -m gpu_worker serve` maps its flags (each with
a `GPUPLANE_*` environment default) onto this object, and tests and benchmarks build it directly.
A bad value raises `InvalidArgument` naming the field and how to fix it, before anything starts.
"""
from __future__ import annotations

import math
import os
import pathlib
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from services.common.errors import InvalidArgument

if TYPE_CHECKING:  # the config never imports grpc; the channels do, in the clients
    from services.common.tls import ChannelTLS

DEFAULT_VARIANTS_PER_NODE = 16     # kernel shape variants kept per graph node (DESIGN 1.1): the
                                   # paged decoder's 11 decode rungs' attention scratch and room
DEFAULT_MAX_PLANS = 2              # warm shape plans kept per model (DESIGN 1.2)
DEFAULT_PREFILL_CHUNK = 2048       # prompt tokens per prefill chunk
# The smallest prefill chunk a step gives a prompt (docs/scheduler.md "Prefill and decode share the
# step"): each chunk is one graph replay over every weight, so a floor keeps a step from splitting
# its token budget into many small chunks.
DEFAULT_MIN_PREFILL_SHARE = 256
# Who a step's prefill tokens go to first (the same section): max-min fair shares, or the shortest
# remaining prompt first with the oldest prompt still given its floor.
PREFILL_ORDERS = ("fair", "shortest")
# Where a checkpoint's float linears are quantized to int4: on the device (the kernel
# int4_quantize: the load then needs no free host cores) or by NumPy on the loader's threads.
CHECKPOINT_QUANTIZERS = ("device", "host")
DEFAULT_PREFILL_ORDER = "shortest"
DEFAULT_DEQUANT_TILE_BYTES = 32 << 20  # one model's fp16 dequantization tile for prefill linears
# Pinned host bytes all decoders' swapped KV may hold: 4 GiB (a 2,000-token sequence of an 8b
# model is 256 MiB of fp16 KV), small beside a serving host's memory and never allocated ahead.
DEFAULT_KV_SWAP_HOST_BYTES = 4 << 30
# How long a Python thread keeps the GIL while another waits for it (sys.setswitchinterval, set
# once at `serve`). One engine thread makes a step's tokens and one event-loop thread writes
# every stream; at Python's 5 ms each waits up to 5 ms for the other, about a decode step.
# On an H100 at batch 64 (8b-int4, docs/worker.md "The GIL between the engine and the edge")
# 0.2 ms delivered 14,000 tokens/s against 10,000 at 5 ms, on the same device step.
DEFAULT_GIL_SWITCH_MS = 0.2


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


@dataclass(frozen=True)
class WorkerConfig:
    backend: str = "auto"
    governor: str | None = None
    cache: str | None = None
    cache_dir: pathlib.Path | None = None
    cache_namespace: str = ""           # the kernel cache service's namespace for our entries
    worker_id: str = field(default_factory=default_worker_id)
    variants_per_node: int = DEFAULT_VARIANTS_PER_NODE
    max_plans: int = DEFAULT_MAX_PLANS
    cache_write_token: str | None = None
    tls: ChannelTLS | None = None       # outgoing calls (governor, cache); None = plaintext
    governor_token: str | None = None   # bearer token for the governor, without mutual TLS
    tracer_provider: object = None
    max_plan_bytes: int | None = None   # optional byte bound on one model's plans
    ordinal: int = 0
    capture: bool = True                # False: eager launches (benchmarks, debugging)
    model_root: pathlib.Path | None = None  # checkpoints load only from under here (None: none)
    checkpoint_context: int = 8192      # tokens served from a checkpoint
    checkpoint_quantizer: str = "device"  # device | host (CHECKPOINT_QUANTIZERS)
    load_timeout_s: float = 600.0       # a whole LoadModel; past it the load unwinds
    weight_budget_bytes: int | None = None      # resident weights cap (the governor's may be less)
    host_pinned_budget_bytes: int | None = None  # pinned host bytes for weight copies
    lease_chunk_bytes: int = 64 << 20            # governor lease growth unit (see its client)
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK   # prompt tokens per prefill chunk
    dequant_tile_bytes: int = DEFAULT_DEQUANT_TILE_BYTES  # prefill linears' fp16 tile per model
    # programmatic dependent launch (sm_90): a step's kernels start while the one before ends
    dependent_launch: bool = True
    # driver calls that only enqueue (event records, graph launches, pinned copies) keep the GIL
    enqueue_keeps_gil: bool = True
    embed_batch_wait_ms: float = 2.0    # how long an Embed waits for others to share its batch
    embed_max_batch: int = 64           # sequences per Embed batch (1: one at a time)
    embed_max_batch_tokens: int = 32768  # padded tokens per Embed batch (one sequence always fits)
    # continuous batching (docs/scheduler.md)
    max_batch_size: int = 64            # running sequences per decoder
    max_step_tokens: int = 2048         # decode rows + prefill chunk tokens per engine step
    min_prefill_share: int = DEFAULT_MIN_PREFILL_SHARE  # a step's smallest prefill chunk (tokens)
    prefill_order: str = DEFAULT_PREFILL_ORDER  # fair | shortest (PREFILL_ORDERS)
    max_queued: int = 1024              # waiting requests per decoder; beyond: RESOURCE_EXHAUSTED
    kv_block_tokens: int = 16           # tokens per paged KV block
    kv_pool_bytes: int = 0              # KV pool VA per decoder; 0 = max_batch_size full contexts
    overlap: bool = True                # launch step n+1 before reading step n's tokens back
    prefix_cache: bool = True           # share cached full KV blocks of a common prompt prefix
    # the KV tier in pinned host memory (docs/scheduler.md): a preemption swaps a sequence's
    # blocks to host when the copies cost less than its recompute
    kv_swap: bool = True
    kv_demote: bool = True              # evicted cached prefix blocks to the host tier too
    kv_swap_host_bytes: int = DEFAULT_KV_SWAP_HOST_BYTES   # all decoders together; 0 = no swap
    kv_swap_copy_rate: float = 0.0      # pinned copy bytes/s each way; 0 = measured at load
    kv_swap_prefill_rate: float = 0.0   # prefill tokens/s; 0 = measured by each scheduler
    # False: decoders load as the single-sequence DecoderModel (one contiguous KV cache, requests
    # serialized by the model lock, greedy only): the per-sequence benchmarks measure that path
    batching: bool = True
    step_trace: pathlib.Path | None = None   # a JSON line per decoder engine step (None: off)

    def __post_init__(self) -> None:
        at_least_one = ("variants_per_node", "max_plans", "checkpoint_context", "lease_chunk_bytes",
                        "prefill_chunk", "dequant_tile_bytes", "embed_max_batch",
                        "embed_max_batch_tokens", "max_batch_size", "max_step_tokens",
                        "min_prefill_share", "max_queued", "kv_block_tokens")
        for name in at_least_one:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidArgument(f"WorkerConfig.{name}={value!r} must be an integer >= 1")
        for name in ("weight_budget_bytes", "host_pinned_budget_bytes", "max_plan_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidArgument(f"WorkerConfig.{name}={value} must be positive "
                                      "(or None: no bound)")
        if self.kv_pool_bytes < 0:
            raise InvalidArgument(f"WorkerConfig.kv_pool_bytes={self.kv_pool_bytes} must be >= 0 "
                                  "(0: max_batch_size full contexts)")
        if not isinstance(self.kv_swap_host_bytes, int) or self.kv_swap_host_bytes < 0:
            raise InvalidArgument(f"WorkerConfig.kv_swap_host_bytes={self.kv_swap_host_bytes!r} "
                                  "must be an integer >= 0 (0: no KV swap)")
        for name in ("kv_swap_copy_rate", "kv_swap_prefill_rate"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise InvalidArgument(f"WorkerConfig.{name}={value!r} must be a finite number "
                                      ">= 0 (0: measured)")
        if not math.isfinite(self.embed_batch_wait_ms) or self.embed_batch_wait_ms < 0:
            raise InvalidArgument(f"WorkerConfig.embed_batch_wait_ms={self.embed_batch_wait_ms} "
                                  "must be a finite number >= 0")
        if not math.isfinite(self.load_timeout_s) or not 0 < self.load_timeout_s <= 86400:
            raise InvalidArgument(f"WorkerConfig.load_timeout_s={self.load_timeout_s} must be in "
                                  "(0, 86400] seconds")
        if self.prefill_order not in PREFILL_ORDERS:
            raise InvalidArgument(f"WorkerConfig.prefill_order={self.prefill_order!r}: use "
                                  f"{' or '.join(PREFILL_ORDERS)}")
        if self.checkpoint_quantizer not in CHECKPOINT_QUANTIZERS:
            raise InvalidArgument(f"WorkerConfig.checkpoint_quantizer={self.checkpoint_quantizer!r}"
                                  f": use {' or '.join(CHECKPOINT_QUANTIZERS)}")
        if self.backend not in ("auto", "cuda", "sim"):
            raise InvalidArgument(f"WorkerConfig.backend={self.backend!r}: use auto, cuda or sim")
