"""Checkpoint load time against the time to read its files and copy them to the device (issue 15).

Writes a bf16 safetensors checkpoint with Llama-3-8B's shapes (random weights; `--layers` and
`--vocab` shrink it), then, alternating, `--rounds` times in one run:
  floor      the same bytes with the same parallelism and no conversion: every stored byte of
             every file copied out of its mmap by QUANT_THREADS threads in the loader's row
             chunks, while the main thread places exactly the arrays the loader produced (their
             keys, shapes and dtypes, from the first load) into weight slots (add_weight +
             ensure_resident), its keys suffixed so that no conversion happens there either
             (the load's int4 weights are permuted into the device's tile layout as they are
             added: execution/ops.device_weight);
  load       our loader, as the worker runs it: the same files through
             `fuse_linears(cfg, Checkpoint.weights(fuse=True))` (q/k/v and gate/up converted
             straight into one tensor each) into the same kind of weight slots, bf16 -> int4 on the device (the worker's default: DeviceQuantizer,
             the stored bytes staged in pinned memory, quantized by a kernel, int4 back) and,
             as a figure beside it, on the host (`--checkpoint-quantizer host`).
Both sides go through one device and one weight store; the statistic is the best round of each.
The load rate is also printed against the files' size (GB of files per second).
Each round also prints where each side's time went: the main thread's read / wait / pinned
(add_weight) / h2d (ensure_resident) seconds, and the loader threads' read and convert seconds.
Target: load (device quantizer) <= 1.5 x floor; a miss prints MISSED and exits 1. The files are read from the
page cache on both sides (the first round warms it; caches are not dropped on a shared machine).

    python bench/checkpoint_load_bench.py --backend cuda                    # 8B: 16 GB of files
    python bench/checkpoint_load_bench.py --backend sim --layers 1 --vocab 32000
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pathlib
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.record import add_record_flag
from bench.targets import Targets
from gpu_worker.checkpoints import Checkpoint, SafetensorsFile
from gpu_worker.checkpoints.device_quantizer import DeviceQuantizer
from gpu_worker.checkpoints.loader import QUANT_THREADS, _row_chunks
from gpu_worker.checkpoints.quantize import HOST_QUANTIZER, quantize_rows
from gpu_worker.checkpoints.shards import INDEX
from gpu_worker.device import open_device
from gpu_worker.execution.executor import ModelExecutor
from gpu_worker.models.weights import fuse_linears

TARGET = 1.5
QUANTIZERS = ("device", "host")   # the worker's default first (--checkpoint-quantizer)
FLOOR_SUFFIX = ".floor"   # no weight key of a model ends so: the floor's arrays stay as they are
GB = 1e9


def _bf16(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    """Random bf16 bits: random sign and 7-bit mantissa, exponent within 16x below `scale`
    (the quantizer's cost does not depend on the values; random 16-bit integers are ~10x faster
    to draw than normals, which made writing 16 GB take two minutes of device time)."""
    top = int(np.floor(np.log2(scale))) + 127   # biased exponent of the largest magnitude
    r = rng.integers(0, 1 << 16, size=shape, dtype=np.uint16)
    exponent = (top - ((r >> 7) & 3)).astype(np.uint16) << 7
    return ((r & 0x807F) | exponent).astype("<u2")


def write_checkpoint(root: pathlib.Path, layers: int, vocab: int) -> int:
    """An 8B-shaped Llama, one shard per layer; returns the bytes written."""
    h, ffn, heads, kv = 4096, 14336, 32, 8
    kvd = kv * h // heads
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "hidden_size": h, "intermediate_size": ffn,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
        "vocab_size": vocab, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": False, "eos_token_id": 1}))
    shards: dict[str, dict[str, tuple[tuple[int, ...], float]]] = {
        "embed": {"model.embed_tokens.weight": ((vocab, h), 1.0), "model.norm.weight": ((h,), 1.0),
                  "lm_head.weight": ((vocab, h), 0.02)}}
    for i in range(layers):
        p = f"model.layers.{i}."
        shards[f"layer{i}"] = {
            p + "input_layernorm.weight": ((h,), 1.0), p + "post_attention_layernorm.weight": ((h,), 1.0),
            p + "self_attn.q_proj.weight": ((h, h), 0.02), p + "self_attn.k_proj.weight": ((kvd, h), 0.02),
            p + "self_attn.v_proj.weight": ((kvd, h), 0.02), p + "self_attn.o_proj.weight": ((h, h), 0.02),
            p + "mlp.gate_proj.weight": ((ffn, h), 0.02), p + "mlp.up_proj.weight": ((ffn, h), 0.02),
            p + "mlp.down_proj.weight": ((h, ffn), 0.02)}
    weight_map: dict[str, str] = {}

    def write(index: int, shard: str) -> int:
        tensors, rng = shards[shard], np.random.default_rng([0, index])
        header, offset = {}, 0
        for name, (shape, _) in tensors.items():
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
            offset += n
            weight_map[name] = f"{shard}.safetensors"
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(root / f"{shard}.safetensors", "wb") as f:
            f.write(len(blob).to_bytes(8, "little") + blob)
            for shape, scale in tensors.values():
                _bf16(rng, shape, scale).tofile(f)
        return offset
    with ThreadPoolExecutor(8) as pool:   # NumPy's generators release the GIL: shards in parallel
        total = sum(pool.map(write, range(len(shards)), list(shards)))
    (root / INDEX).write_text(json.dumps({"weight_map": weight_map}))
    return total


@dataclasses.dataclass
class Breakdown:
    """Wall seconds of one side, by phase (the main thread's view), plus the loader's
    thread-seconds (read and convert overlap each other and the main thread)."""
    total: float = 0.0
    read: float = 0.0      # main thread: bytes out of the mmap (read+copy side only)
    wait: float = 0.0      # main thread: waiting for the loader's next tensor (load side only)
    pinned: float = 0.0    # add_weight: pinned host allocation + copy into it
    pin_alloc: float = 0.0  # of which the pinned allocations (cuMemHostAlloc)
    h2d: float = 0.0       # ensure_resident + synchronize: the page-in copies to the device
    thread_read: float = 0.0
    thread_convert: float = 0.0

    def line(self) -> str:
        parts = [f"{k} {getattr(self, k):.2f}" for k in ("read", "wait", "pinned", "h2d")
                 if getattr(self, k)]
        if self.pin_alloc:
            parts.insert(-1, f"(allocations {self.pin_alloc:.2f})")
        threads = (f"; loader threads ({QUANT_THREADS}): read {self.thread_read:.2f}, "
                   f"convert {self.thread_convert:.2f} thread-s"
                   if self.thread_read or self.thread_convert else "")
        return ", ".join(parts) + " s" + threads


@contextlib.contextmanager
def allocations_timed(device, b: Breakdown):
    """Adds the main thread's pinned allocations' seconds to b.pin_alloc (the weight store's;
    the device quantizer's lanes allocate on the loader's threads, not counted)."""
    backend, real = device.backend, device.backend.alloc_pinned
    main = threading.main_thread()

    def timed(nbytes: int):
        t0 = time.perf_counter()
        try:
            return real(nbytes)
        finally:
            if threading.current_thread() is main:
                b.pin_alloc += time.perf_counter() - t0
    backend.alloc_pinned = timed
    try:
        yield
    finally:
        del backend.alloc_pinned     # the class's method again


def _release(device, ex: ModelExecutor) -> None:
    """Free this side's slots now, untimed: their deferred releases (unmapping, unpinning GBs of
    host memory) would otherwise run inside the next side's timed region."""
    ex.close()
    device.synchronize()
    device.queue.drain()


def read_and_copy(device, compiler, root: pathlib.Path,
                  layout: list[tuple[str, tuple[int, ...], np.dtype]]) -> Breakdown:
    """The floor: the loader's file bytes read on its threads, its output bytes placed."""
    ex = ModelExecutor(device, compiler)
    b = Breakdown()
    scratch = threading.local()
    files = [SafetensorsFile(path) for path in sorted(root.glob("*.safetensors"))]
    start = time.perf_counter()
    try:
        def read(item) -> float:
            f, name, rows = item
            t0 = time.perf_counter()
            src = f.tensor(name)
            part = src[rows] if rows is not None else src
            buf = getattr(scratch, "buf", None)
            if buf is None or buf.nbytes < part.nbytes:
                buf = scratch.buf = np.empty(max(part.nbytes, 1 << 20), np.uint8)
            np.copyto(buf[:part.nbytes].view(part.dtype).reshape(part.shape), part)
            return time.perf_counter() - t0
        items = []
        for f in files:
            for name in f.names():
                shape = f.tensor(name).shape
                if len(shape) == 2:
                    items += [(f, name, r) for r in _row_chunks(shape[0], shape[1])]
                else:
                    items.append((f, name, None))
        with ThreadPoolExecutor(QUANT_THREADS) as pool, allocations_timed(device, b):
            reads = pool.map(read, items)
            biggest = max(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in layout)
            source = np.ones(biggest, np.uint8)
            for key, shape, dt in layout:
                t0 = time.perf_counter()
                n = int(np.prod(shape)) * np.dtype(dt).itemsize
                # the key suffixed: the floor's bytes are copied as they are, not permuted into
                # the int4 tile layout (execution/ops.device_weight) as the load's are
                ex.add_weight(key + FLOOR_SUFFIX, source[:n].view(dt).reshape(shape))
                b.pinned += time.perf_counter() - t0
            t0 = time.perf_counter()
            b.thread_read = sum(reads)
            b.wait = time.perf_counter() - t0     # the reads still running after the placing
    finally:
        for f in files:
            f.close()
    t0 = time.perf_counter()
    ex.ensure_resident()
    device.synchronize()
    b.h2d = time.perf_counter() - t0
    b.total = time.perf_counter() - start
    _release(device, ex)
    return b


def output_layout(root: pathlib.Path) -> list[tuple[str, tuple[int, ...], np.dtype]]:
    """(key, shape, dtype) of every array the loader produces, in its order."""
    with Checkpoint.open(root, 8192) as ckpt:
        return [(key, host.shape, host.dtype) for key, host in ckpt.weights(fuse=True)]


def load(device, compiler, root: pathlib.Path, quantizer: str) -> Breakdown:
    """Our loader into weight slots, quantizing on the device or the host (`quantizer`)."""
    ex = ModelExecutor(device, compiler)
    b = Breakdown()
    start = time.perf_counter()
    quantize = (DeviceQuantizer(device, compiler) if quantizer == "device"
                else contextlib.nullcontext(HOST_QUANTIZER))
    with quantize as q, Checkpoint.open(root, 8192, quantizer=q) as ckpt, \
            allocations_timed(device, b):
        # the worker's path (models/paged.py): q/k/v and gate/up fused as they convert
        for key, host in fuse_linears(ckpt.cfg, ckpt.weights(fuse=True)):
            t0 = time.perf_counter()
            ex.add_weight(key, host)
            b.pinned += time.perf_counter() - t0
        b.wait, b.thread_read, b.thread_convert = (ckpt.profile.wait_s, ckpt.profile.read_s,
                                                   ckpt.profile.convert_s)
    t0 = time.perf_counter()
    ex.ensure_resident()
    device.synchronize()
    b.h2d = time.perf_counter() - t0
    b.total = time.perf_counter() - start
    _release(device, ex)
    return b


def quantizer_scaling(threads: int) -> tuple[float, float]:
    """GB/s of bf16 that quantize_rows converts on one thread and on `threads` threads (a
    down_proj's shape, in the loader's row chunks): says whether the threads run in parallel
    or queue (on the GIL, on memory bandwidth)."""
    raw = _bf16(np.random.default_rng(1), (4096, 14336), 0.02)
    packed = np.empty((4096, 14336 // 2), np.uint8)
    scales = np.empty((4096, 14336 // 32), np.float16)
    chunks = _row_chunks(4096, 14336)

    def task(rows: slice) -> None:
        quantize_rows(raw[rows], "BF16", packed[rows], scales[rows])
    rates = []
    for n in (1, threads):
        with ThreadPoolExecutor(n) as pool:
            list(pool.map(task, chunks))   # warm: scratch buffers, page faults
            start = time.perf_counter()
            list(pool.map(task, chunks))
            rates.append(raw.nbytes / GB / (time.perf_counter() - start))
    return rates[0], rates[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="cuda", choices=["cuda", "sim"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="", help="where to write the checkpoint (default: a temp dir)")
    add_record_flag(p)
    args = p.parse_args()
    targets = Targets("checkpoint_load_bench", args=args)
    from gpu_worker.compile import KernelCompiler
    device = open_device(args.backend)
    compiler = KernelCompiler(device.info.arch)
    with tempfile.TemporaryDirectory(dir=args.dir or None) as tmp:
        root = pathlib.Path(tmp) / "llama-8b-shapes"
        root.mkdir()
        size = write_checkpoint(root, args.layers, args.vocab)
        print(f"checkpoint: {args.layers} layers, vocab {args.vocab}, {size / GB:.2f} GB of bf16 "
              f"({device.backend.name})", flush=True)
        one, many = quantizer_scaling(QUANT_THREADS)
        print(f"quantizer: {one:.2f} GB/s of bf16 on 1 thread, {many:.2f} GB/s on {QUANT_THREADS} "
              f"({many / one:.1f}x)", flush=True)
        # the host's state: the load converts on the CPU, the floor only copies, so the ratio
        # moves with what else the host runs (a figure to read the ratio by, not a target)
        targets.figure(f"quantizer on {QUANT_THREADS} loader threads (the host's CPU)", many,
                       "GB/s", peer=one)
        layout = output_layout(root)
        placed = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for _, shape, dt in layout)
        print(f"loader output: {len(layout)} arrays, {placed / GB:.2f} GB placed on the device; "
              f"the floor reads the same {size / GB:.2f} GB of files on {QUANT_THREADS} threads "
              f"and places the same {placed / GB:.2f} GB", flush=True)
        base: list[float] = []
        ours: dict[str, list[float]] = {kind: [] for kind in QUANTIZERS}
        for r in range(args.rounds):
            rc = read_and_copy(device, compiler, root, layout)
            base.append(rc.total)
            print(f"  round {r}: floor {rc.total:.2f} s ({size / GB / rc.total:.2f} GB/s of "
                  f"files): {rc.line()}", flush=True)
            for kind in QUANTIZERS:
                ld = load(device, compiler, root, kind)
                ours[kind].append(ld.total)
                print(f"    load, {kind} quantizer: {ld.total:.2f} s ({size / GB / ld.total:.2f} "
                      f"GB/s of files): {ld.line()}", flush=True)
    for kind in QUANTIZERS:
        best = min(ours[kind])
        print(f"load ({kind} quantizer) / floor = {best:.2f} s / {min(base):.2f} s = "
              f"{best / min(base):.2f}x; {size / GB / best:.2f} GB/s of files", flush=True)
    best = min(ours["device"])
    targets.figure("checkpoint load rate against the files' size", size / GB / best, "GB/s",
                   peer=size / GB / min(base))
    # the host's quantizer, same run: what the load costs where it converts on the CPU
    targets.figure("checkpoint load / floor, host quantizer (--checkpoint-quantizer host)",
                   min(ours["host"]) / min(base), "ratio")
    targets.check("checkpoint load / floor (same bytes, same threads)", best / min(base), "<=",
                  TARGET, unit="ratio")
    device.close()
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
