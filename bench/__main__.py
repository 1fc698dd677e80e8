"""`make bench`: run the benchmarks this machine can run, one after another.

CPU benchmarks always run (quick settings); GPU benchmarks run when a CUDA device is present.
Each benchmark is also a script with its own flags (`python bench/<name>.py --help`); the
figures quoted in docs/ name the exact command they came from. A benchmark that misses a target it
prints exits non-zero (bench/targets.py); every benchmark still runs, and then this exits 1 naming
the ones that failed. `--record [DIR]` passes `--record DIR` to every benchmark: one JSON line per
figure in DIR/<device>.jsonl (bench/record.py; `python -m bench.report` makes docs/benchmarks.md).
On the GPU machine, where one call runs at most 10 minutes, `python -m bench.device_session`
runs the same GPU benchmarks in groups that each fit one call.
"""
from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys

from bench.record import RESULTS

HERE = pathlib.Path(__file__).resolve().parent

CPU = [
    ("cache_service_bench.py", ["--quick"]),
    ("governor_bench.py", ["--seconds", "2", "--open-seconds", "4"]),
    ("compile_bench.py", ["--rounds", "3"]),
    ("tls_bench.py", ["--calls", "1000", "--rounds", "5"]),
    ("fleet_bench.py", ["--hosts", "8"]),
    ("scheduler_host_bench.py", []),
]
GPU = [
    ("limits.py", []),
    ("device_bench.py", []),
    ("kernels_bench.py", ["--reps", "10"]),
    ("attention_bench.py", ["--reps", "10", "--trials", "5"]),
    ("paged_attention_bench.py", ["--reps", "10", "--trials", "5"]),
    ("decode_attention_bench.py", ["--reps", "20", "--trials", "5"]),
    ("int4_batched_bench.py", ["--reps", "10", "--trials", "5"]),
    ("decode_bench.py", ["--steps", "64"]),
    ("prefill_bench.py", ["--reps", "3"]),
    ("prefill_linear_bench.py", ["--reps", "10", "--trials", "5"]),
    ("replay_bench.py", []),
    ("encoder_bench.py", ["--requests", "60"]),
    ("embed_batch_bench.py", ["--requests", "1024"]),
    ("ttft_bench.py", ["--backend", "cuda", "--config", "small", "--rounds", "3"]),
    ("batching_bench.py", []),
    ("transformers_peer.py", []),
    ("serving_bench.py", []),
    ("checkpoint_load_bench.py", ["--layers", "4", "--vocab", "32000"]),
    ("pressure_bench.py", []),
    ("prefix_cache_bench.py", ["--trials", "3"]),
    ("kv_swap_bench.py", ["--trials", "3"]),
]


def _cuda_present() -> bool:
    from gpu_worker.device.cuda_backend import cuda_device_count

    return cuda_device_count() > 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", action="append", help="run only these scripts (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    parser.add_argument("--record", nargs="?", const=str(RESULTS), default=None, metavar="DIR",
                        help="every benchmark appends its figures to DIR/<device>.jsonl "
                             "(default DIR: bench/results)")
    args = parser.parse_args(argv)
    gpu = _cuda_present()
    plan = CPU + (GPU if gpu else [])
    if args.list:
        for name, flags in CPU + GPU:
            print(f"{name:24s} {' '.join(flags):40s} {'gpu' if (name, flags) in GPU else 'cpu'}")
        return 0
    if not gpu:
        print("no CUDA device: running the CPU benchmarks only", flush=True)
    extra = ["--record", str(pathlib.Path(args.record).resolve())] if args.record else []
    failed = run_all([(HERE / name, [*flags, *extra]) for name, flags in plan
                      if not args.only or name in args.only])
    if failed:
        print(f"\nfailed (a target MISSED or an error): {', '.join(failed)}")
    return 1 if failed else 0


def run_all(scripts: list[tuple[pathlib.Path, list[str]]]) -> list[str]:
    """Run every script in its own process, one after another; the names that exited non-zero."""
    failed = []
    for path, flags in scripts:
        print(f"\n=== {path.name} {' '.join(flags)}", flush=True)
        if subprocess.call([sys.executable, str(path), *flags]) != 0:
            failed.append(path.name)
    return failed


if __name__ == "__main__":
    sys.exit(main())
