"""Cold-start compile phase of the whole kernel library, per cache tier (issue 5; CPU, no GPU).

Each run is a fresh process that builds a KernelCompiler, prefetches
`gpu_worker.kernels.ALL_SOURCES` (one BatchLookup when a service is configured) and compiles every
module: what a worker does when it loads a model. Tiers (see bench/_cold_start.py): cold / local
disk warm / only the shared service warm. Runs are interleaved; medians and ratios are printed
side by side.

    .venv/bin/python bench/compile_bench.py [--rounds 5] [--arch sm_90]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from _cold_start import WRITE_TOKEN, report, seed_and_run_tiers, start_service

from bench.record import add_record_flag
from bench.targets import Targets


def child(args: argparse.Namespace) -> None:
    """One fresh process: the compile phase only (imports are timed apart)."""
    t_import = time.perf_counter()
    from cache_service.client import KernelCacheClient
    from gpu_worker.compile import KernelCompiler
    from gpu_worker.kernels import ALL_SOURCES

    start = time.perf_counter()
    client = KernelCacheClient(args.remote, write_token=WRITE_TOKEN) if args.remote else None
    compiler = KernelCompiler(
        args.arch, cache_dir=pathlib.Path(args.cache_dir), remote=client, namespace="bench"
    )
    prefetched = compiler.prefetch(ALL_SOURCES)
    for src in ALL_SOURCES:
        compiler.compile(src)
    elapsed = time.perf_counter() - start
    if client is not None:
        client.flush(30.0)
        client.close()
    stats = compiler.stats()
    print(
        json.dumps(
            {
                "seconds": elapsed,
                "import_seconds": start - t_import,
                "modules": len(ALL_SOURCES),
                "prefetched": prefetched,
                "compiled": stats["compiled"],
                "local_hits": stats["local_hits"],
                "remote_hits": stats["remote_hits"],
                "memo_hits": stats["memo_hits"],
                "nvrtc_seconds": round(stats["compile_seconds"], 3),
            }
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--cache-dir", help=argparse.SUPPRESS)
    parser.add_argument("--remote", default="", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=pathlib.Path, help="also write the medians here")
    add_record_flag(parser)
    args = parser.parse_args()
    if args.child:
        child(args)
        return 0
    script = str(pathlib.Path(__file__).resolve())
    with tempfile.TemporaryDirectory(prefix="compile-bench-") as tmp:
        scratch = pathlib.Path(tmp)
        server, target = start_service(scratch / "service.sqlite")
        try:
            # Seed: one process compiles everything, filling the warm local dir and the service.
            seed, results = seed_and_run_tiers(script, ["--arch", args.arch], scratch, target,
                                               args.rounds)
            print(f"seed run: {seed}")
        finally:
            server.stop(1.0)
    print(
        f"\ncompile phase of {results['cold'][0]['modules']} kernel modules ({args.arch}), "
        f"fresh process per run, {args.rounds} interleaved rounds"
    )
    print(
        report(
            results,
            "seconds",
            "compile phase",
            ["compiled", "local_hits", "remote_hits", "prefetched"],
        )
    )
    import statistics

    targets = Targets("compile_bench", args=args)
    for tier, runs in results.items():
        targets.figure(f"compile phase of every kernel module, {tier} tier",
                       statistics.median(r["seconds"] for r in runs), "s")
    if args.json:
        args.json.write_text(json.dumps({tier: {
            "median_s": statistics.median(r["seconds"] for r in runs),
            "compiled": runs[-1]["compiled"]} for tier, runs in results.items()}, indent=2))
    return targets.exit_code()


if __name__ == "__main__":
    sys.exit(main())
