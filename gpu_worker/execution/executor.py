"""Runs a model's graphs on the device: weights in VMM slots, KV in the `kv` zone, per-node kernel
variants from the bounded kernel cache, per-shape plans with captured graphs from the plan LRU.

A plan's first run resolves every node's variant (compiling/loading through the KernelCompiler),
then captures the whole graph under the process-wide capture gate and replays it; later runs only
write the inputs, replay and read the outputs. Eager mode (`capture=False`) launches node by node,
for the eager-vs-graph benchmark and for debugging. A model whose weights exceed the weight budget
runs every plan as segments instead (gpu_worker/execution/streaming.py): one graph per segment,
its weights paged in ahead of it on the copy stream.

Weights go into slots by layer (gpu_worker/device/weights.py): the tensors of one `layers.N.`
layer share one slot (one contiguous range, one pinned host buffer, one copy per page-in), each
non-layer weight has a slot of its own. `add_weight` holds the current layer's host arrays (no
copy) until the layer is complete: the first weight of another layer, or the first use of the
weights (any method below that reads addresses or residency), seals it into its slot.
"""
from __future__ import annotations

import contextlib
import threading
from collections import Counter
from collections.abc import Callable, Hashable, Iterator

import numpy as np

from gpu_worker.execution.class_arena import ClassArenas
from gpu_worker.execution.kernel_cache import KernelCache, KernelVariant, VariantSpec
from gpu_worker.execution.layout import plan_layout
from gpu_worker.execution.ops import OPS, LaunchContext, device_weight, tile_bytes_for
from gpu_worker.execution.plans import PlanCache
from gpu_worker.execution.streaming import (
    StreamedRun,
    granule_cost,
    layer_of,
    plan_schedule,
    refuse_unstreamable,
    streaming_floor,
)
from gpu_worker.models.graph import Graph
from services.common.errors import InvalidArgument

NP_DTYPES = {"f32": np.float32, "f16": np.float16, "i32": np.int32, "u8": np.uint8}


class ShapePlan:
    """One (model, phase, batch, seq bucket): activation arena + resolved kernels + graph exec.

    A plan registers itself with the kernel cache as a holder of every variant its graph baked, so
    a variant eviction resets this plan's graph before the workspace is freed.
    """

    def __init__(self, executor: ModelExecutor, key: Hashable, graph: Graph) -> None:
        self.executor, self.key, self.graph = executor, key, graph
        self.layout = plan_layout(graph)
        device = executor.device
        # a class's shared arena (class_arena.py), else the plan's own
        shared = executor.arenas.acquire(key, self.layout.nbytes)
        self._shared_arena = shared is not None
        self.arena_alloc = shared if self._shared_arena else \
            device.arena.alloc(self.layout.nbytes, "activations", role="plan")
        self.activation_bytes = 0 if self._shared_arena else self.arena_alloc.size
        self.graph_exec: object | None = None
        self.whole_graph_bytes = 0
        self.steps: list[tuple[object, KernelVariant]] | None = None
        # Nodes from the first `select_row` on run eagerly after the replay: the row they read
        # (the prompt's last token inside a padded bucket) is only known per call.
        self.split = next((i for i, nd in enumerate(graph.nodes) if nd.op == "select_row"),
                          len(graph.nodes))
        self._alias: dict[str, int] = {}
        self.replays = 0
        self.streamed: StreamedRun | None = None   # the segments, while the model streams
        self._lock = threading.RLock()

    # -- pointers --------------------------------------------------------------------------------
    def ptr(self, name: str) -> int:
        if name in self._alias:
            return self._alias[name]
        spec = self.graph.tensors[name]
        if spec.kind in ("activation", "input"):
            return self.arena_alloc.ptr + self.layout.offsets[name]
        if spec.kind == "weight":
            return self.executor.weight_ptr(name)
        return self.executor.state_ptr(name)

    # -- running ---------------------------------------------------------------------------------
    def resolve(self, nodes=None) -> list[tuple[object, KernelVariant]]:
        steps = []
        for node in self.graph.nodes[:self.split] if nodes is None else nodes:
            key, shapes = self.executor.variant_key(node, self.graph)
            variant = self.executor.kernels.resolve(
                key, shapes, lambda node=node: self.executor.variant_spec(node, self.graph))
            steps.append((node, variant))
        return steps

    def launch_all(self, steps: list[tuple[object, KernelVariant]], stream: object) -> None:
        device, tile = self.executor.device, self.executor.tile
        for node, variant in steps:
            OPS[node.op].launch(LaunchContext(device, node, self.graph, variant, self.ptr, stream,
                                              tile, self.executor.weight_tiled))

    def _gemm_shapes(self, steps) -> frozenset:
        tile = self.executor.tile
        size = tile.size if tile is not None else 0
        return frozenset(s for node, _ in steps
                         for s in OPS[node.op].gemms(node, self.graph, size))

    def _launch_warm(self, steps, stream: object) -> None:
        """Launch `steps`; the first time a GEMM shape is seen, as the BLAS warm-up (eager,
        measured and booked: DESIGN 2.1 forbids what a first cuBLAS call does inside capture)."""
        shapes = self._gemm_shapes(steps)
        ran = bool(shapes) and self.executor.device.blas.warm(
            shapes, lambda: self.launch_all(steps, stream), stream)
        if not ran:
            self.launch_all(steps, stream)

    def execute(self, inputs: dict[str, np.ndarray], outputs: tuple[str, ...],
                capture: bool = True) -> dict[str, np.ndarray]:
        device = self.executor.device
        stream = device.stream
        with self._lock:
            self._write_inputs(inputs, stream)
            if self.executor.streams():   # the budget cannot hold every weight: segments
                self._streamed_run().run(inputs, stream, capture)
                self.replays += capture
            else:
                if not capture:
                    self._launch_warm(self.resolve(), stream)
                else:
                    if self.graph_exec is None:  # its graph memory may be refused: reclaim, retry
                        device.arena.retry_reclaiming("graphs", lambda: self._capture(stream))
                    device.replay(self.graph_exec, stream=stream)
                    self.replays += 1
                    self.executor.replay_count += 1
                self._run_tail(inputs, stream)
            out = {}
            for name in outputs:
                spec = self.graph.tensors[name]
                raw = device.from_device(self.ptr(name), spec.nbytes)
                out[name] = raw.view(NP_DTYPES[spec.dtype]).reshape(spec.shape).copy()
            return out

    def launch(self, inputs: dict[str, np.ndarray], capture: bool, take: Callable[[int], np.ndarray],
               after: Callable[[ShapePlan], None] | None = None) -> None:
        """Enqueue one run and return without waiting: the inputs go up from pinned staging
        (`take`, gpu_worker/execution/staging.py), the graph replays, `after(plan)` enqueues what
        reads the plan's outputs on the device (a copy of its sampled token) before another run
        can reuse the arena. Nothing is read back and nothing synchronizes."""
        device = self.executor.device
        stream = device.stream
        with self._lock:
            self._write_inputs(inputs, stream, take)
            if self.executor.streams():
                self._streamed_run().run(inputs, stream, capture)
                self.replays += capture
            elif not capture:
                self._launch_warm(self.resolve(), stream)
            else:
                if self.graph_exec is None:
                    device.arena.retry_reclaiming("graphs", lambda: self._capture(stream))
                device.replay(self.graph_exec, stream=stream)
                self.replays += 1
                self.executor.replay_count += 1
            self._run_tail(inputs, stream)
            if after is not None:
                after(self)

    def _write_inputs(self, inputs: dict[str, np.ndarray], stream: object,
                      take: Callable[[int], np.ndarray] | None = None) -> None:
        """One host-to-device copy for all inputs: the layout puts them first, contiguously, and
        each copy costs a stream synchronization (pageable source), once per decode step."""
        if take is None:
            staging = np.zeros(self.layout.inputs_bytes, np.uint8)
        else:   # pinned: the copy below is asynchronous; bytes between inputs stay as they were
            staging = take(self.layout.inputs_bytes)
        for name, host in inputs.items():
            spec = self.graph.tensors[name]
            assert spec.kind == "input", f"{name} is not an input of this graph"
            arr = np.ascontiguousarray(host, dtype=NP_DTYPES[spec.dtype]).reshape(-1).view(np.uint8)
            assert arr.nbytes == spec.nbytes, f"input {name}: {arr.nbytes} bytes, want {spec.nbytes}"
            off = self.layout.offsets[name]
            staging[off:off + arr.nbytes] = arr
        if not staging.nbytes:
            return
        if take is None:
            self.executor.device.to_device(self.arena_alloc.ptr, staging, stream=stream)
        else:
            self.executor.device.copy_to_device_async(self.arena_alloc.ptr, staging, stream=stream)

    def _run_tail(self, inputs: dict[str, np.ndarray], stream: object) -> None:
        tail = self.graph.nodes[self.split:]
        if not tail:
            return
        self._alias.clear()
        kernels = [nd for nd in tail if nd.op != "select_row"]
        for nd in tail:
            if nd.op == "select_row":
                src, index = nd.inputs
                row = int(np.asarray(inputs[index]).reshape(-1)[0])
                spec = self.graph.tensors[src]
                row_bytes = spec.nbytes // spec.shape[0]
                assert 0 <= row < spec.shape[0], f"select_row: row {row} outside {spec.shape}"
                self._alias[nd.outputs[0]] = self.ptr(src) + row * row_bytes
        self.launch_all(self.resolve(kernels), stream)

    @property
    def graph_bytes(self) -> int:
        """Captured graph memory: the whole graph's and, while streaming, the segments'."""
        return self.whole_graph_bytes + (self.streamed.graph_bytes if self.streamed else 0)

    def _streamed_run(self) -> StreamedRun:
        """The plan's segments for the current budget (re-cut when the budget changed)."""
        # None: the budget was lifted while a request that chose streaming runs; every weight
        # fits now, so the segments may hold them all.
        budget = self.executor.device.weights.budget_bytes or self.executor.all_weights_cost()
        if self.streamed is not None and self.streamed.schedule.budget != budget:
            self.executor.device.synchronize(self.executor.device.stream)
            self.streamed.close()
            self.streamed = None
        if self.streamed is None:
            schedule = plan_schedule(self.graph.nodes, self.split, self.executor.weight_cost,
                                     budget, what=f"plan {self.key}",
                                     source=self.executor.device.weights.budget_source)
            self.streamed = StreamedRun(self, schedule)
        return self.streamed

    def _capture(self, stream: object) -> None:
        steps = self.resolve()
        self.graph_exec, self.whole_graph_bytes, _ = self.capture_steps(steps, stream)
        self.steps = steps

    def capture_steps(self, steps: list[tuple[object, KernelVariant]],
                      stream: object) -> tuple[object, int, bool]:
        """Capture `steps` (resolved: resolving may evict variants and reset graphs) into a graph
        exec; returns it, its measured bytes (booked in `graphs` by the device) and whether the
        BLAS warm-up launched the steps eagerly first. The plan holds every variant it baked."""
        device = self.executor.device
        # Every GEMM shape runs once eagerly before any capture records it; the eager run writes
        # what the replay below writes again (no node reads what a later node of the graph wrote
        # in a previous run), so it changes no result.
        shapes = self._gemm_shapes(steps)
        warmed = bool(shapes) and not all(device.blas.is_warm(s) for s in shapes)
        if warmed:
            # ...except state a graph updates in place (the decode slots' tokens: the embedding
            # reads them, the sampler overwrites them): saved before the eager run, put back
            # after it, so the replay reads what the eager run read
            saved = [(self.ptr(n), device.from_device(self.ptr(n), self.graph.tensors[n].nbytes))
                     for n in self._inplace_state(steps)]
            self._launch_warm(steps, stream)
            for ptr_, data in saved:
                device.to_device(ptr_, data, stream=stream)
        with device.capture(stream=stream) as cap:
            self.launch_all(steps, stream)
        for _, variant in steps:
            self.executor.kernels.hold(variant, self)
        return cap.graph_exec, int(cap.graph_bytes), warmed

    def _inplace_state(self, steps) -> list[str]:
        """State tensors that a node of `steps` reads before any node has written them and a later
        node then writes (the decode slots' tokens). Not the KV pool: each layer appends its rows
        before its attention reads them, so its first access is a write, and running twice writes
        the same bytes. (Counting every read made the pool in place: saving it read the pool's
        whole reserved range, most of it unmapped, and faulted.)"""
        read_first, written, out = set(), set(), []
        for node, _ in steps:
            for name in node.inputs:
                if self.graph.tensors[name].kind == "state" and name not in written:
                    read_first.add(name)
            for name in node.outputs:
                if self.graph.tensors[name].kind != "state":
                    continue
                if name in read_first and name not in out:
                    out.append(name)
                written.add(name)
        return out

    def reset_graph(self) -> None:
        """Destroy the graph exec (it bakes workspace and activation pointers); rebuilt on demand."""
        with self._lock:
            if self.graph_exec is None and not (self.streamed and self.streamed.captured()):
                return
            device = self.executor.device
            # The graph may still be running on the stream; destroy it only once it finished.
            device.synchronize(device.stream)
            if self.graph_exec is not None:
                device.destroy_graph_exec(self.graph_exec)    # also unbooks its `graphs` bytes
            if self.streamed is not None:
                self.streamed.reset_graphs()
            self.graph_exec, self.whole_graph_bytes, self.steps = None, 0, None
            self.executor.kernels.forget_holder(self)

    def release(self) -> int:
        with self._lock:
            freed = self.graph_bytes + self.activation_bytes
            self.reset_graph()
            if self.streamed is not None:
                self.streamed.close()
                self.streamed = None
            if self.arena_alloc is not None and self._shared_arena:
                freed += self.executor.arenas.release(self.key)
            elif self.arena_alloc is not None:
                self.executor.device.arena.free(self.arena_alloc)
            self.arena_alloc = None
            self.activation_bytes = 0
            return freed


class ModelExecutor:
    """One loaded model on one device: its weights, state, kernel cache and plan cache.

    Not thread-safe by itself: the runtime serializes calls per model (one sequence at a time
    owns the KV cache).
    """

    def __init__(self, device, compiler, variants_per_node: int | None = None,
                 max_plans: int | None = None, max_plan_bytes: int | None = None,
                 weight_namespace: str = "", dequant_tile_bytes: int | None = None) -> None:
        self.device, self.compiler = device, compiler
        self.dequant_tile_bytes = dequant_tile_bytes   # None: ops.DEQUANT_TILE_BYTES
        # Weight slots are keyed per device; the namespace (the model id) keeps two models'
        # "embed" from colliding on one worker.
        self.weight_namespace = weight_namespace
        self.kernels = KernelCache(device.arena, variants_per_node, zero=self._zero)
        self.arenas = ClassArenas(device.arena)   # plan classes sharing one activation arena
        self.plans = PlanCache(max_plans, max_plan_bytes,
                               synchronize=lambda: device.synchronize(device.stream),
                               shared_bytes=self.arenas.bytes)
        self._weights: dict[str, tuple[int, int]] = {}   # key -> (address, bytes), load order
        self._tiled: set[str] = set()                 # keys stored in the 16-row tile layout
        self._slot_of: dict[str, str] = {}            # key -> its weight slot's name
        self._slot_names: list[str] = []              # the model's slots, load order
        # The layer being added: (layer, [(key, host)]), sealed into one slot when complete
        self._open: tuple[int, list[tuple[str, np.ndarray]]] | None = None
        self._all_weights_cost: int | None = None    # committed bytes of every weight resident
        self._state: dict[str, object] = {}          # name -> Allocation
        self._bound: dict[str, int] = {}             # name -> address owned elsewhere (KV pool)
        self._functions: dict[tuple[str, str], object] = {}
        self._modules: dict[object, object] = {}     # KernelSource -> loaded module
        self.module_tiers: Counter[str] = Counter()  # where each loaded module came from
        # The dequantization tile the tensor-core linears share (ops module note); allocated at
        # the first variant that needs it, outside capture, and fixed until trim/close (captured
        # graphs bake its address).
        self.tile: object | None = None
        self._blas_held = False   # acquire_blas() taken: any GEMM node (the tile is int4's only)
        self.replay_count = 0
        # The mode (streaming or whole) `resident()` chose, held while any of its contexts is
        # open: the budget may change meanwhile (the governor's cap, from its heartbeat thread),
        # and a request that pinned nothing must never replay a whole graph, nor one that pinned
        # every weight be cut into segments mid-request.
        self._mode_lock = threading.Lock()
        self._mode_holds = 0
        self._held_streaming = False

    # -- weights and state ------------------------------------------------------------------------
    def add_weight(self, key: str, host: np.ndarray) -> None:
        """Add one weight. A `layers.N.` weight joins N's slot, sealed when a weight of another
        layer arrives or the weights are first used: `host` must not change until then (it is
        copied into pinned memory once, at the seal)."""
        if key in self._weights or key in self._slot_of or \
                (self._open is not None and any(k == key for k, _ in self._open[1])):
            raise InvalidArgument(f"weight {key!r} was added twice")
        host, tiled = device_weight(key, host)
        if tiled:
            self._tiled.add(key)
        layer = layer_of(key)
        if self._open is not None and self._open[0] != layer:
            self._seal()
        if layer is None:
            self._add_slot(key, [(key, host)])
        elif self._open is None:
            self._open = (layer, [(key, host)])
        else:
            self._open[1].append((key, host))
        self._all_weights_cost = None

    def _seal(self) -> None:
        """Put the open layer's weights into their slot (no-op when none is open)."""
        if self._open is None:
            return
        layer, items = self._open
        self._open = None
        self._add_slot(f"layers.{layer}", items)

    def _add_slot(self, name: str, items: list[tuple[str, np.ndarray]]) -> None:
        ns = self.weight_namespace
        # Evictable: every request runs inside `resident()`, which pins the slots and pages back
        # in whatever an idle spell lost, so only an idle model's pages are ever taken.
        slots = self.device.weights
        slot = slots.add_group(ns + name, [(ns + k, host) for k, host in items])
        self._slot_names.append(slot.key)
        for k, _ in items:
            self._weights[k] = slots.tensor(ns + k)
            self._slot_of[k] = slot.key
        self._all_weights_cost = None

    def weight_ptr(self, key: str) -> int:
        self._seal()
        return int(self._weights[key][0])

    def weight_tiled(self, key: str) -> bool:
        """Whether weight `key` is stored in the 16-row tile layout (ops.device_weight)."""
        return key in self._tiled

    def weight_keys(self) -> list[str]:
        self._seal()
        return list(self._weights)

    def _slot_keys(self) -> list[str]:
        """The names of this model's weight slots (one per layer, one per non-layer weight)."""
        self._seal()
        return list(self._slot_names)

    def slot_keys(self, keys: list[str]) -> list[str]:
        """The slots that graph weight keys live in, once each, in first-seen order."""
        self._seal()
        return list(dict.fromkeys(self._slot_of[k] for k in keys))

    def weight_cost(self, keys) -> int:
        """Committed bytes the slots of `keys` occupy when resident (a slot pages in whole:
        whole granules of every slot they touch, granules shared by neighbours once)."""
        arena, slots = self.device.arena, self.device.weights
        spans = ((int(s.va), int(s.nbytes)) for s in map(slots.get, self.slot_keys(list(keys))))
        return granule_cost(spans, arena.base, arena.granule)

    def streams(self) -> bool:
        """Whether this model's weights exceed the effective weight budget (the least of
        --weight-budget-bytes and the governor's weights zone cap): its plans then run as segments
        (gpu_worker/execution/streaming.py) and a request pins only the segments in flight. While
        a `resident()` context is open, the mode it chose."""
        with self._mode_lock:
            if self._mode_holds:
                return self._held_streaming
        return self._over_budget()

    def all_weights_cost(self) -> int:
        """Committed bytes of every weight of the model resident at once."""
        self._seal()
        if self._all_weights_cost is None:   # addresses are stable: computed once per load
            self._all_weights_cost = self.weight_cost(self._weights)
        return self._all_weights_cost

    def _over_budget(self) -> bool:
        budget = self.device.weights.budget_bytes
        return budget is not None and self.all_weights_cost() > budget

    def ensure_resident(self) -> None:
        """Page every weight in (load); a streaming model pages in nothing here, and is refused
        (ResourceExhausted) when even two neighbouring one-layer segments cannot fit."""
        self._seal()
        if self.streams():
            weights = self.device.weights
            refuse_unstreamable(f"model {self.weight_namespace.rstrip('/')!r}",
                                streaming_floor(list(self._weights), self.weight_cost),
                                weights.budget_bytes, weights.budget_source)
            return
        self.device.weights.ensure_resident(self._slot_keys(), stream=self.device.stream)

    @contextlib.contextmanager
    def resident(self) -> Iterator[None]:
        """Pin this model's weights and page in what is missing (a wake), for one request: no
        other page-in may evict them while its kernels launch on them. A streaming model pins
        nothing here: each run pins and pages in only the segments in flight. The mode chosen
        here holds until the context ends, whatever the budget does meanwhile."""
        self._seal()
        with self._mode_lock:
            if not self._mode_holds:
                self._held_streaming = self._over_budget()
            self._mode_holds += 1
            streaming = self._held_streaming
        try:
            if streaming:
                yield
                return
            keys = self._slot_keys()
            self.device.weights.pin(keys)
            try:
                self.device.weights.ensure_resident(keys, stream=self.device.stream)
                yield
            finally:
                self.device.weights.unpin(keys)
                self.device.weights.trim()  # the budget shrank while they were pinned
        finally:
            with self._mode_lock:
                self._mode_holds -= 1

    def page_out(self) -> int:
        """Evict every weight slot (the pinned host copies stay); returns the bytes paged out.
        The caller holds the model's request lock (no kernel of ours is being launched)."""
        return self.device.weights.page_out(self._slot_keys())

    def resident_bytes(self) -> int:
        return self.device.weights.resident_bytes(self._slot_keys())

    def add_state(self, name: str, nbytes: int, zone: str) -> None:
        self._state[name] = self.device.arena.alloc(nbytes, zone, role=zone)

    def has_state(self, name: str) -> bool:
        return name in self._state

    def drop_state(self, name: str) -> int:
        """Free a state tensor made by `add_state` (after a sync of the model's stream): only once
        no plan that baked its address is left. Returns the bytes released."""
        alloc = self._state.pop(name)
        self.device.synchronize(self.device.stream)
        self.device.arena.free(alloc)
        return alloc.size

    def bind_state(self, name: str, ptr: int) -> None:
        """A state tensor whose memory another owner holds at a fixed address (the paged KV
        pool, gpu_worker/engines/scheduler/kv_pool.py): graphs bake it, so it must never move."""
        self._bound[name] = int(ptr)

    def state_ptr(self, name: str) -> int:
        if name in self._bound:
            return self._bound[name]
        return int(self._state[name].ptr)

    # -- kernels ---------------------------------------------------------------------------------
    def function(self, kdef) -> object:
        """The loaded function of a library KernelDef (module compiled/loaded once per source)."""
        fkey = (kdef.source.module_name, kdef.entry)
        fn = self._functions.get(fkey)
        if fn is None:
            module = self._modules.get(kdef.source)
            if module is None:
                module = self.compiler.load(self.device, kdef.source, self.module_tiers)
                self._modules[kdef.source] = module
            fn = self.device.get_function(module, kdef.entry)
            self._functions[fkey] = fn
        return fn

    def _ensure_tile(self) -> None:
        """The device's BLAS and, for int4 weights, the dequantization tile, held until
        trim/close. A model of fp16 weights (linear_f16 only) takes no tile."""
        if self._blas_held:
            return
        # an int4 weight is (n, 16 * ceil(k/32)) packed bytes: its fp16 rows take 4x that
        self._seal()
        nbytes = tile_bytes_for([4 * int(n) for key, (_, n) in self._weights.items()
                                 if key.endswith(".q")], self.dequant_tile_bytes)
        self.device.acquire_blas()
        try:
            if nbytes:
                self.tile = self.device.arena.alloc(nbytes, "workspace", role="workspace")
        except BaseException:
            self.device.release_blas()
            raise
        self._blas_held = True

    def _free_tile(self) -> int:
        if not self._blas_held:
            return 0
        freed = 0
        if self.tile is not None:
            freed = self.tile.size
            self.device.arena.free(self.tile)   # fenced by the arena's deferred release
            self.tile = None
        self._blas_held = False
        self.device.release_blas()
        return freed

    def shared_workspace_bytes(self) -> int:
        """Workspace bytes outside the kernel cache: the dequantization tile (the device's
        BLAS workspace is the device's: Device.blas.stats())."""
        return self.tile.size if self.tile is not None else 0

    def _zero(self, ptr: int, nbytes: int) -> None:
        """A new workspace zeroed before any plan uses it (outside capture: resolved first)."""
        self.device.memset(ptr, 0, nbytes)
        self.device.synchronize()

    def variant_key(self, node, graph: Graph) -> tuple[Hashable, tuple]:
        """(key, shapes) of `node` in the kernel cache: its name and input shapes, or for an op
        with workspaces ("scratch", op) and the shapes with the workspace sizes, so every node
        of the op (a model's layers) shares one variant and one scratch per shape, all under one
        bound: a plan's nodes run one after another on one stream, and a kernel launched with
        dependent launch waits for the one before it before it touches memory."""
        shapes = graph.shapes_of(node.inputs)
        sizes = OPS[node.op].workspace(node, graph)
        if not sizes:
            return node.name, shapes
        return ("scratch", node.op), (shapes, tuple(sorted(sizes.items())))

    def variant_spec(self, node, graph: Graph) -> VariantSpec:
        binding = OPS[node.op]
        if binding.gemms(node, graph, 1 << 62):
            self._ensure_tile()
        arch = self.device.info.arch
        return VariantSpec(function={k.name: self.function(k) for k in binding.kernels
                                     if k.loads_on(arch)},
                           workspace_bytes=binding.workspace(node, graph))

    # -- running ---------------------------------------------------------------------------------
    def run(self, key: Hashable, build_graph: Callable[[], Graph], inputs: dict[str, np.ndarray],
            outputs: tuple[str, ...], capture: bool = True) -> dict[str, np.ndarray]:
        return self.plans.run(key, lambda: ShapePlan(self, key, build_graph()),
                              lambda plan: plan.execute(inputs, outputs, capture))

    def launch(self, key: Hashable, build_graph: Callable[[], Graph], inputs: dict[str, np.ndarray],
               take: Callable[[int], np.ndarray], capture: bool = True,
               after: Callable[[ShapePlan], None] | None = None) -> None:
        """`run` without the readback: ShapePlan.launch on the plan for `key`."""
        self.plans.run(key, lambda: ShapePlan(self, key, build_graph()),
                       lambda plan: plan.launch(inputs, capture, take, after))

    def replays(self) -> int:
        """Graph replays since load."""
        return self.replay_count

    def trim(self) -> int:
        """Drop every plan and kernel variant (they rebuild on demand); returns bytes released."""
        freed = self.plans.evict_all()
        freed += self.kernels.clear()
        freed += self._free_tile()
        return freed

    def close(self) -> int:
        """Release everything the model holds; returns the bytes released."""
        freed = self.trim()
        self.device.synchronize(self.device.stream)
        for alloc in self._state.values():
            freed += alloc.size
            self.device.arena.free(alloc)
        self._state.clear()
        self._open = None   # a layer never sealed holds no device or pinned memory
        for name in self._slot_names:
            freed += int(self.device.weights.get(name).nbytes)
            self.device.weights.remove(name)
        self._weights.clear()
        self._tiled.clear()
        self._slot_of.clear()
        self._slot_names.clear()
        self._all_weights_cost = None
        for module in self._modules.values():
            unload = getattr(self.device, "unload_module", None)
            if unload is not None:
                unload(module)
        self._modules.clear()
        self._functions.clear()
        return freed
