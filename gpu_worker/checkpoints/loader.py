"""A Hugging Face checkpoint directory -> our weight keys, streamed one tensor at a time.

Hazard: an 8B model is 16 GB of bf16; holding it as floats and then as int4 would need three
times that in host memory, and converting it one tensor at a time on one core makes the load
several times slower than reading the files. Contract: `Checkpoint.weights()` yields (key, host
array) in `weight_names` order, each converted straight from the mmap of its shard in row chunks
(`_row_chunks`), and bit for bit what `models.weights.quantize` makes of the stored floats. It is a
pipeline: while the caller takes tensor i, the next tensors (at most MAX_LOOKAHEAD) are read
ahead (MADV_WILLNEED) and converted on QUANT_THREADS threads, so the host holds at most
MAX_LOOKAHEAD + 1 converted tensors plus one staged chunk per thread; `self.profile` says where
the time went. No conversion outlives the mapping: `close()` (and the generator's end) cancel
and drain the pool.
Every file is read through the checkpoint's `CheckpointFiles` (paths.py: under the model root,
regular files only). `Checkpoint.open` checks, in order and before anything is converted: the
config as a schema (hf_config.py, schema.py's bounds), every tensor's name, shape and dtype
against config.json (headers only), then that the host can hold the load (budget.py); so a bad
checkpoint fails before the device is touched and names the file and the tensor. Cost: one pass over the files, the disk's speed when they are not cached.
`weight_format="fp16"` keeps every linear as stored: cast to one fp16 `<key>.h` matrix in the same
row chunks (no quantization); a value beyond fp16's range (|x| > 65504) is refused, naming the
tensor, rather than served as inf. GPTQ files are already 4-bit: they load as int4 only.
The name mapping is in mapping.py, file lookup in shards.py, GPTQ's layout in gptq.py, the
chunked host quantizer in quantize.py; `Checkpoint.open(quantizer=)` takes another with the same
bytes (device_quantizer.py: the worker's default), whose buffers every chunk is staged in.
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import pathlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Self

import numpy as np

from gpu_worker.checkpoints import budget, gptq
from gpu_worker.checkpoints.hf_config import CheckpointSpec, read_spec
from gpu_worker.checkpoints.mapping import Source, sources
from gpu_worker.checkpoints.paths import CheckpointFiles
from gpu_worker.checkpoints.quantize import HOST_QUANTIZER, RowQuantizer
from gpu_worker.checkpoints.safetensors import CheckpointError, to_float32
from gpu_worker.checkpoints.shards import FLOAT_DTYPES, ShardSet
from gpu_worker.models.configs import QUANT_BLOCK, WEIGHT_FORMATS, ModelConfig
from gpu_worker.models.rope import inv_freq
from gpu_worker.models.weights import Fusion, device_weight_names, fuses, weight_names
from services.common.errors import FailedPrecondition, InvalidArgument

CHUNK_ROWS = 1024       # at most this many rows of a tensor per task
CHUNK_ELEMS = 1 << 21   # and about this many elements (4 MB of bf16): a linear is many tasks
# NumPy releases the GIL inside its loops, so tasks convert in parallel threads; each thread's
# transient memory is one staged chunk plus the quantizer's scratch. One core is left to the
# consumer (pinned copies): an oversubscribed machine makes every GIL hand-off wait for a core,
# so the cores are the ones this process may use (affinity, cgroup CPU limit), not the node's.
QUANT_THREADS = max(1, min(16, budget.host_cpus() - 1))
# Tensors read ahead and converting beyond the one the consumer takes. The consumer does not
# come back for ~0.1 s when it seals a layer (executor: pinned allocation + copy of ~160 MB at
# 8B), so each thread needs that much work queued (12 chunks, ~10 ms each under load) and the
# window a few layers (a layer is 9 tensors, a k_proj 2 chunks, a down_proj 28). Measured on an
# H100 host (16 cores, 8B shapes): 4 / 8 left the consumer waiting 1.1-1.5 s of a 4.3-5.4 s load;
# 12 / 24 waits 0.2 s; 16 / 32 was slower again (docs/checkpoints.md, "Load time").
QUEUED_PER_THREAD = 12
MAX_LOOKAHEAD = 24
F16_MAX = 65504.0   # the largest finite fp16


@dataclasses.dataclass
class LoadProfile:
    """Where a `weights()` pass spent its time. read/convert are thread-seconds summed over the
    QUANT_THREADS threads (they overlap each other and the consumer); wait is the consumer's time
    blocked on the next tensor, i.e. what the pipeline failed to hide."""
    read_s: float = 0.0      # copying stored bytes out of the mmap: page faults, page cache or disk
    convert_s: float = 0.0   # quantizing to int4, casting to fp16/f32
    wait_s: float = 0.0
    bytes_read: int = 0
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False)

    def add(self, read_s: float, convert_s: float, nbytes: int) -> None:
        with self._lock:
            self.read_s += read_s
            self.convert_s += convert_s
            self.bytes_read += nbytes


def _staged(view: np.ndarray, quantizer: RowQuantizer) -> np.ndarray:
    """`view`'s bytes copied into the calling thread's staging buffer (the quantizer's: pinned
    memory for the device's), so the read (page faults) is timed apart from the conversion and
    the conversion reads RAM, not the map."""
    buf = quantizer.staging(view.nbytes)
    out = buf[:view.nbytes].view(view.dtype).reshape(view.shape)
    np.copyto(out, view)
    return out


def _new_array(key: str, shape: tuple[int, ...], dtype: type) -> np.ndarray:
    """Where a tensor's conversion goes, without fusion: an array of its own."""
    return np.empty(shape, dtype)


def _row_chunks(rows: int, cols: int, scale: int = 1) -> list[slice]:
    """Row ranges of at most CHUNK_ROWS rows and about CHUNK_ELEMS elements, both times
    `scale` (the quantizer's chunk_scale)."""
    step = max(1, min(CHUNK_ROWS * scale, CHUNK_ELEMS * scale // max(1, cols)))
    return [slice(r, min(r + step, rows)) for r in range(0, rows, step)]


@dataclasses.dataclass
class _Job:
    """One source tensor: `tasks` run on the pool, then `finish()` gives its (key, array)s."""
    tasks: list[Callable[[], None]]
    finish: Callable[[], list[tuple[str, np.ndarray]]]
    reads: list[str]   # HF names to read ahead


def _check_float(shards: ShardSet, spec: CheckpointSpec, src: Source) -> None:
    shards.require(src.hf_name, FLOAT_DTYPES, src.hf_shape or src.shape, "a float tensor")
    if src.plus_row0:  # BERT's token-type table: any number of types (row 0 is used), hidden wide
        shape = shards.shape(src.plus_row0)
        types = shape[0] if len(shape) == 2 else 0
        shards.require(src.plus_row0, FLOAT_DTYPES, (max(types, 1), spec.cfg.hidden),
                       "a float table with at least one row")


def _check_gptq(shards: ShardSet, spec: CheckpointSpec, src: Source) -> None:
    """Shapes and dtypes of the GPTQ tensors, then what does not map onto our blocks without
    requantizing: act-order (g_idx other than i // group) and zero points other than 8."""
    out_dim, in_dim = src.shape
    group = in_dim if spec.gptq_group == -1 else spec.gptq_group
    base = src.hf_name
    if in_dim % group:
        raise CheckpointError(f"GPTQ group_size {group} does not divide the input dimension "
                              f"{in_dim} of {base!r}", tensor=base)
    shards.require(base + ".qweight", ("I32",), (in_dim // 8, out_dim), "int32 nibbles")
    shards.require(base + ".qzeros", ("I32",), (in_dim // group, out_dim // 8), "int32 zeros")
    shards.require(base + ".scales", ("F16",), (in_dim // group, out_dim), "fp16 scales")
    if shards.present(base + ".g_idx"):
        shards.require(base + ".g_idx", ("I32",), (in_dim,), "int32 group indices")
        if not np.array_equal(shards.raw(base + ".g_idx"), np.arange(in_dim) // group):
            raise FailedPrecondition(f"{shards.file_name(base + '.g_idx')}, tensor "
                                     f"{base + '.g_idx'!r}: act-order (desc_act) GPTQ is not "
                                     "supported", tensor=base + ".g_idx")
    if not (gptq.zeros(shards.raw(base + ".qzeros"), spec.gptq_v2) == 8).all():
        raise CheckpointError(f"{shards.file_name(base + '.qzeros')}, tensor {base + '.qzeros'!r}: "
                              "zero points other than 8 (asymmetric GPTQ) are not supported",
                              tensor=base + ".qzeros")


def _resolve(shards: ShardSet, spec: CheckpointSpec) -> dict[str, Source]:
    """The sources of this checkpoint's files: the BERT prefix, a GPTQ file's lm_head."""
    prefix = ""
    if spec.cfg.family == "encoder" and shards.present("bert.embeddings.word_embeddings.weight"):
        prefix = "bert."  # saved from a task model
    srcs = sources(spec, prefix)
    if spec.gptq_group:
        head = srcs["lm_head"]
        if shards.present("lm_head.qweight"):
            srcs["lm_head"] = Source("lm_head", "gptq", head.shape)
        else:  # GPTQ files usually keep lm_head (or the tied embedding) in float
            name = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
            srcs["lm_head"] = Source(name, "int4", head.shape)
    return srcs


class Checkpoint:
    """An opened, fully validated checkpoint; `weights()` streams it. `close()` unmaps."""

    def __init__(self, directory: pathlib.Path, spec: CheckpointSpec, shards: ShardSet,
                 srcs: dict[str, Source], quantizer: RowQuantizer = HOST_QUANTIZER) -> None:
        self.directory, self.spec, self._shards, self._sources = directory, spec, shards, srcs
        self.quantizer = quantizer
        self._alloc: Callable[[str, tuple[int, ...], type], np.ndarray] = _new_array
        self.profile = LoadProfile()
        self._pool: ThreadPoolExecutor | None = None

    @property
    def cfg(self) -> ModelConfig:
        return self.spec.cfg

    @classmethod
    def open(cls, directory: pathlib.Path, max_context: int, weight_format: str = "int4",
             root: pathlib.Path | None = None, host_memory_limit: int | None = None,
             quantizer: RowQuantizer = HOST_QUANTIZER) -> Checkpoint:
        """`weight_format`: "int4" (quantized on load; the default) or "fp16" (kept as stored).
        `root`: the model root, the sandbox of every file read (by default the directory is its
        own). `host_memory_limit`: bytes of host memory the load may take (by default the
        machine's or its cgroup's, budget.host_memory_limit). `quantizer`: what converts the
        float linears to int4 (the host's by default; a device_quantizer.DeviceQuantizer
        writes the same bytes), and whose buffers every chunk is staged in."""
        directory = pathlib.Path(directory)
        if weight_format not in WEIGHT_FORMATS:
            raise InvalidArgument(f"weight_format {weight_format!r}: use 'int4' (the default) "
                                  "or 'fp16'")
        files = CheckpointFiles(directory, root)
        spec = read_spec(directory, max_context, files)
        if weight_format == "fp16" and spec.gptq_group:
            raise InvalidArgument(f"{directory.name} is a GPTQ checkpoint (already 4-bit): load "
                                  "it with weight_format 'int4'; 'fp16' serves float checkpoints")
        spec = dataclasses.replace(spec, cfg=dataclasses.replace(spec.cfg,
                                                                 weight_format=weight_format))
        shards = ShardSet(files)
        try:
            srcs = _resolve(shards, spec)
            for src in srcs.values():   # headers only: nothing is read but the GPTQ zeros
                (_check_gptq if src.kind == "gptq" else _check_float)(shards, spec, src)
            budget.check_host(spec.cfg, budget.host_bytes(spec.cfg, QUANT_THREADS, MAX_LOOKAHEAD,
                                                          CHUNK_ELEMS * quantizer.chunk_scale),
                               host_memory_limit)
        except BaseException:
            shards.close()
            raise
        return cls(directory, spec, shards, srcs, quantizer)

    def weights(self, fuse: bool = False) -> Iterator[tuple[str, np.ndarray]]:
        """(key, host array) in weight_names order: f16 tables, f32 vectors, int4 .q/.s pairs
        (or fp16 `.h` linears). A pipeline: while the caller takes tensor i, the following ones
        are read ahead (MADV_WILLNEED) and converted on QUANT_THREADS threads, in row chunks;
        `self.profile` says where the time went. `fuse` (a decoder's load): each layer's q/k/v
        and gate/up are converted straight into their rows of one fused tensor and yielded under
        its key once the last part is done (models.weights.Fusion; device_weight_names), where
        fuse_linears would copy the parts again."""
        self._shutdown()
        self.profile = LoadProfile()
        fusion = Fusion(self.cfg) if fuse and fuses(self.cfg) else None
        self._alloc = fusion.array if fusion is not None else _new_array
        pool = ThreadPoolExecutor(QUANT_THREADS, thread_name_prefix="checkpoint-load")
        self._pool = pool
        jobs = self._jobs()
        window: collections.deque[tuple[_Job, list[Future]]] = collections.deque()

        def top_up() -> None:
            """Submit jobs until QUEUED_PER_THREAD chunks a thread are pending or MAX_LOOKAHEAD
            tensors are in the window (one at least: MAX_LOOKAHEAD 0 converts one at a time)."""
            pending = sum(not f.done() for _, fs in window for f in fs)
            while not window or (pending < QUEUED_PER_THREAD * QUANT_THREADS
                                 and len(window) < MAX_LOOKAHEAD):
                job = next(jobs, None)
                if job is None:
                    return
                for name in job.reads:
                    self._shards.will_need(name)
                window.append((job, [pool.submit(t) for t in job.tasks]))
                pending += len(job.tasks)

        emitted: list[str] = []
        try:
            top_up()
            while window:
                job, futures = window.popleft()
                t0 = time.perf_counter()
                for f in futures:
                    f.result()   # re-raises a chunk's error (the finally below drains the rest)
                self.profile.wait_s += time.perf_counter() - t0
                top_up()
                for part in job.finish():
                    for key, host in fusion.done(*part) if fusion is not None else [part]:
                        emitted.append(key)
                        yield key, host
            if fusion is not None:
                fusion.close()
            names = device_weight_names(self.cfg) if fusion is not None else weight_names(self.cfg)
            assert sorted(emitted) == sorted(names), "loader and weight_names disagree"
        finally:
            self._shutdown()

    def _shutdown(self) -> None:
        """Cancel queued chunks and wait for running ones: none may outlive the mapping."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None

    def _jobs(self) -> Iterator[_Job]:
        """One job per source tensor, built lazily (its output is allocated when submitted)."""
        for key, src in self._sources.items():
            if src.kind == "table":
                yield self._table_job(key, src)
            elif src.kind == "vector":
                yield self._vector_job(key, src)
            elif self.cfg.weight_format == "fp16":   # GPTQ is refused at open
                yield self._f16_job(key + ".h", src.hf_name, src.shape)
            elif src.kind == "gptq":
                yield self._gptq_job(key, src.hf_name)
            else:
                yield self._quantize_job(key, src.hf_name, src.shape)
        cfg = self.cfg
        if cfg.rope_scaling is not None:
            table = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).astype(np.float32)
            yield _Job([], lambda: [("rope.inv_freq", table)], [])

    def _chunk_tasks(self, hf_name: str, rows: int,
                     convert: Callable[[np.ndarray, str, slice], None]) -> list[Callable[[], None]]:
        """Tasks that stage rows of `hf_name` out of the map and `convert(staged, dtype, rows)`."""
        view, dtype = self._shards.stored(hf_name)
        cols = int(np.prod(view.shape[1:], dtype=np.int64))
        profile = self.profile

        def task(rows: slice) -> None:
            t0 = time.perf_counter()
            staged = _staged(view[rows], self.quantizer)
            t1 = time.perf_counter()
            convert(staged, dtype, rows)
            profile.add(t1 - t0, time.perf_counter() - t1, staged.nbytes)
        return [functools.partial(task, c)
                for c in _row_chunks(rows, cols, self.quantizer.chunk_scale)]

    def _table_job(self, key: str, src: Source) -> _Job:
        """An embedding table in fp16 (BERT: plus token type 0's row)."""
        out = np.empty((src.shape[0], *self._shards.shape(src.hf_name)[1:]), np.float16)
        row0 = self._shards.float32(src.plus_row0, slice(0, 1)) if src.plus_row0 else None

        def convert(raw: np.ndarray, dtype: str, rows: slice) -> None:
            table = to_float32(raw, dtype)
            out[rows] = table if row0 is None else table + row0
        return _Job(self._chunk_tasks(src.hf_name, src.shape[0], convert), lambda: [(key, out)],
                    [src.hf_name])

    def _vector_job(self, key: str, src: Source) -> _Job:
        held: list[np.ndarray] = []
        return _Job([lambda: held.append(self._shards.float32(src.hf_name))],
                    lambda: [(key, held[0])], [])

    def _f16_job(self, key: str, hf_name: str, shape: tuple[int, ...]) -> _Job:
        """The linear as stored, cast to fp16 row chunk by row chunk (bf16 -> fp16 is exact for
        every value in fp16's normal range; f32 rounds to nearest)."""
        out = self._alloc(key, shape, np.float16)

        def convert(raw: np.ndarray, dtype: str, rows: slice) -> None:
            values = to_float32(raw, dtype)
            if not (np.abs(values) <= F16_MAX).all():   # also catches inf and NaN
                raise CheckpointError(f"{self._shards.file_name(hf_name)}, tensor {hf_name!r}: "
                                      "values beyond fp16's range (|x| > 65504, inf or NaN): "
                                      "load it with weight_format 'int4'", tensor=hf_name)
            out[rows] = values
        return _Job(self._chunk_tasks(hf_name, shape[0], convert), lambda: [(key, out)], [hf_name])

    def _quantize_job(self, key: str, hf_name: str, shape: tuple[int, ...]) -> _Job:
        out_dim, in_dim = shape
        packed = self._alloc(key + ".q", (out_dim, in_dim // 2), np.uint8)
        scales = self._alloc(key + ".s", (out_dim, in_dim // QUANT_BLOCK), np.float16)

        def convert(raw: np.ndarray, dtype: str, rows: slice) -> None:
            self.quantizer(raw, dtype, packed[rows], scales[rows])
        return _Job(self._chunk_tasks(hf_name, out_dim, convert),
                    lambda: [(key + ".q", packed), (key + ".s", scales)], [hf_name])

    def _gptq_job(self, key: str, hf_name: str) -> _Job:
        held: list[tuple[np.ndarray, np.ndarray]] = []

        def task() -> None:
            held.append(gptq.to_blocks(self._shards.raw(hf_name + ".qweight"),
                                       self._shards.raw(hf_name + ".scales"), self.spec.gptq_group))
        return _Job([task], lambda: [(key + ".q", held[0][0]), (key + ".s", held[0][1])], [])

    def host_weights(self) -> dict[str, np.ndarray]:
        """Every weight in host memory (tests and the NumPy reference; small models only)."""
        return dict(self.weights())

    def close(self) -> None:
        self._shutdown()   # a weights() pass left suspended (its consumer failed) stops first
        self._shards.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
