"""The product as deployed, for the serving and batching benchmarks (issue 21).

The worker under test is its own process, `python -m gpu_worker serve` started by
gpu_worker/stack/processes.py with its defaults; the benchmark process is only its client (gRPC on
loopback, one thread per open stream on the client side). Any flag a benchmark changes is printed
with its reason before the run, so a reader sees exactly what was measured. The flags
gpu_worker.stack always passes (a private kernel cache dir, a worker id, no governor, no shared
cache) are those of a stand-alone worker. GPUPLANE_BENCH_KERNEL_CACHE, when set, is the worker's
--cache-dir, so the benchmarks of one session compile the kernels once (a warm local disk cache,
as a worker that has run before has); unset, every worker starts cold.
"""
from __future__ import annotations

import contextlib
import os
import pathlib
import tempfile
import time
from collections.abc import Iterator

from gpu_worker.edge.client import WorkerClient
from gpu_worker.stack.processes import Stack


@contextlib.contextmanager
def served_worker(backend: str, changed: dict[str, tuple[str | None, str]] | None = None,
                  deadline_s: float = 900.0) -> Iterator[tuple[WorkerClient, object]]:
    """A worker process and a client to it. `changed`: flag -> (value, why) for any default the
    benchmark overrides (printed); value None for a flag that takes none (`--no-prefix-cache`).
    Yields (client, the ServiceProcess)."""
    changed = changed or {}
    extra = [x for flag, (value, _) in changed.items()
             for x in ((flag,) if value is None else (flag, value))]
    with tempfile.TemporaryDirectory(prefix="bench-worker-") as tmp:
        stack = Stack(pathlib.Path(tmp))
        t0 = time.perf_counter()
        cache = os.environ.get("GPUPLANE_BENCH_KERNEL_CACHE")
        proc = stack.start_worker(backend=backend, extra=extra,
                                  cache_dir=pathlib.Path(cache) if cache else None,
                                  health_timeout_s=600.0)
        print(f"worker process: {' '.join(proc.argv[1:])} (pid {proc.proc.pid}, healthy after "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
        if changed:
            for flag, (value, why) in changed.items():
                shown = flag if value is None else f"{flag} {value}"
                print(f"  changed from the default: {shown}: {why}", flush=True)
        else:
            print("  every serving flag at its default", flush=True)
        client = WorkerClient(proc.address, deadline_s=deadline_s)
        try:
            yield client, proc
        except Exception:
            # the worker's own traceback is in its log, which goes with the temporary directory
            print(f"worker log (last lines) after a failed call:\n{proc.log_tail(80)}", flush=True)
            raise
        finally:
            client.close()
            code = stack.stop_one(proc)
            if code not in (0, None):
                print(f"worker exited with {code}; log tail:\n{proc.log_tail()}", flush=True)


def ledger_error(client: WorkerClient) -> float:
    """|device use the ledger does not explain| / device use, from the worker's own GetStats."""
    s = client.stats()
    return abs(s.unaccounted_bytes) / max(1, s.device_used_bytes)
