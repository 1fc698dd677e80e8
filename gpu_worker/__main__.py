"""`python -m gpu_worker serve ...`: run one GPU worker behind gRPC.

With no governor address the worker books memory against a local budget; with no cache address it
compiles locally (and keeps its own disk cache). Every flag has a GPUPLANE_WORKER_* default.
"""
from __future__ import annotations

import argparse
import faulthandler
import logging
import math
import pathlib
import signal
import sys

from gpu_worker.config import (
    CHECKPOINT_QUANTIZERS,
    DEFAULT_DEQUANT_TILE_BYTES,
    DEFAULT_GIL_SWITCH_MS,
    DEFAULT_KV_SWAP_HOST_BYTES,
    DEFAULT_MAX_PLANS,
    DEFAULT_MIN_PREFILL_SHARE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PREFILL_ORDER,
    DEFAULT_VARIANTS_PER_NODE,
    PREFILL_ORDERS,
    WorkerConfig,
    default_worker_id,
)
from gpu_worker.core.token_stream import (
    DEFAULT_STREAM_BUFFER_TOKENS,
    MAX_STREAM_BUFFER_TOKENS,
    MAX_STREAM_INTERVAL,
    StreamStats,
)
from services.common import cli, security
from services.common.config import VAR_DIR, env_flag, env_switch
from services.common.errors import GpuplaneError
from services.common.logs import configure_logging
from services.common.metrics import start_metrics_endpoint
from services.common.telemetry import tracer_provider

log = logging.getLogger("gpu_worker")


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog="python -m gpu_worker", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="run the worker's gRPC server until SIGTERM/SIGINT")
    env_flag(serve, "--listen", "GPUPLANE_WORKER_LISTEN", "127.0.0.1:50071", "HOST:PORT to serve on")
    env_flag(serve, "--backend", "GPUPLANE_WORKER_BACKEND", "auto",
             "device backend: cuda (the product), sim (test double) or auto (cuda when a GPU exists)",
             choices=["auto", "cuda", "sim"])
    env_flag(serve, "--governor", "GPUPLANE_WORKER_GOVERNOR", "",
             "governor HOST:PORT; empty = book against a local budget")
    env_flag(serve, "--cache", "GPUPLANE_WORKER_CACHE", "",
             "kernel cache service HOST:PORT; empty = compile and cache locally only")
    env_flag(serve, "--cache-dir", "GPUPLANE_WORKER_CACHE_DIR", f"{VAR_DIR}/worker/kernels",
             "local disk cache of compiled kernels")
    env_flag(serve, "--cache-write-token", "GPUPLANE_WORKER_CACHE_WRITE_TOKEN", "",
             "bearer token for storing into the kernel cache service; empty = read only")
    env_flag(serve, "--governor-token", "GPUPLANE_WORKER_GOVERNOR_TOKEN", "",
             "bearer token naming this worker to the governor (deployments without mutual TLS)")
    env_flag(serve, "--worker-id", "GPUPLANE_WORKER_ID", "", "worker id (default: HOST-PID)")
    env_flag(serve, "--variants-per-node", "GPUPLANE_KERNEL_VARIANTS_PER_NODE", DEFAULT_VARIANTS_PER_NODE,
             "kernel shape variants kept per node", type=int)
    env_flag(serve, "--max-plans", "GPUPLANE_MAX_PLANS", DEFAULT_MAX_PLANS, "warm shape plans kept per model", type=int)
    env_flag(serve, "--max-plan-bytes", "GPUPLANE_MAX_PLAN_BYTES", 0,
             "byte bound on one model's warm plans (arenas + graphs); 0 = only --max-plans", type=int)
    env_flag(serve, "--cache-namespace", "GPUPLANE_WORKER_CACHE_NAMESPACE", "",
             "namespace of this worker's entries in the kernel cache service (its per-namespace "
             "budget applies); empty = the default namespace")
    env_flag(serve, "--weight-budget-bytes", "GPUPLANE_WORKER_WEIGHT_BUDGET_BYTES", 0,
             "cap on resident weight bytes (idle models' weights page out to pinned host, their "
             "next request pages them in); the governor's weights zone may cap lower; 0 = none",
             type=int)
    env_flag(serve, "--host-pinned-budget-bytes", "GPUPLANE_WORKER_HOST_PINNED_BUDGET_BYTES", 0,
             "cap on pinned host bytes holding weight copies; 0 = none", type=int)
    env_flag(serve, "--lease-chunk-bytes", "GPUPLANE_WORKER_LEASE_CHUNK_BYTES", 64 << 20,
             "governor lease growth unit: larger = fewer Acquire calls, more idle lease bytes",
             type=int)
    env_flag(serve, "--metrics-port", "GPUPLANE_WORKER_METRICS_PORT", 0,
             "Prometheus /metrics port; 0 = disabled", type=int)
    env_flag(serve, "--max-workers", "GPUPLANE_WORKER_MAX_WORKERS", 32,
             "threads for calls that wait for the device (Embed, single-sequence streams); "
             "not a bound on streams (--max-batch-size and --max-queued are)", type=int)
    env_flag(serve, "--max-stream-buffer-tokens", "GPUPLANE_WORKER_MAX_STREAM_BUFFER_TOKENS",
             DEFAULT_STREAM_BUFFER_TOKENS,
             "tokens a Generate stream may hold for a client that does not read them; beyond it "
             "the stream is cancelled (RESOURCE_EXHAUSTED) and its KV freed", type=int)
    env_flag(serve, "--stream-interval", "GPUPLANE_WORKER_STREAM_INTERVAL", 1,
             "tokens a Generate message carries after the stream's first (the end sends the rest): "
             "N cuts the edge's messages, and its per-message work, N-fold at the cost of "
             "tokens arriving N at a time", type=int)
    env_flag(serve, "--grace-seconds", "GPUPLANE_WORKER_GRACE_SECONDS", 10.0,
             "how long in-flight calls get after SIGTERM", type=float)
    env_flag(serve, "--gil-switch-ms", "GPUPLANE_WORKER_GIL_SWITCH_MS", DEFAULT_GIL_SWITCH_MS,
             "how long a Python thread keeps the GIL while another waits for it "
             "(sys.setswitchinterval); Python's own default is 5", type=float)
    env_switch(serve, "--enqueue-keeps-gil", "GPUPLANE_WORKER_ENQUEUE_KEEPS_GIL", True,
               "make the cuda driver calls that only enqueue (event records, graph launches, "
               "copies of pinned memory) without handing the GIL to the edge's threads; "
               "--no-enqueue-keeps-gil: cuda-python releases it around every driver call")
    # --tls-cert/--tls-key are the worker's one identity: served to its callers and presented to
    # the governor and the cache; --tls-ca verifies those two.
    security.add_server_flags(serve, "WORKER")
    security.add_client_flags(serve, "WORKER", pair=False)
    env_flag(serve, "--model-root", "GPUPLANE_WORKER_MODEL_ROOT", "",
             "directory of Hugging Face checkpoints LoadModel may read; empty = synthetic models only")
    env_flag(serve, "--embed-batch-wait-ms", "GPUPLANE_EMBED_BATCH_WAIT_MS", 2.0,
             "how long an Embed request waits for others to share its encoder batch", type=float)
    env_flag(serve, "--embed-max-batch", "GPUPLANE_EMBED_MAX_BATCH", 64,
             "sequences per Embed batch (1: one at a time)", type=int)
    env_flag(serve, "--embed-max-batch-tokens", "GPUPLANE_EMBED_MAX_BATCH_TOKENS", 32768,
             "padded tokens per Embed batch (a single sequence always runs)", type=int)
    env_flag(serve, "--load-timeout-seconds", "GPUPLANE_WORKER_LOAD_TIMEOUT_S", 600.0,
             "a whole LoadModel's deadline; past it the load unwinds with DEADLINE_EXCEEDED",
             type=float)
    env_flag(serve, "--checkpoint-context", "GPUPLANE_WORKER_CHECKPOINT_CONTEXT", 8192,
             "tokens of context served from a checkpoint (at most its max_position_embeddings)",
             type=int)
    env_flag(serve, "--checkpoint-quantizer", "GPUPLANE_WORKER_CHECKPOINT_QUANTIZER", "device",
             "where a checkpoint's float linears become int4: device (a kernel; the load needs "
             "no free host cores) or host (NumPy on the loader's threads); the same bytes",
             choices=CHECKPOINT_QUANTIZERS)
    # continuous batching (docs/scheduler.md)
    env_flag(serve, "--max-batch-size", "GPUPLANE_MAX_BATCH_SIZE", 64,
             "running sequences per decoder model (the decode batch)", type=int)
    env_flag(serve, "--max-step-tokens", "GPUPLANE_MAX_STEP_TOKENS", 2048,
             "tokens per engine step: decode rows plus prefill chunks", type=int)
    env_flag(serve, "--min-prefill-share", "GPUPLANE_MIN_PREFILL_SHARE", DEFAULT_MIN_PREFILL_SHARE,
             "smallest prefill chunk a step gives a prompt (tokens): fewer, larger chunks per "
             "step (each chunk reads every weight once) against earlier first tokens", type=int)
    env_flag(serve, "--prefill-order", "GPUPLANE_PREFILL_ORDER", DEFAULT_PREFILL_ORDER,
             "who a step's prefill tokens go to first: fair (max-min fair shares) or shortest "
             "(the shortest remaining prompt first; the oldest prompt still gets its floor)",
             choices=PREFILL_ORDERS)
    env_flag(serve, "--max-queued", "GPUPLANE_MAX_QUEUED", 1024,
             "waiting Generate requests per model; beyond it RESOURCE_EXHAUSTED", type=int)
    env_flag(serve, "--kv-block-tokens", "GPUPLANE_KV_BLOCK_TOKENS", 16,
             "tokens per paged KV block (a power of two in 16..256)", type=int)
    env_flag(serve, "--prefill-chunk", "GPUPLANE_PREFILL_CHUNK", DEFAULT_PREFILL_CHUNK,
             "prompt tokens per prefill chunk (a longer prompt runs as several chunks)", type=int)
    env_flag(serve, "--dequant-tile-bytes", "GPUPLANE_DEQUANT_TILE_BYTES", DEFAULT_DEQUANT_TILE_BYTES,
             "one model's fp16 dequantization tile for int4 prefill linears", type=int)
    env_switch(serve, "--dependent-launch", "GPUPLANE_DEPENDENT_LAUNCH", True,
               "on sm_90: a kernel that waits for its inputs itself starts while the kernel before "
               "it ends (docs/kernels.md); --no-dependent-launch serializes every launch")
    env_flag(serve, "--step-trace", "GPUPLANE_STEP_TRACE", "",
             "append one JSON line per decoder engine step to this file: decode rows, prefill "
             "chunks, device span, host and wait time (docs/scheduler.md); empty: off")
    env_flag(serve, "--kv-pool-bytes", "GPUPLANE_KV_POOL_BYTES", 0,
             "largest KV pool per decoder (virtual; committed as it grows); 0 = max-batch-size "
             "sequences at full context", type=int)
    env_switch(serve, "--prefix-cache", "GPUPLANE_PREFIX_CACHE", True,
               "share the full KV blocks of a prompt prefix already computed (docs/scheduler.md); "
               "--no-prefix-cache prefills every prompt whole")
    env_switch(serve, "--kv-swap", "GPUPLANE_KV_SWAP", True,
               "a preempted sequence's KV blocks, and evicted cached prefix blocks, go to pinned "
               "host and back when the copies cost less than recomputing them "
               "(docs/scheduler.md); --no-kv-swap always recomputes")
    env_switch(serve, "--kv-demote", "GPUPLANE_KV_DEMOTE", True,
               "with --kv-swap and --prefix-cache: an evicted cached prefix block goes to "
               "pinned host (promoted back on a hit) when the copy costs less than its prefill; "
               "--no-kv-demote drops it (the host tier then holds swapped sequences only)")
    env_flag(serve, "--kv-swap-host-bytes", "GPUPLANE_KV_SWAP_HOST_BYTES",
             DEFAULT_KV_SWAP_HOST_BYTES,
             "pinned host bytes all decoders' swapped KV may hold; a swap that does not fit "
             "recomputes; 0 = no swap", type=int)
    env_flag(serve, "--kv-swap-copy-rate", "GPUPLANE_KV_SWAP_COPY_RATE", 0.0,
             "pinned copy rate (bytes/s each way) the swap rule uses; 0 = measured at load",
             type=float)
    env_flag(serve, "--kv-swap-prefill-rate", "GPUPLANE_KV_SWAP_PREFILL_RATE", 0.0,
             "prefill rate (tokens/s) the swap rule uses; 0 = measured by each decoder's "
             "scheduler", type=float)
    return parser


def worker_config(args: argparse.Namespace, provider: object = None,
                  tls: object = None) -> WorkerConfig:
    """The runtime's configuration from parsed `serve` flags."""
    return WorkerConfig(
        backend=args.backend,
        governor=args.governor or None,
        cache=args.cache or None,
        cache_dir=pathlib.Path(args.cache_dir) if args.cache_dir else None,
        cache_namespace=args.cache_namespace,
        worker_id=args.worker_id or default_worker_id(),
        variants_per_node=args.variants_per_node,
        max_plans=args.max_plans,
        max_plan_bytes=args.max_plan_bytes or None,
        cache_write_token=args.cache_write_token or None,
        tls=tls,
        governor_token=args.governor_token or None,
        tracer_provider=provider,
        model_root=pathlib.Path(args.model_root) if args.model_root else None,
        checkpoint_context=args.checkpoint_context,
        checkpoint_quantizer=args.checkpoint_quantizer,
        load_timeout_s=args.load_timeout_seconds,
        weight_budget_bytes=args.weight_budget_bytes or None,
        host_pinned_budget_bytes=args.host_pinned_budget_bytes or None,
        lease_chunk_bytes=args.lease_chunk_bytes,
        embed_batch_wait_ms=args.embed_batch_wait_ms,
        embed_max_batch=args.embed_max_batch,
        embed_max_batch_tokens=args.embed_max_batch_tokens,
        max_batch_size=args.max_batch_size,
        max_step_tokens=args.max_step_tokens,
        min_prefill_share=args.min_prefill_share,
        prefill_order=args.prefill_order,
        max_queued=args.max_queued,
        kv_block_tokens=args.kv_block_tokens,
        kv_pool_bytes=args.kv_pool_bytes,
        prefix_cache=args.prefix_cache,
        kv_swap=args.kv_swap,
        kv_demote=args.kv_demote,
        kv_swap_host_bytes=args.kv_swap_host_bytes,
        kv_swap_copy_rate=args.kv_swap_copy_rate,
        kv_swap_prefill_rate=args.kv_swap_prefill_rate,
        prefill_chunk=args.prefill_chunk,
        dequant_tile_bytes=args.dequant_tile_bytes,
        dependent_launch=args.dependent_launch,
        enqueue_keeps_gil=args.enqueue_keeps_gil,
        step_trace=pathlib.Path(args.step_trace) if args.step_trace else None,
    )


def flag_problem(args: argparse.Namespace) -> str:
    """Why the `serve` flags cannot start a worker ("" when they can)."""
    if args.variants_per_node < 1 or args.max_plans < 1 or args.max_plan_bytes < 0:
        return "--variants-per-node and --max-plans must be at least 1, --max-plan-bytes >= 0"
    if args.weight_budget_bytes < 0 or args.host_pinned_budget_bytes < 0:
        return "--weight-budget-bytes and --host-pinned-budget-bytes must be >= 0 (0 = none)"
    if args.lease_chunk_bytes <= 0:
        return "--lease-chunk-bytes must be positive"
    if args.embed_batch_wait_ms < 0 or args.embed_max_batch < 1 or args.embed_max_batch_tokens < 1:
        return "--embed-batch-wait-ms must be >= 0, --embed-max-batch and " \
               "--embed-max-batch-tokens at least 1"
    if min(args.max_batch_size, args.max_step_tokens, args.max_queued) < 1:
        return "--max-batch-size, --max-step-tokens and --max-queued must be at least 1"
    if args.checkpoint_quantizer not in CHECKPOINT_QUANTIZERS:   # nor is this environment's
        return ("--checkpoint-quantizer (GPUPLANE_WORKER_CHECKPOINT_QUANTIZER) must be "
                f"{' or '.join(CHECKPOINT_QUANTIZERS)}")
    if args.prefill_order not in PREFILL_ORDERS:      # the environment's value is not checked
        return f"--prefill-order (GPUPLANE_PREFILL_ORDER) must be {' or '.join(PREFILL_ORDERS)}"
    if args.max_step_tokens < args.max_batch_size:
        return "--max-step-tokens must be at least --max-batch-size (a full batch of decodes)"
    if not math.isfinite(args.load_timeout_seconds) or not 0 < args.load_timeout_seconds <= 86400:
        return "--load-timeout-seconds must be in (0, 86400]"
    if args.prefill_chunk < 1 or args.dequant_tile_bytes < 1:
        return "--prefill-chunk and --dequant-tile-bytes must be at least 1"
    if args.max_workers < 1:
        return "--max-workers must be at least 1"
    if not math.isfinite(args.gil_switch_ms) or not 0.01 <= args.gil_switch_ms <= 100:
        return "--gil-switch-ms (GPUPLANE_WORKER_GIL_SWITCH_MS) must be in 0.01..100"
    if not 1 <= args.max_stream_buffer_tokens <= MAX_STREAM_BUFFER_TOKENS:
        return f"--max-stream-buffer-tokens must be in 1..{MAX_STREAM_BUFFER_TOKENS}"
    if not 1 <= args.stream_interval <= min(MAX_STREAM_INTERVAL, args.max_stream_buffer_tokens):
        return (f"--stream-interval (GPUPLANE_WORKER_STREAM_INTERVAL) must be in 1..{MAX_STREAM_INTERVAL} "
                "and at most --max-stream-buffer-tokens")
    if args.kv_block_tokens not in (16, 32, 64, 128, 256) or args.kv_pool_bytes < 0:
        return "--kv-block-tokens must be a power of two in 16..256, --kv-pool-bytes >= 0"
    if args.kv_swap_host_bytes < 0:
        return "--kv-swap-host-bytes must be >= 0 (0 = no swap)"
    rates = (args.kv_swap_copy_rate, args.kv_swap_prefill_rate)
    if not all(math.isfinite(r) and r >= 0 for r in rates):
        return "--kv-swap-copy-rate and --kv-swap-prefill-rate must be finite and >= 0 (0 = measured)"
    return ""


def serve(args: argparse.Namespace) -> int:
    from gpu_worker.core.runtime import WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker

    configure_logging("gpu-worker")
    # `kill -USR1 <pid>` dumps every thread's stack to stderr: how to see a stuck request.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    problem = flag_problem(args)
    if problem:
        log.error(problem)
        return 2
    try:
        server_security = security.server_security_from_args(args)
        outgoing = security.channel_tls_from_args(args)
    except GpuplaneError as err:
        log.error("%s", err.message)
        return 2
    if args.checkpoint_context < 1:
        log.error("--checkpoint-context must be at least 1")
        return 2
    sys.setswitchinterval(args.gil_switch_ms / 1e3)
    provider = tracer_provider("gpu-worker")
    config = worker_config(args, provider, tls=outgoing)
    runtime = WorkerRuntime(config)
    runtime.start()
    streams = StreamStats()
    try:
        server = serve_worker(runtime, args.listen, provider, max_workers=args.max_workers,
                              security=server_security,
                              max_stream_buffer_tokens=args.max_stream_buffer_tokens,
                              stream_interval=args.stream_interval,
                              streams=streams)
    except GpuplaneError as err:  # TLS files that cannot be read
        runtime.close()
        log.error("%s", err.message)
        return 2
    except BaseException:
        runtime.close()
        raise
    if args.metrics_port:
        from prometheus_client import REGISTRY

        from gpu_worker.edge.metrics import WorkerCollector

        REGISTRY.register(WorkerCollector(runtime, streams))
        start_metrics_endpoint(args.metrics_port)
    log.info("worker serving (GIL switch interval %.2f ms, stream interval %d, enqueues %s the GIL)",
             sys.getswitchinterval() * 1e3, args.stream_interval,
             "keep" if args.enqueue_keeps_gil else "release",
             extra={"listen": args.listen, "port": server.port, "backend": args.backend,
                    "worker_id": config.worker_id, "governor": args.governor,
                    "cache": args.cache})
    # The bound port on stdout lets a launcher that asked for port 0 find the worker.
    print(f"listening on {server.port}", flush=True)
    server.serve_until_signalled(args.grace_seconds)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return serve(args)
    return 2


if __name__ == "__main__":
    cli.run(main)
