from gpuplane.governor.v1 import governor_pb2 as _governor_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ModelInfo(_message.Message):
    __slots__ = ("model_id", "family", "config", "seed", "vocab_size", "max_context", "weight_bytes", "checkpoint", "architecture", "weight_format", "has_tokenizer", "resident_bytes", "state")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    HAS_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    family: str
    config: str
    seed: int
    vocab_size: int
    max_context: int
    weight_bytes: int
    checkpoint: str
    architecture: str
    weight_format: str
    has_tokenizer: bool
    resident_bytes: int
    state: str
    def __init__(self, model_id: _Optional[str] = ..., family: _Optional[str] = ..., config: _Optional[str] = ..., seed: _Optional[int] = ..., vocab_size: _Optional[int] = ..., max_context: _Optional[int] = ..., weight_bytes: _Optional[int] = ..., checkpoint: _Optional[str] = ..., architecture: _Optional[str] = ..., weight_format: _Optional[str] = ..., has_tokenizer: _Optional[bool] = ..., resident_bytes: _Optional[int] = ..., state: _Optional[str] = ...) -> None: ...

class LoadModelRequest(_message.Message):
    __slots__ = ("model_id", "family", "config", "seed", "checkpoint", "weight_format")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    FAMILY_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    family: str
    config: str
    seed: int
    checkpoint: str
    weight_format: str
    def __init__(self, model_id: _Optional[str] = ..., family: _Optional[str] = ..., config: _Optional[str] = ..., seed: _Optional[int] = ..., checkpoint: _Optional[str] = ..., weight_format: _Optional[str] = ...) -> None: ...

class LoadModelResponse(_message.Message):
    __slots__ = ("model", "load_seconds", "kernels_compiled", "kernels_from_cache")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    LOAD_SECONDS_FIELD_NUMBER: _ClassVar[int]
    KERNELS_COMPILED_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FROM_CACHE_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    load_seconds: float
    kernels_compiled: int
    kernels_from_cache: int
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., load_seconds: _Optional[float] = ..., kernels_compiled: _Optional[int] = ..., kernels_from_cache: _Optional[int] = ...) -> None: ...

class UnloadModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class UnloadModelResponse(_message.Message):
    __slots__ = ("freed_bytes",)
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ...) -> None: ...

class OffloadModelRequest(_message.Message):
    __slots__ = ("model_id",)
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    def __init__(self, model_id: _Optional[str] = ...) -> None: ...

class OffloadModelResponse(_message.Message):
    __slots__ = ("model", "freed_bytes")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    model: ModelInfo
    freed_bytes: int
    def __init__(self, model: _Optional[_Union[ModelInfo, _Mapping]] = ..., freed_bytes: _Optional[int] = ...) -> None: ...

class ListModelsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListModelsResponse(_message.Message):
    __slots__ = ("models",)
    MODELS_FIELD_NUMBER: _ClassVar[int]
    models: _containers.RepeatedCompositeFieldContainer[ModelInfo]
    def __init__(self, models: _Optional[_Iterable[_Union[ModelInfo, _Mapping]]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("model_id", "prompt_tokens", "max_new_tokens", "prompt", "sampling")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    prompt_tokens: _containers.RepeatedScalarFieldContainer[int]
    max_new_tokens: int
    prompt: str
    sampling: SamplingParams
    def __init__(self, model_id: _Optional[str] = ..., prompt_tokens: _Optional[_Iterable[int]] = ..., max_new_tokens: _Optional[int] = ..., prompt: _Optional[str] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "stop_token_ids")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("tokens", "done", "first_token_seconds", "prompt_tokens", "text", "stopped_at_eos", "finish_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    STOPPED_AT_EOS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    done: bool
    first_token_seconds: float
    prompt_tokens: int
    text: str
    stopped_at_eos: bool
    finish_reason: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., done: _Optional[bool] = ..., first_token_seconds: _Optional[float] = ..., prompt_tokens: _Optional[int] = ..., text: _Optional[str] = ..., stopped_at_eos: _Optional[bool] = ..., finish_reason: _Optional[str] = ...) -> None: ...

class TokenSequence(_message.Message):
    __slots__ = ("tokens",)
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("model_id", "sequences", "texts")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    TEXTS_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    sequences: _containers.RepeatedCompositeFieldContainer[TokenSequence]
    texts: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, model_id: _Optional[str] = ..., sequences: _Optional[_Iterable[_Union[TokenSequence, _Mapping]]] = ..., texts: _Optional[_Iterable[str]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("embeddings",)
    EMBEDDINGS_FIELD_NUMBER: _ClassVar[int]
    embeddings: _containers.RepeatedCompositeFieldContainer[Embedding]
    def __init__(self, embeddings: _Optional[_Iterable[_Union[Embedding, _Mapping]]] = ...) -> None: ...

class KernelCacheStats(_message.Message):
    __slots__ = ("entries", "hits", "misses", "evictions", "max_variants_per_node", "workspace_bytes", "variant_bound")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_VARIANTS_PER_NODE_FIELD_NUMBER: _ClassVar[int]
    WORKSPACE_BYTES_FIELD_NUMBER: _ClassVar[int]
    VARIANT_BOUND_FIELD_NUMBER: _ClassVar[int]
    entries: int
    hits: int
    misses: int
    evictions: int
    max_variants_per_node: int
    workspace_bytes: int
    variant_bound: int
    def __init__(self, entries: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., evictions: _Optional[int] = ..., max_variants_per_node: _Optional[int] = ..., workspace_bytes: _Optional[int] = ..., variant_bound: _Optional[int] = ...) -> None: ...

class PlanStats(_message.Message):
    __slots__ = ("entries", "evictions", "hits", "misses", "graph_bytes", "activation_bytes")
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    GRAPH_BYTES_FIELD_NUMBER: _ClassVar[int]
    ACTIVATION_BYTES_FIELD_NUMBER: _ClassVar[int]
    entries: int
    evictions: int
    hits: int
    misses: int
    graph_bytes: int
    activation_bytes: int
    def __init__(self, entries: _Optional[int] = ..., evictions: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., graph_bytes: _Optional[int] = ..., activation_bytes: _Optional[int] = ...) -> None: ...

class WeightStats(_message.Message):
    __slots__ = ("page_ins", "hits", "evictions", "hit_rate", "bytes_copied", "resident_bytes", "budget_bytes", "host_bytes", "host_budget_bytes")
    PAGE_INS_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATE_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_BYTES_FIELD_NUMBER: _ClassVar[int]
    BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    HOST_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    page_ins: int
    hits: int
    evictions: int
    hit_rate: float
    bytes_copied: int
    resident_bytes: int
    budget_bytes: int
    host_bytes: int
    host_budget_bytes: int
    def __init__(self, page_ins: _Optional[int] = ..., hits: _Optional[int] = ..., evictions: _Optional[int] = ..., hit_rate: _Optional[float] = ..., bytes_copied: _Optional[int] = ..., resident_bytes: _Optional[int] = ..., budget_bytes: _Optional[int] = ..., host_bytes: _Optional[int] = ..., host_budget_bytes: _Optional[int] = ...) -> None: ...

class ReclaimStats(_message.Message):
    __slots__ = ("rounds", "governor_asks", "completed_releases_bytes", "idle_plans_bytes", "pooled_handles_bytes", "idle_weights_bytes", "peer_waits", "kv_preemption_bytes", "cached_kv_bytes")
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    GOVERNOR_ASKS_FIELD_NUMBER: _ClassVar[int]
    COMPLETED_RELEASES_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_PLANS_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOLED_HANDLES_BYTES_FIELD_NUMBER: _ClassVar[int]
    IDLE_WEIGHTS_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEER_WAITS_FIELD_NUMBER: _ClassVar[int]
    KV_PREEMPTION_BYTES_FIELD_NUMBER: _ClassVar[int]
    CACHED_KV_BYTES_FIELD_NUMBER: _ClassVar[int]
    rounds: int
    governor_asks: int
    completed_releases_bytes: int
    idle_plans_bytes: int
    pooled_handles_bytes: int
    idle_weights_bytes: int
    peer_waits: int
    kv_preemption_bytes: int
    cached_kv_bytes: int
    def __init__(self, rounds: _Optional[int] = ..., governor_asks: _Optional[int] = ..., completed_releases_bytes: _Optional[int] = ..., idle_plans_bytes: _Optional[int] = ..., pooled_handles_bytes: _Optional[int] = ..., idle_weights_bytes: _Optional[int] = ..., peer_waits: _Optional[int] = ..., kv_preemption_bytes: _Optional[int] = ..., cached_kv_bytes: _Optional[int] = ...) -> None: ...

class EmbedBatchStats(_message.Message):
    __slots__ = ("batches", "requests", "sequences", "peak_batch_sequences", "cancelled_requests", "tokens", "padded_tokens")
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FIELD_NUMBER: _ClassVar[int]
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PEAK_BATCH_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PADDED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    batches: int
    requests: int
    sequences: int
    peak_batch_sequences: int
    cancelled_requests: int
    tokens: int
    padded_tokens: int
    def __init__(self, batches: _Optional[int] = ..., requests: _Optional[int] = ..., sequences: _Optional[int] = ..., peak_batch_sequences: _Optional[int] = ..., cancelled_requests: _Optional[int] = ..., tokens: _Optional[int] = ..., padded_tokens: _Optional[int] = ...) -> None: ...

class CompileStats(_message.Message):
    __slots__ = ("compiled", "compile_seconds", "memo_hits", "local_hits", "remote_hits", "remote_errors", "remote_timeouts", "load_fallbacks", "claims_granted", "claim_waits", "claim_wait_hits", "claim_takeovers", "claim_wait_timeouts")
    COMPILED_FIELD_NUMBER: _ClassVar[int]
    COMPILE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEMO_HITS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_HITS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ERRORS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    LOAD_FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    CLAIMS_GRANTED_FIELD_NUMBER: _ClassVar[int]
    CLAIM_WAITS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_WAIT_HITS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TAKEOVERS_FIELD_NUMBER: _ClassVar[int]
    CLAIM_WAIT_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    compiled: int
    compile_seconds: float
    memo_hits: int
    local_hits: int
    remote_hits: int
    remote_errors: int
    remote_timeouts: int
    load_fallbacks: int
    claims_granted: int
    claim_waits: int
    claim_wait_hits: int
    claim_takeovers: int
    claim_wait_timeouts: int
    def __init__(self, compiled: _Optional[int] = ..., compile_seconds: _Optional[float] = ..., memo_hits: _Optional[int] = ..., local_hits: _Optional[int] = ..., remote_hits: _Optional[int] = ..., remote_errors: _Optional[int] = ..., remote_timeouts: _Optional[int] = ..., load_fallbacks: _Optional[int] = ..., claims_granted: _Optional[int] = ..., claim_waits: _Optional[int] = ..., claim_wait_hits: _Optional[int] = ..., claim_takeovers: _Optional[int] = ..., claim_wait_timeouts: _Optional[int] = ...) -> None: ...

class CaptureStats(_message.Message):
    __slots__ = ("captures", "invalidations", "gate_waits", "replays")
    CAPTURES_FIELD_NUMBER: _ClassVar[int]
    INVALIDATIONS_FIELD_NUMBER: _ClassVar[int]
    GATE_WAITS_FIELD_NUMBER: _ClassVar[int]
    REPLAYS_FIELD_NUMBER: _ClassVar[int]
    captures: int
    invalidations: int
    gate_waits: int
    replays: int
    def __init__(self, captures: _Optional[int] = ..., invalidations: _Optional[int] = ..., gate_waits: _Optional[int] = ..., replays: _Optional[int] = ...) -> None: ...

class ArenaStats(_message.Message):
    __slots__ = ("reserved_bytes", "committed_bytes", "peak_committed_bytes", "pooled_bytes", "quarantined_bytes", "commits", "releases", "faults")
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAK_COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    POOLED_BYTES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_BYTES_FIELD_NUMBER: _ClassVar[int]
    COMMITS_FIELD_NUMBER: _ClassVar[int]
    RELEASES_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    reserved_bytes: int
    committed_bytes: int
    peak_committed_bytes: int
    pooled_bytes: int
    quarantined_bytes: int
    commits: int
    releases: int
    faults: int
    def __init__(self, reserved_bytes: _Optional[int] = ..., committed_bytes: _Optional[int] = ..., peak_committed_bytes: _Optional[int] = ..., pooled_bytes: _Optional[int] = ..., quarantined_bytes: _Optional[int] = ..., commits: _Optional[int] = ..., releases: _Optional[int] = ..., faults: _Optional[int] = ...) -> None: ...

class SchedulerStats(_message.Message):
    __slots__ = ("running", "waiting", "peak_batch_size", "steps", "preemptions", "kv_block_tokens", "kv_blocks_total", "kv_blocks_used", "prefill_tokens", "decode_tokens", "kv_committed_bytes", "finished", "cancelled", "rejected", "prefix_cache_hit_tokens", "prefix_cache_queried_tokens", "kv_blocks_cached", "kv_swapped_out_blocks", "kv_swapped_in_blocks", "kv_swap_outs", "kv_swap_ins", "kv_swap_declined", "kv_swap_refused", "kv_swap_failed", "kv_swap_host_bytes", "kv_swap_host_budget_bytes", "step_host_us", "step_wait_us", "step_device_us", "kv_blocks_demoted", "kv_blocks_promoted", "kv_host_cached_blocks", "kv_host_cached_bytes")
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PEAK_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PREEMPTIONS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DECODE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_COMMITTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    CANCELLED_FIELD_NUMBER: _ClassVar[int]
    REJECTED_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_QUERIED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_SWAPPED_OUT_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SWAPPED_IN_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_OUTS_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_INS_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_DECLINED_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_REFUSED_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_FAILED_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_HOST_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_SWAP_HOST_BUDGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_HOST_US_FIELD_NUMBER: _ClassVar[int]
    STEP_WAIT_US_FIELD_NUMBER: _ClassVar[int]
    STEP_DEVICE_US_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_DEMOTED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_PROMOTED_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_HOST_CACHED_BYTES_FIELD_NUMBER: _ClassVar[int]
    running: int
    waiting: int
    peak_batch_size: int
    steps: int
    preemptions: int
    kv_block_tokens: int
    kv_blocks_total: int
    kv_blocks_used: int
    prefill_tokens: int
    decode_tokens: int
    kv_committed_bytes: int
    finished: int
    cancelled: int
    rejected: int
    prefix_cache_hit_tokens: int
    prefix_cache_queried_tokens: int
    kv_blocks_cached: int
    kv_swapped_out_blocks: int
    kv_swapped_in_blocks: int
    kv_swap_outs: int
    kv_swap_ins: int
    kv_swap_declined: int
    kv_swap_refused: int
    kv_swap_failed: int
    kv_swap_host_bytes: int
    kv_swap_host_budget_bytes: int
    step_host_us: int
    step_wait_us: int
    step_device_us: int
    kv_blocks_demoted: int
    kv_blocks_promoted: int
    kv_host_cached_blocks: int
    kv_host_cached_bytes: int
    def __init__(self, running: _Optional[int] = ..., waiting: _Optional[int] = ..., peak_batch_size: _Optional[int] = ..., steps: _Optional[int] = ..., preemptions: _Optional[int] = ..., kv_block_tokens: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., prefill_tokens: _Optional[int] = ..., decode_tokens: _Optional[int] = ..., kv_committed_bytes: _Optional[int] = ..., finished: _Optional[int] = ..., cancelled: _Optional[int] = ..., rejected: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., prefix_cache_queried_tokens: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_swapped_out_blocks: _Optional[int] = ..., kv_swapped_in_blocks: _Optional[int] = ..., kv_swap_outs: _Optional[int] = ..., kv_swap_ins: _Optional[int] = ..., kv_swap_declined: _Optional[int] = ..., kv_swap_refused: _Optional[int] = ..., kv_swap_failed: _Optional[int] = ..., kv_swap_host_bytes: _Optional[int] = ..., kv_swap_host_budget_bytes: _Optional[int] = ..., step_host_us: _Optional[int] = ..., step_wait_us: _Optional[int] = ..., step_device_us: _Optional[int] = ..., kv_blocks_demoted: _Optional[int] = ..., kv_blocks_promoted: _Optional[int] = ..., kv_host_cached_blocks: _Optional[int] = ..., kv_host_cached_bytes: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetStatsResponse(_message.Message):
    __slots__ = ("backend", "device_name", "device_total_bytes", "device_used_bytes", "ledger_bytes", "unaccounted_bytes", "zones", "kernel_cache", "plans", "weights", "compile", "capture", "arena", "governor_connected", "reclaim", "embed_batch", "scheduler")
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    DEVICE_TOTAL_BYTES_FIELD_NUMBER: _ClassVar[int]
    DEVICE_USED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNACCOUNTED_BYTES_FIELD_NUMBER: _ClassVar[int]
    ZONES_FIELD_NUMBER: _ClassVar[int]
    KERNEL_CACHE_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    COMPILE_FIELD_NUMBER: _ClassVar[int]
    CAPTURE_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    GOVERNOR_CONNECTED_FIELD_NUMBER: _ClassVar[int]
    RECLAIM_FIELD_NUMBER: _ClassVar[int]
    EMBED_BATCH_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    backend: str
    device_name: str
    device_total_bytes: int
    device_used_bytes: int
    ledger_bytes: int
    unaccounted_bytes: int
    zones: _containers.RepeatedCompositeFieldContainer[_governor_pb2.ZoneUsage]
    kernel_cache: KernelCacheStats
    plans: PlanStats
    weights: WeightStats
    compile: CompileStats
    capture: CaptureStats
    arena: ArenaStats
    governor_connected: bool
    reclaim: ReclaimStats
    embed_batch: EmbedBatchStats
    scheduler: SchedulerStats
    def __init__(self, backend: _Optional[str] = ..., device_name: _Optional[str] = ..., device_total_bytes: _Optional[int] = ..., device_used_bytes: _Optional[int] = ..., ledger_bytes: _Optional[int] = ..., unaccounted_bytes: _Optional[int] = ..., zones: _Optional[_Iterable[_Union[_governor_pb2.ZoneUsage, _Mapping]]] = ..., kernel_cache: _Optional[_Union[KernelCacheStats, _Mapping]] = ..., plans: _Optional[_Union[PlanStats, _Mapping]] = ..., weights: _Optional[_Union[WeightStats, _Mapping]] = ..., compile: _Optional[_Union[CompileStats, _Mapping]] = ..., capture: _Optional[_Union[CaptureStats, _Mapping]] = ..., arena: _Optional[_Union[ArenaStats, _Mapping]] = ..., governor_connected: _Optional[bool] = ..., reclaim: _Optional[_Union[ReclaimStats, _Mapping]] = ..., embed_batch: _Optional[_Union[EmbedBatchStats, _Mapping]] = ..., scheduler: _Optional[_Union[SchedulerStats, _Mapping]] = ...) -> None: ...

class TrimRequest(_message.Message):
    __slots__ = ("target_bytes",)
    TARGET_BYTES_FIELD_NUMBER: _ClassVar[int]
    target_bytes: int
    def __init__(self, target_bytes: _Optional[int] = ...) -> None: ...

class TrimResponse(_message.Message):
    __slots__ = ("freed_bytes", "ledger_bytes")
    FREED_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEDGER_BYTES_FIELD_NUMBER: _ClassVar[int]
    freed_bytes: int
    ledger_bytes: int
    def __init__(self, freed_bytes: _Optional[int] = ..., ledger_bytes: _Optional[int] = ...) -> None: ...
