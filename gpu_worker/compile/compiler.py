"""KernelCompiler: CUDA C source to a loaded module through four tiers, none of them load-bearing.

Hazard: lazily compiling kernels on the first decode step stalls every process start by ~80 ms per
module (NVRTC) plus a PTX JIT at load (~100 ms per module on an H200). The tiers remove the stall,
but a tier that fails or serves wrong bytes must never take the worker down or run foreign code.

Contract:
- `compile(src)` looks in the in-process memo, then the local disk cache, then the shared cache
  service (`remote`, a cache_service.client.KernelCacheClient: short deadline, circuit breaker,
  digest verified, never raises), then compiles with NVRTC. A miss, a timeout, an unreachable
  service, a corrupt file or an artifact whose metadata does not match falls through to the next
  tier; after a compile both artifacts go to the disk and (fire-and-forget) to the service; a
  remote hit is written to the disk so the next process start is local.
- Across hosts, a key that misses every tier is claimed at the service before NVRTC runs
  (`single_flight.SingleFlight`): the holder compiles and its Store ends the claim; other hosts
  wait for that Store (bounded by `claim.wait_s`), take over a claim that expired, and compile
  locally whenever the service cannot answer.
- Concurrent `compile`s of one key in one process run NVRTC once: the first caller is the leader
  and the others wait on its future (and get its exception if it fails; the next call retries).
- `load(device, src)` loads the CUBIN when the device's arch is the compiler's, else the PTX. A
  load failure (PTX ISA newer than the driver, a damaged image) is counted and falls back to the
  other artifact, then to a fresh NVRTC compile for the device's own arch that bypasses every tier.
- `prefetch(sources)` fetches a model's whole kernel set from the service in one BatchLookup: the
  CUBINs only (what loads on this arch, ~60 % of the bytes); their disk writes happen on a
  background thread. A module fetched so has `ptx == b""` until `load()` needs the PTX (arch
  mismatch or a CUBIN that fails to load), which it then takes from disk, the service or NVRTC.

Cost: a memo hit is a dict lookup; a key is one SHA-256 over the source (memoized per source).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import pathlib
import threading
from collections import Counter
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from gpu_worker.compile.key import artifact_key
from gpu_worker.compile.local_cache import LocalKernelCache, default_cache_dir, default_max_bytes
from gpu_worker.compile.nvrtc import NvrtcOutput, compile_program, nvrtc_version, validate_arch
from gpu_worker.compile.single_flight import CLAIMED, ClaimPolicy, Fetched, SingleFlight
from gpu_worker.compile.source import KernelSource
from services.common.errors import FailedPrecondition, InvalidArgument

log = logging.getLogger(__name__)

TIERS = ("memo", "local", "remote", "compiled")
_ELF_MAGIC = b"\x7fELF"


@dataclass(frozen=True)
class CompiledModule:
    module_name: str
    key_cubin: str
    key_ptx: str
    cubin: bytes
    ptx: bytes  # NUL-terminated PTX text
    source_tier: str  # where this call got it: "memo" | "local" | "remote" | "compiled"
    compile_seconds: float = 0.0  # NVRTC wall time when source_tier == "compiled", else 0


def _plausible(kind: str, data: bytes) -> bool:
    """A structural check on top of the digest: PTX is NUL-terminated text, a CUBIN an ELF."""
    if kind == "cubin":
        return data.startswith(_ELF_MAGIC)
    return data.endswith(b"\0") and b".version" in data[:4096]


class KernelCompiler:
    """NVRTC with a memo, a local disk tier and the shared cache service; see the module doc."""

    def __init__(
        self,
        arch: str,
        cache_dir: pathlib.Path | None = None,
        remote: Any | None = None,
        max_local_bytes: int | None = None,
        namespace: str = "",
        tracer_provider: Any = None,
        claim: ClaimPolicy | None = None,
    ) -> None:
        """`max_local_bytes` None: GPUPLANE_KERNEL_CACHE_MAX_BYTES, else 256 MiB (0 unbounded).
        `tracer_provider` None: the global one (spans only for work past the memo).
        `claim` None: ClaimPolicy.from_env() (GPUPLANE_KERNEL_CLAIM_TTL_S / _WAIT_S)."""
        self.arch = validate_arch(arch)
        self._tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
        self.nvrtc_version = nvrtc_version()
        self.namespace = namespace
        self.remote = remote
        self.single_flight = SingleFlight(remote, namespace, claim or ClaimPolicy.from_env())
        self.local = LocalKernelCache(
            pathlib.Path(cache_dir) if cache_dir is not None else default_cache_dir(),
            default_max_bytes() if max_local_bytes is None else max_local_bytes,
        )
        self._lock = threading.Lock()
        self._memo: dict[str, CompiledModule] = {}  # key_cubin -> module
        self._inflight: dict[str, Future[CompiledModule]] = {}  # key_cubin -> leader's future
        self._keys: dict[KernelSource, tuple[str, str]] = {}
        self._counts: dict[str, float] = {
            "compiled": 0,
            "compile_seconds": 0.0,
            "memo_hits": 0,
            "local_hits": 0,
            "remote_hits": 0,
            "remote_rejected": 0,
            "remote_raised": 0,
            "load_fallbacks": 0,
            "fresh_compiles": 0,
        }
        self._remote_base = self._remote_counts()
        # Prefetched artifacts reach the disk on this thread, off the model-load path: a cold
        # host's stall is the one BatchLookup, not the round trip plus the file writes. A write
        # lost at exit only means the next start asks the service again.
        self._disk_writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kernel-disk")
        self._disk_writes: list[Future] = []
        # CUBIN keys the last prefetch asked the service for and did not get: a cold host's
        # compiles then go straight to NVRTC instead of asking again, one round trip each.
        self._remote_missed: set[str] = set()

    # -- keys ------------------------------------------------------------------------------------
    def keys(self, src: KernelSource, arch: str | None = None) -> tuple[str, str]:
        """(key_cubin, key_ptx) of `src` for this compiler's arch (or `arch`)."""
        arch = arch or self.arch
        if arch == self.arch:
            with self._lock:
                cached = self._keys.get(src)
            if cached is not None:
                return cached
        fields = {
            "module_name": src.module_name,
            "source": src.source,
            "headers": src.headers,
            "arch": arch,
            "options": src.options,
            "nvrtc_version": self.nvrtc_version,
        }
        pair = (artifact_key(kind="cubin", **fields), artifact_key(kind="ptx", **fields))
        if arch == self.arch:
            with self._lock:
                self._keys[src] = pair
        return pair

    # -- compile ---------------------------------------------------------------------------------
    def compile(self, src: KernelSource) -> CompiledModule:
        """The module's PTX and CUBIN from the first tier that has both; compiles at most once."""
        key_cubin, key_ptx = self.keys(src)
        with self._lock:
            hit = self._memo.get(key_cubin)
            future = self._inflight.get(key_cubin) if hit is None else None
            leader = hit is None and future is None
            if hit is not None:
                self._counts["memo_hits"] += 1
            elif leader:
                future = Future()
                self._inflight[key_cubin] = future
        if hit is not None:
            return dataclasses.replace(hit, source_tier="memo")
        assert future is not None, "a caller that is not the leader must have the leader's future"
        if not leader:
            module = future.result()  # re-raises the leader's failure
            with self._lock:
                self._counts["memo_hits"] += 1
            return dataclasses.replace(module, source_tier="memo")
        try:
            with self._tracer.start_as_current_span("kernel.compile") as span:
                span.set_attribute("gpuplane.kernel.module", src.module_name)
                span.set_attribute("gpuplane.kernel.arch", self.arch)
                span.set_attribute("gpuplane.kernel.cache_key", key_cubin[:16])
                module = self._resolve(src, key_cubin, key_ptx)
                span.set_attribute("gpuplane.kernel.tier", module.source_tier)
        except BaseException as exc:
            with self._lock:
                del self._inflight[key_cubin]
            future.set_exception(exc)
            raise
        with self._lock:
            self._memo[key_cubin] = module
            del self._inflight[key_cubin]
        future.set_result(module)
        return module

    def _resolve(self, src: KernelSource, key_cubin: str, key_ptx: str) -> CompiledModule:
        wanted = {"cubin": key_cubin, "ptx": key_ptx}
        found: dict[str, bytes] = {}
        for kind, key in wanted.items():
            data = self.local.get(key)
            if data is not None and _plausible(kind, data):
                found[kind] = data
        tier = "local"
        with self._lock:
            just_missed = key_cubin in self._remote_missed
            self._remote_missed.discard(key_cubin)
        if "cubin" not in found and not just_missed:  # the CUBIN loads here; the PTX on demand
            fetched = self._fetch_remote(src, {"cubin": key_cubin})
            if fetched:  # kept on disk so the next process start is a local hit
                self.local.put_many({key_cubin: fetched["cubin"]})
            found.update(fetched)
            tier = "remote"
        claimed = False
        if "cubin" not in found and self.single_flight.enabled:
            got = self.single_flight.acquire(key_cubin)
            if isinstance(got, Fetched):  # another host compiled it while this one waited
                data = self._accept(src, "cubin", got.artifact, self.arch)
                if data is not None:
                    self.local.put_many({key_cubin: data})
                    found["cubin"], tier = data, "remote"
            claimed = got == CLAIMED
        if "cubin" in found:
            with self._lock:
                self._counts[f"{tier}_hits"] += 1
            return CompiledModule(
                src.module_name, key_cubin, key_ptx, found["cubin"], found.get("ptx", b""), tier
            )
        try:
            with self.single_flight.renewing(key_cubin) if claimed else contextlib.nullcontext():
                out = self._nvrtc(src, self.arch)
        except BaseException:
            if claimed:  # so other hosts compile now instead of waiting out the TTL
                self.single_flight.release(key_cubin)
            raise
        self._publish(src, key_cubin, key_ptx, out)
        return CompiledModule(
            src.module_name, key_cubin, key_ptx, out.cubin, out.ptx, "compiled", out.seconds
        )

    def _nvrtc(self, src: KernelSource, arch: str) -> NvrtcOutput:
        out = compile_program(src.module_name, src.source, src.headers, arch, src.options)
        if out.log.strip():
            log.info("NVRTC warnings for %s (%s):\n%s", src.module_name, arch, out.log)
        with self._lock:
            self._counts["compiled"] += 1
            self._counts["compile_seconds"] += out.seconds
        return out

    # -- the shared tier ---------------------------------------------------------------------------
    def _accept(self, src: KernelSource, kind: str, artifact: Any, arch: str) -> bytes | None:
        """The artifact's bytes if it is what this key promises, else None (counted)."""
        ok = (
            artifact is not None
            and artifact.kind == kind
            and artifact.arch == arch
            and artifact.nvrtc_version == self.nvrtc_version
            and artifact.module_name == src.module_name
            and _plausible(kind, artifact.data)
        )
        if not ok and artifact is not None:
            log.warning(
                "shared cache returned a mismatched %s for %s; ignored", kind, src.module_name
            )
            with self._lock:
                self._counts["remote_rejected"] += 1
        return artifact.data if ok else None

    def _fetch_remote(self, src: KernelSource, missing: dict[str, str]) -> dict[str, bytes]:
        if self.remote is None:
            return {}
        try:
            got = self.remote.batch_lookup(list(missing.values()), self.namespace)
        except Exception:
            log.exception("kernel cache client raised; treating as a miss")
            with self._lock:
                self._counts["remote_raised"] += 1
            return {}
        fetched = {}
        for kind, key in missing.items():
            data = self._accept(src, kind, got.get(key), self.arch)
            if data is not None:
                fetched[kind] = data
        return fetched

    def _publish(self, src: KernelSource, key_cubin: str, key_ptx: str, out: NvrtcOutput) -> None:
        self.local.put_many({key_cubin: out.cubin, key_ptx: out.ptx})
        if self.remote is None:
            return
        from cache_service.artifact import Artifact  # the cache engineer's module; imported late

        for kind, key, data in (("cubin", key_cubin, out.cubin), ("ptx", key_ptx, out.ptx)):
            artifact = Artifact(
                data=data,
                kind=kind,
                arch=self.arch,
                nvrtc_version=self.nvrtc_version,
                module_name=src.module_name,
                compile_seconds=out.seconds,
            )
            try:
                self.remote.store(key, artifact, self.namespace)
            except Exception:
                log.exception("kernel cache store raised; ignored")
                with self._lock:
                    self._counts["remote_raised"] += 1

    def prefetch(self, sources: Iterable[KernelSource]) -> int:
        """Fetch every source missing from the memo and the disk in one BatchLookup.

        Returns how many modules came from the shared service (both artifacts accepted); those are
        written to the disk and the memo, so the compiles that follow are memo hits.
        """
        sources = list(sources)
        with self._tracer.start_as_current_span("kernel.prefetch") as span:
            span.set_attribute("gpuplane.kernel.modules", len(sources))
            fetched = self._prefetch(sources)
            span.set_attribute("gpuplane.kernel.fetched", fetched)
            return fetched

    def _prefetch(self, sources: list[KernelSource]) -> int:
        todo: dict[str, tuple[KernelSource, str]] = {}
        for src in sources:
            key_cubin, key_ptx = self.keys(src)
            with self._lock:
                if key_cubin in self._memo:
                    continue
            cubin = self.local.get(key_cubin)
            if cubin is not None and _plausible("cubin", cubin):
                ptx = self.local.get(key_ptx)
                ptx = ptx if ptx is not None and _plausible("ptx", ptx) else b""
                self._remember(
                    CompiledModule(src.module_name, key_cubin, key_ptx, cubin, ptx, "local")
                )
                continue
            todo[key_cubin] = (src, key_ptx)
        if not todo or self.remote is None:
            return 0
        # Only the CUBINs: they are what loads on this arch, and they are ~60 % of the bytes.
        # A PTX is fetched later, by load(), only if a CUBIN cannot be used.
        keys = list(todo)
        try:
            got = self.remote.batch_lookup(keys, self.namespace)
        except Exception:
            log.exception("kernel cache client raised during prefetch; treating as misses")
            with self._lock:
                self._counts["remote_raised"] += 1
            return 0
        writes: dict[str, bytes] = {}
        for key_cubin, (src, key_ptx) in todo.items():
            cubin = self._accept(src, "cubin", got.get(key_cubin), self.arch)
            if cubin is None:
                with self._lock:  # compile() need not ask the service again for this one
                    self._remote_missed.add(key_cubin)
                continue
            writes[key_cubin] = cubin
            self._remember(
                CompiledModule(src.module_name, key_cubin, key_ptx, cubin, b"", "remote")
            )
        if writes:  # so the next process start is a local hit
            with self._lock:
                self._disk_writes = [f for f in self._disk_writes if not f.done()]
                self._disk_writes.append(self._disk_writer.submit(self._write_local, writes))
        return len(writes)

    def _write_local(self, writes: dict[str, bytes]) -> None:
        try:
            self.local.put_many(writes)
        except Exception:  # the disk tier is never load-bearing
            log.exception("writing prefetched kernels to the local cache failed; ignored")

    def flush_local(self, timeout: float = 10.0) -> bool:
        """Wait until prefetched artifacts are on the local disk; False if `timeout` passed."""
        with self._lock:
            pending = list(self._disk_writes)
        _done, not_done = futures_wait(pending, timeout=timeout)
        return not not_done

    def _remember(self, module: CompiledModule) -> None:
        with self._lock:
            self._memo.setdefault(module.key_cubin, module)
            self._counts[f"{module.source_tier}_hits"] += 1

    # -- load ------------------------------------------------------------------------------------
    def load(self, device: Any, src: KernelSource, tiers: Counter[str] | None = None) -> Any:
        """Load `src` on `device` (a gpu_worker.device.Device); see the module doc for the order.

        `tiers`, when given, counts where this call got the module ("memo", "local", "remote" or
        "compiled"): what a model load reports as kernels compiled vs taken from a cache."""
        from gpu_worker.device.backend import DeviceError

        module = self.compile(src)
        if tiers is not None:
            tiers[module.source_tier] += 1
        device_arch = device.info.arch
        candidates = [("cubin", lambda: module.cubin)] if device_arch == self.arch else []
        candidates.append(("ptx", lambda: module.ptx or self._ptx_for(src, module)))
        for kind, image in candidates:
            try:
                return device.load_module(image())
            except DeviceError as exc:
                log.warning(
                    "loading the %s of %s on %s failed (%s); falling back",
                    kind,
                    src.module_name,
                    device_arch,
                    exc,
                )
                with self._lock:
                    self._counts["load_fallbacks"] += 1
        fresh = self._fresh_compile(src, device_arch)
        return device.load_module(fresh.cubin)

    def _ptx_for(self, src: KernelSource, module: CompiledModule) -> bytes:
        """The PTX of a module that was fetched CUBIN-only: disk, then the service, then NVRTC."""
        data = self.local.get(module.key_ptx)
        if data is None or not _plausible("ptx", data):
            data = self._fetch_remote(src, {"ptx": module.key_ptx}).get("ptx")
        if data is None:
            data = self._nvrtc(src, self.arch).ptx
        self.local.put_many({module.key_ptx: data})
        with self._lock:
            self._memo[module.key_cubin] = dataclasses.replace(module, ptx=data)
        return data

    def _fresh_compile(self, src: KernelSource, arch: str) -> CompiledModule:
        """NVRTC for `arch`, bypassing every tier; for this compiler's arch it replaces entries."""
        try:
            validate_arch(arch)
        except InvalidArgument:
            raise FailedPrecondition(
                f"module {src.module_name!r}: no artifact built for {self.arch} loads on this "
                f"{arch} device and NVRTC {self.nvrtc_version} cannot build for {arch}; use an "
                f"NVRTC that supports it",
                module_name=src.module_name,
                arch=arch,
            ) from None
        out = self._nvrtc(src, arch)
        with self._lock:
            self._counts["fresh_compiles"] += 1
        key_cubin, key_ptx = self.keys(src, arch)
        module = CompiledModule(
            src.module_name, key_cubin, key_ptx, out.cubin, out.ptx, "compiled", out.seconds
        )
        if arch == self.arch:
            # The cached images failed to load: overwrite them locally so the next start is clean.
            self.local.put_many({key_cubin: out.cubin, key_ptx: out.ptx})
            with self._lock:
                self._memo[key_cubin] = module
        return module

    # -- stats -----------------------------------------------------------------------------------
    def _remote_counts(self) -> dict[str, int]:
        if self.remote is None:
            return {}
        try:
            return dict(self.remote.stats())
        except Exception:  # noqa: BLE001 - stats are advisory
            return {}

    STATS_FIELDS = (
        "compiled",
        "compile_seconds",
        "memo_hits",
        "local_hits",
        "remote_hits",
        "remote_errors",
        "remote_timeouts",
        "load_fallbacks",
        *SingleFlight.FIELDS,
    )

    def stats(self) -> dict[str, int | float]:
        """Exactly the counters of interface (4) (worker.proto CompileStats field names)."""
        counts = self._counters()
        return {name: counts[name] for name in self.STATS_FIELDS}

    def detailed_stats(self) -> dict[str, int | float]:
        """stats() plus: remote_rejected (artifacts that failed the metadata/structure check),
        fresh_compiles (load fallbacks that ran NVRTC), memo_entries, and the disk tier's
        local_corrupt and local_bytes (a directory scan)."""
        counts = self._counters()
        local = self.local.stats()
        counts["local_corrupt"] = local["corrupt"]
        counts["local_bytes"] = local["bytes"]
        return counts

    def _counters(self) -> dict[str, int | float]:
        """remote_errors: the client's errors and corrupt replies since this compiler was built,
        plus rejected artifacts and calls that raised; remote_timeouts: the client's timeouts."""
        remote = self._remote_counts()

        def delta(name: str) -> int:
            return int(remote.get(name, 0)) - int(self._remote_base.get(name, 0))

        with self._lock:
            counts: dict[str, int | float] = {
                k: (v if k == "compile_seconds" else int(v)) for k, v in self._counts.items()
            }
            counts["memo_entries"] = len(self._memo)
        counts.update(self.single_flight.stats())
        counts["remote_errors"] = (
            delta("errors")
            + delta("corrupt")
            + counts["remote_rejected"]
            + counts.pop("remote_raised")
        )
        counts["remote_timeouts"] = delta("timeouts")
        return counts
