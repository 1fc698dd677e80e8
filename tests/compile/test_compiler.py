"""KernelCompiler: memo -> local disk -> shared service -> NVRTC; no tier load-bearing; one compile
per key."""

from __future__ import annotations

import dataclasses
import pathlib
import threading
import time

import pytest

from cache_service.artifact import Artifact
from gpu_worker.compile import CompiledModule, KernelCompiler, KernelSource, NvrtcError

ARCH = "sm_90"


def source(name: str = "axpy", body: str = "y[i] += a * x[i];") -> KernelSource:
    return KernelSource(
        module_name=name,
        source=f"""
#include "common.h"
extern "C" __global__ void {name}(float a, const float* x, float* y, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {{ {body} }}
}}
""",
        headers={"common.h": "#pragma once\n"},
        options=("--std=c++17",),
    )


class InTestRemote:
    """A dict with KernelCacheClient's methods (interface 1), for tier tests without a server.

    `damage` makes it serve what a broken or hostile service could: "bytes" (garbage with a valid
    digest, which the client cannot catch) or "metadata" (an artifact for another arch).
    """

    def __init__(self, damage: str | None = None, raises: bool = False) -> None:
        self.entries: dict[tuple[str, str], Artifact] = {}
        self.damage = damage
        self.raises = raises
        self.batch_calls = 0
        self.lookup_calls = 0

    def _serve(self, artifact: Artifact | None) -> Artifact | None:
        if artifact is None or self.damage is None:
            return artifact
        if self.damage == "bytes":
            return dataclasses.replace(artifact, data=b"\x00garbage" * 16)
        return dataclasses.replace(artifact, arch="sm_80")

    def lookup(self, key: str, namespace: str = "") -> Artifact | None:
        self.lookup_calls += 1
        if self.raises:
            raise RuntimeError("client bug")
        return self._serve(self.entries.get((namespace, key)))

    def batch_lookup(self, keys: list[str], namespace: str = "") -> dict[str, Artifact]:
        self.batch_calls += 1
        if self.raises:
            raise RuntimeError("client bug")
        found = {k: self._serve(self.entries.get((namespace, k))) for k in keys}
        return {k: a for k, a in found.items() if a is not None}

    def store(self, key: str, artifact: Artifact, namespace: str = "") -> None:
        if self.raises:
            raise RuntimeError("client bug")
        self.entries.setdefault((namespace, key), artifact)

    def flush(self, timeout: float = 5.0) -> bool:
        return True

    def stats(self) -> dict[str, int]:
        return {
            "hits": 0,
            "misses": 0,
            "errors": 0,
            "timeouts": 0,
            "corrupt": 0,
            "stores": 0,
            "breaker_open": 0,
        }

    def close(self) -> None:
        pass


def compiler(tmp_path: pathlib.Path, name: str = "local", **kwargs) -> KernelCompiler:
    return KernelCompiler(ARCH, cache_dir=tmp_path / name, **kwargs)


def test_a_cold_compile_runs_nvrtc_once_and_publishes_both_artifacts_to_both_tiers(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    c = compiler(tmp_path, remote=remote, namespace="ns")
    module = c.compile(source())
    assert isinstance(module, CompiledModule) and module.source_tier == "compiled"
    assert module.cubin[:4] == b"\x7fELF" and b".target sm_90" in module.ptx
    assert c.stats()["compiled"] == 1 and c.stats()["compile_seconds"] > 0
    assert c.local.get(module.key_cubin) == module.cubin, "the CUBIN was not written to disk"
    assert c.local.get(module.key_ptx) == module.ptx, "the PTX was not written to disk"
    stored = {key: a for (ns, key), a in remote.entries.items() if ns == "ns"}
    assert set(stored) == {module.key_cubin, module.key_ptx}, (
        "both artifacts must be stored remotely"
    )
    cubin = stored[module.key_cubin]
    assert (cubin.kind, cubin.arch, cubin.module_name, cubin.data) == (
        "cubin",
        ARCH,
        "axpy",
        module.cubin,
    )
    assert cubin.compile_seconds > 0, "the artifact must record what a hit saves (compile_seconds)"
    assert stored[module.key_ptx].kind == "ptx"


def test_a_second_compile_of_a_source_in_the_process_is_a_memo_hit(tmp_path: pathlib.Path) -> None:
    c = compiler(tmp_path)
    first = c.compile(source())
    again = c.compile(source())
    assert again.source_tier == "memo" and again.cubin == first.cubin
    stats = c.stats()
    assert (stats["compiled"], stats["memo_hits"]) == (1, 1), stats


def test_a_second_compiler_with_a_cold_memo_and_a_warm_local_dir_compiles_nothing(
    tmp_path: pathlib.Path,
) -> None:
    first = compiler(tmp_path).compile(source())
    c = compiler(tmp_path)
    module = c.compile(source())
    assert module.source_tier == "local" and module.cubin == first.cubin
    assert c.stats()["compiled"] == 0, "a warm local cache must mean no NVRTC compile"
    assert c.stats()["local_hits"] == 1


def test_a_compiler_with_only_the_remote_warm_compiles_nothing_and_warms_its_disk(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    first = compiler(tmp_path, "host_a", remote=remote).compile(source())
    c = compiler(tmp_path, "host_b", remote=remote)
    module = c.compile(source())
    assert module.source_tier == "remote" and module.cubin == first.cubin
    assert c.stats()["compiled"] == 0, "a warm shared cache must mean no NVRTC compile"
    assert c.stats()["remote_hits"] == 1
    offline = compiler(tmp_path, "host_b")  # same disk, no service: the remote hit was kept locally
    assert offline.compile(source()).source_tier == "local" and offline.stats()["compiled"] == 0


def test_prefetch_fetches_a_whole_kernel_set_in_one_batch_lookup(tmp_path: pathlib.Path) -> None:
    remote = InTestRemote()
    kernel_set = [source(f"k{i}", body=f"y[i] = {i}.0f * x[i];") for i in range(4)]
    warm = compiler(tmp_path, "host_a", remote=remote)
    for src in kernel_set:
        warm.compile(src)
    c = compiler(tmp_path, "host_b", remote=remote)
    remote.batch_calls = remote.lookup_calls = 0
    assert c.prefetch(kernel_set + kernel_set[:1]) == 4, "every module should come from the service"
    assert (remote.batch_calls, remote.lookup_calls) == (1, 0), "prefetch must be one BatchLookup"
    tiers = [c.compile(src).source_tier for src in kernel_set]
    assert tiers == ["memo"] * 4 and c.stats()["compiled"] == 0, tiers
    assert c.prefetch(kernel_set) == 0 and remote.batch_calls == 1, "memo hits must not call out"


def test_prefetched_kernels_reach_the_disk_off_the_load_path_so_a_restart_is_local(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    kernel_set = [source(f"k{i}", body=f"y[i] = {i}.0f + x[i];") for i in range(3)]
    warm = compiler(tmp_path, "host_a", remote=remote)
    for src in kernel_set:
        warm.compile(src)
    first = compiler(tmp_path, "host_b", remote=remote)
    assert first.prefetch(kernel_set) == 3
    assert first.flush_local(timeout=10.0), "prefetched artifacts never reached the disk"
    restarted = compiler(tmp_path, "host_b", remote=None)  # same disk, no service at all
    tiers = [restarted.compile(src).source_tier for src in kernel_set]
    assert tiers == ["local"] * 3, f"a restart after a prefetch must load from disk: {tiers}"


def test_eight_threads_compiling_one_key_run_nvrtc_once(tmp_path: pathlib.Path) -> None:
    c = compiler(tmp_path)
    barrier = threading.Barrier(8)
    results: list[CompiledModule] = []
    errors: list[BaseException] = []

    def work() -> None:
        try:
            barrier.wait()
            results.append(c.compile(source("racy")))
        except BaseException as exc:  # noqa: BLE001 - surfaced by the assert below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert c.stats()["compiled"] == 1, f"{c.stats()['compiled']} NVRTC compiles for one key"
    assert len({r.cubin for r in results}) == 1 and len(results) == 8
    assert sorted(r.source_tier for r in results).count("compiled") == 1


@pytest.mark.parametrize("damage", ["bytes", "metadata"])
def test_a_service_returning_corrupt_or_foreign_artifacts_is_a_miss_and_compiles(
    tmp_path: pathlib.Path,
    damage: str,
) -> None:
    remote = InTestRemote()
    compiler(tmp_path, "host_a", remote=remote).compile(source())
    remote.damage = damage
    c = compiler(tmp_path, "host_b", remote=remote)
    module = c.compile(source())
    assert module.source_tier == "compiled" and module.cubin[:4] == b"\x7fELF"
    stats = c.stats()
    # Only the CUBIN is asked for (the PTX comes on demand), so one rejected artifact.
    assert stats["remote_hits"] == 0 and stats["remote_errors"] == 1, stats
    assert c.prefetch([source("other")]) == 0


def test_a_service_that_lost_the_cubin_is_a_miss_and_the_compile_restores_it(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    first = compiler(tmp_path, "host_a", remote=remote).compile(source())
    del remote.entries[("", first.key_cubin)]  # e.g. evicted by the service's LRU
    c = compiler(tmp_path, "host_b", remote=remote)
    module = c.compile(source())
    assert module.source_tier == "compiled" and c.stats()["compiled"] == 1
    assert ("", first.key_cubin) in remote.entries, "the compile must restore the missing artifact"


def test_a_service_that_lost_only_the_ptx_still_serves_the_cubin_and_the_ptx_comes_on_demand(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    first = compiler(tmp_path, "host_a", remote=remote).compile(source())
    del remote.entries[("", first.key_ptx)]
    c = compiler(tmp_path, "host_b", remote=remote)
    module = c.compile(source())
    assert module.source_tier == "remote" and module.cubin == first.cubin
    assert module.ptx == b"" and c.stats()["compiled"] == 0, "the PTX must not be waited for"
    ptx = c._ptx_for(source(), module)  # what load() does when the CUBIN cannot be used
    assert ptx == first.ptx, "an on-demand PTX must be the same NVRTC output"
    assert c.compile(source()).ptx == first.ptx, "the on-demand PTX is remembered"


def test_a_client_that_raises_is_a_miss_and_compiles(tmp_path: pathlib.Path) -> None:
    c = compiler(tmp_path, remote=InTestRemote(raises=True))
    assert c.compile(source()).source_tier == "compiled"
    assert c.prefetch([source("other")]) == 0
    assert c.stats()["remote_errors"] >= 2, "raised lookups and stores must be counted"


def test_a_corrupt_local_file_is_a_miss_is_removed_and_is_rewritten(tmp_path: pathlib.Path) -> None:
    first = compiler(tmp_path).compile(source())
    path = compiler(tmp_path).local.path_for(first.key_cubin)
    blob = bytearray(path.read_bytes())
    blob[-10] ^= 0x55
    path.write_bytes(bytes(blob))
    c = compiler(tmp_path)
    module = c.compile(source())
    assert module.source_tier == "compiled" and module.cubin == first.cubin
    assert c.detailed_stats()["local_corrupt"] == 1, "the corrupt file was not detected"
    assert c.local.get(first.key_cubin) == first.cubin, "the compile must republish a good file"


def test_a_compile_error_reaches_the_caller_and_caches_nothing(tmp_path: pathlib.Path) -> None:
    remote = InTestRemote()
    c = compiler(tmp_path, remote=remote)
    bad = source("bad", body="y[i] = undefined_symbol;")
    for _ in range(2):  # the second call compiles again: a failure is not memoized
        with pytest.raises(NvrtcError, match="undefined_symbol") as info:
            c.compile(bad)
        assert "'bad'" in str(info.value), "the error must name the module"
    assert c.detailed_stats()["memo_entries"] == 0 and remote.entries == {}
    assert c.local.stats()["entries"] == 0


def test_the_local_budget_applies_to_the_compiler(tmp_path: pathlib.Path) -> None:
    c = compiler(tmp_path, max_local_bytes=6000)
    for i in range(3):
        c.compile(source(f"b{i}", body=f"y[i] = {i}.0f;"))
    assert c.local.stats()["bytes"] <= 6000, "the compiler must prune its disk tier to the budget"


def test_an_unknown_arch_is_refused_before_anything_is_created(tmp_path: pathlib.Path) -> None:
    from services.common.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="sm_90"):
        KernelCompiler("sm_1", cache_dir=tmp_path / "never")
    assert not (tmp_path / "never").exists()


def test_an_unreachable_service_falls_through_to_compiling_quickly(tmp_path: pathlib.Path) -> None:
    from cache_service.client import KernelCacheClient

    client = KernelCacheClient("127.0.0.1:1", deadline_s=0.25)
    try:
        c = compiler(tmp_path, remote=client)
        start = time.perf_counter()
        module = c.compile(source())
        elapsed = time.perf_counter() - start
        assert module.source_tier == "compiled"
        nvrtc_s = c.stats()["compile_seconds"]
        assert elapsed < nvrtc_s + 1.0, (
            f"a dead service cost {elapsed - nvrtc_s:.2f}s on top of NVRTC"
        )
        client.flush(timeout=2.0)
    finally:
        client.close()


def test_stats_are_exactly_worker_proto_compile_stats(tmp_path: pathlib.Path) -> None:
    from gpuplane.worker.v1 import worker_pb2

    c = compiler(tmp_path)
    c.compile(source())
    stats = c.stats()
    assert set(stats) == set(worker_pb2.CompileStats.DESCRIPTOR.fields_by_name), sorted(stats)
    assert worker_pb2.CompileStats(**stats).compiled == 1, "stats() must convert to the proto as is"


def test_the_public_surface_is_pinned() -> None:
    import gpu_worker.compile as package

    assert set(package.__all__) == {
        "CompiledModule",
        "KernelCompiler",
        "KernelSource",
        "NvrtcError",
        "nvrtc_version",
    }


def test_work_past_the_memo_is_traced_with_module_key_prefix_and_tier(
    tmp_path: pathlib.Path,
) -> None:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    c = KernelCompiler(ARCH, cache_dir=tmp_path / "t", tracer_provider=provider)
    module = c.compile(source())
    c.compile(source())  # a memo hit: no span
    spans = [sp for sp in exporter.get_finished_spans() if sp.name == "kernel.compile"]
    assert len(spans) == 1, f"expected one compile span, got {[sp.name for sp in spans]}"
    attrs = spans[0].attributes
    assert attrs["gpuplane.kernel.module"] == "axpy" and attrs["gpuplane.kernel.tier"] == "compiled"
    assert attrs["gpuplane.kernel.cache_key"] == module.key_cubin[:16]


# -- through a real kernel cache service on loopback ----------------------------------------------


@pytest.fixture
def cache_server(tmp_path: pathlib.Path):
    """A real cache_service server (SQLite in tmp_path) on port 0, with a write token."""
    from prometheus_client import CollectorRegistry

    from cache_service import server as server_mod
    from cache_service.config import ServerConfig

    config = ServerConfig(
        listen="127.0.0.1:0",
        db=tmp_path / "kernels.sqlite",
        write_token="test-token",
        maintenance_s=3600.0,
    )
    server = server_mod.start_cache_server(config, registry=CollectorRegistry())
    yield f"127.0.0.1:{server.port}"
    server.stop(grace=0.5)


def _client(target: str):
    from cache_service.client import KernelCacheClient

    return KernelCacheClient(target, write_token="test-token", deadline_s=2.0)


def test_a_second_host_warms_from_a_real_service_and_compiles_nothing(
    tmp_path: pathlib.Path,
    cache_server: str,
) -> None:
    kernel_set = [source(f"svc{i}", body=f"y[i] = {i}.0f + x[i];") for i in range(3)]
    first_client = _client(cache_server)
    try:
        host_a = compiler(tmp_path, "host_a", remote=first_client, namespace="model-x")
        for src in kernel_set:
            host_a.compile(src)
        assert first_client.flush(timeout=10.0), "stores did not reach the service"
    finally:
        first_client.close()
    second_client = _client(cache_server)
    try:
        host_b = compiler(tmp_path, "host_b", remote=second_client, namespace="model-x")
        assert host_b.prefetch(kernel_set) == 3, "the warm service should supply every module"
        modules = [host_b.compile(src) for src in kernel_set]
        assert host_b.stats()["compiled"] == 0, "a host warmed by the service must not run NVRTC"
        assert [m.cubin for m in modules] == [host_a.compile(src).cubin for src in kernel_set]
        assert host_b.stats()["remote_errors"] == 0, host_b.stats()
    finally:
        second_client.close()


@pytest.fixture
def lying_server():
    """A real gRPC KernelCacheService on loopback that serves every key with bytes that fail their
    digest (a damaged database row, a hostile proxy): what the client's verification must catch."""
    from gpuplane.kernelcache.v1 import kernel_cache_pb2 as pb
    from gpuplane.kernelcache.v1 import kernel_cache_pb2_grpc as pb_grpc

    from cache_service.convert import artifact_to_pb
    from services.common.server import ServiceRegistration, create_server
    from services.common.telemetry import tracer_provider

    class Lying(pb_grpc.KernelCacheServiceServicer):
        def _bad(self, key: str) -> pb.LookupResponse:
            good = Artifact(
                data=b"\x7fELF" + b"\0" * 64,
                kind="cubin",
                arch=ARCH,
                nvrtc_version="13.0",
                module_name="axpy",
            )
            message = artifact_to_pb(good)
            message.data = b"\x7fELF" + b"\1" * 64  # the digest no longer matches
            return pb.LookupResponse(found=True, artifact=message)

        def Lookup(self, request, context):
            return self._bad(request.key)

        def BatchLookup(self, request, context):
            return pb.BatchLookupResponse(results=[self._bad(k) for k in request.keys])

        def Store(self, request, context):
            return pb.StoreResponse(stored=True)

    running = create_server(
        "127.0.0.1:0",
        [
            ServiceRegistration(
                "gpuplane.kernelcache.v1.KernelCacheService",
                Lying(),
                pb_grpc.add_KernelCacheServiceServicer_to_server,
            )
        ],
        tracer_provider("lying-cache"),
    )
    yield f"127.0.0.1:{running.port}"
    running.stop(0.5)


def test_a_real_service_serving_bytes_that_fail_their_digest_is_a_miss_and_compiles(
    tmp_path: pathlib.Path,
    lying_server: str,
) -> None:
    client = _client(lying_server)
    try:
        c = compiler(tmp_path, remote=client)
        module = c.compile(source())
        assert module.source_tier == "compiled" and module.cubin[:4] == b"\x7fELF"
        assert b"\1" * 64 not in module.cubin, "corrupt remote bytes reached the module"
        assert c.stats()["remote_errors"] >= 1, f"corrupt artifacts were not counted: {c.stats()}"
        assert c.prefetch([source("other")]) == 0
    finally:
        client.close()


# -- load(): on the sim device (the cuda path is tests/gpu/test_compile.py) ---------------------


def _sim_device():
    from gpu_worker.device import open_device

    return open_device("sim")


def test_load_uses_the_cubin_when_the_device_arch_matches(tmp_path: pathlib.Path) -> None:
    device = _sim_device()
    try:
        c = KernelCompiler(device.info.arch, cache_dir=tmp_path / "d")
        module = c.load(device, source())
        assert module.image == c.compile(source()).cubin, "a matching arch must load the CUBIN"
        assert c.stats()["load_fallbacks"] == 0
    finally:
        device.close()


def test_load_uses_the_ptx_when_the_device_arch_differs(tmp_path: pathlib.Path) -> None:
    device = _sim_device()
    try:
        other = "sm_80" if device.info.arch != "sm_80" else "sm_90"
        c = KernelCompiler(other, cache_dir=tmp_path / "d")
        module = c.load(device, source())
        assert module.image == c.compile(source()).ptx, "another arch must load the PTX"
    finally:
        device.close()


def test_a_ptx_the_driver_rejects_falls_back_to_a_fresh_compile_for_the_device_arch(
    tmp_path: pathlib.Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from gpu_worker.device.backend import DeviceError

    device = _sim_device()
    try:
        # The sim does not model the driver's PTX ISA check; add it: this "driver" knows PTX <= 9.0.
        real_load = device.backend.load_module

        def driver_load(image: bytes):
            if b".version 9.9" in image:
                raise DeviceError("cuModuleLoadData: CUDA_ERROR_UNSUPPORTED_PTX_VERSION")
            return real_load(image)

        monkeypatch.setattr(device.backend, "load_module", driver_load)
        other = "sm_80" if device.info.arch != "sm_80" else "sm_90"
        c = KernelCompiler(other, cache_dir=tmp_path / "d")
        good = c.compile(source())
        newer = good.ptx.replace(b".version 9.0", b".version 9.9")
        c.local.put(good.key_ptx, newer)  # the disk tier now holds a PTX this "driver" rejects
        c = KernelCompiler(other, cache_dir=tmp_path / "d")
        module = c.load(device, source())
        assert module.image[:4] == b"\x7fELF", "the fallback must load a fresh CUBIN"
        assert c.stats()["load_fallbacks"] == 1 and c.detailed_stats()["fresh_compiles"] == 1, (
            c.stats()
        )
    finally:
        device.close()


def test_a_cold_host_asks_the_service_once_per_module_not_again_when_it_compiles(
    tmp_path: pathlib.Path,
) -> None:
    remote = InTestRemote()
    kernel_set = [source(f"cold{i}", body=f"y[i] = {i}.0f - x[i];") for i in range(3)]
    c = compiler(tmp_path, "cold_host", remote=remote)
    remote.batch_calls = remote.lookup_calls = 0
    assert c.prefetch(kernel_set) == 0
    tiers = [c.compile(src).source_tier for src in kernel_set]
    assert tiers == ["compiled"] * 3, tiers
    assert remote.batch_calls == 1 and remote.lookup_calls == 0, (
        f"after a prefetch miss the compiles asked again: {remote.batch_calls} batch, "
        f"{remote.lookup_calls} single lookups")

