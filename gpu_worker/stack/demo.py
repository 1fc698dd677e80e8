"""`make run`: the whole stack on one machine, driving the workload that once ran a server out of memory.

Starts the governor, the kernel cache service (SQLite under ./var/demo/) and a worker (`auto`
backend: cuda where a GPU exists, else the sim test double) as subprocesses on free loopback
ports; loads the reference decoder; replays 12 prompt lengths ascending and then descending (the
469..5502 replay of DESIGN 1.1, scaled to the model's context) and prints a row per request;
then starts a second worker with an empty disk cache, standing in for another host, which warms
from the shared cache service, and compares its first token with the first host's. Writes
./var/report/report.json and memory.png, and stops everything with SIGTERM.

`--serve` starts the same stack and keeps it up until Ctrl-C, for `gpuplane ...` commands; it
prints the cache's write token once (the services get it through their environment, never their
command lines) and serves the Hugging Face checkpoints under `--model-root`.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from typing import Any

import numpy as np

from gpu_worker.edge.client import WorkerClient
from gpu_worker.stack.processes import Stack
from gpu_worker.stack.progress import step
from services.common import cli
from services.common.config import VAR_DIR, env_flag

MiB = 1 << 20
MODEL_ID = "demo-decoder"
# The defaults of each service's --listen and of the CLIs' --worker, --governor and --target.
DEFAULT_PORTS = {"worker": 50071, "cache": 50051, "governor": 50061}
# The prompt lengths of the incident (DESIGN 1.1), scaled onto the model's context below.
INCIDENT_LENGTHS = [469, 615, 807, 1059, 1389, 1822, 2390, 3135, 4113, 4195, 5000, 5502]


def prompt_lengths(max_context: int, max_new_tokens: int, count: int = 12) -> list[int]:
    """`count` of the incident's 12 lengths (evenly picked, always the shortest and the longest),
    scaled so the longest prompt plus its new tokens fits the context."""
    room = max_context - max_new_tokens
    scale = room / INCIDENT_LENGTHS[-1]
    count = max(2, min(count, len(INCIDENT_LENGTHS)))
    picks = sorted({round(i * (len(INCIDENT_LENGTHS) - 1) / (count - 1)) for i in range(count)})
    return [max(1, int(INCIDENT_LENGTHS[i] * scale)) for i in picks]


def snapshot(client: WorkerClient) -> dict[str, Any]:
    """The per-request figures the table and the report show, from one GetStats call."""
    s = client.stats()
    return {
        "device_used_bytes": s.device_used_bytes,
        "ledger_bytes": s.ledger_bytes,
        "unaccounted_bytes": s.unaccounted_bytes,
        "kernel_variants": s.kernel_cache.entries,
        "max_variants_per_node": s.kernel_cache.max_variants_per_node,
        "kernel_evictions": s.kernel_cache.evictions,
        "workspace_bytes": s.kernel_cache.workspace_bytes,
        "plans": s.plans.entries,
        "plan_evictions": s.plans.evictions,
        "compiled": s.compile.compiled,
        "compile_local_hits": s.compile.local_hits,
        "compile_remote_hits": s.compile.remote_hits,
        "compile_memo_hits": s.compile.memo_hits,
        "backend": s.backend,
        "device_name": s.device_name,
        "governor_connected": s.governor_connected,
    }


HEADER = (f"{'#':>3} {'pass':<5} {'prompt':>6} {'latency':>9} {'1st tok':>8} {'device':>10} "
          f"{'ledger':>10} {'unacct':>9} {'variants':>9} {'k.evict':>7} {'plans':>5} {'p.evict':>7} "
          f"{'compiled':>8} {'cache hits':>10}")


def row_text(r: dict[str, Any]) -> str:
    return (f"{r['index']:>3} {r['pass']:<5} {r['prompt_tokens']:>6} {r['latency_ms']:>7.1f}ms "
            f"{r['first_token_ms']:>6.1f}ms {r['device_used_bytes'] / MiB:>6.1f}MiB "
            f"{r['ledger_bytes'] / MiB:>6.1f}MiB {r['unaccounted_bytes'] / MiB:>5.1f}MiB "
            f"{r['kernel_variants']:>4}/{r['max_variants_per_node']:<4} {r['kernel_evictions']:>7} "
            f"{r['plans']:>5} {r['plan_evictions']:>7} {r['compiled']:>8} "
            f"{r['compile_local_hits'] + r['compile_remote_hits']:>10}")


def replay(client: WorkerClient, lengths: list[int], vocab: int, max_new_tokens: int,
           rng: np.random.Generator) -> list[dict[str, Any]]:
    rows = []
    print(HEADER)
    schedule = [("asc", n) for n in lengths] + [("desc", n) for n in reversed(lengths)]
    for index, (label, n) in enumerate(schedule, start=1):
        prompt = rng.integers(1, vocab, n).tolist()
        result = client.generate(MODEL_ID, prompt, max_new_tokens, timeout=600)
        row = {"index": index, "pass": label, "prompt_tokens": n,
               "new_tokens": len(result.tokens), "latency_ms": result.latency_seconds * 1000,
               "first_token_ms": result.first_token_seconds * 1000, **snapshot(client)}
        rows.append(row)
        print(row_text(row), flush=True)
    return rows


def warm_second_host(stack: Stack, args: argparse.Namespace, cache: str, governor: str,
                     token: str, first_prompt: list[int], max_new_tokens: int) -> dict[str, Any]:
    """Another host: an empty disk cache, the shared cache service. Returns its figures."""
    cache_dir = stack.var_dir / "host-b" / "kernels"
    shutil.rmtree(cache_dir, ignore_errors=True)
    with step("starting worker host-b (empty disk cache, shared cache service)"):
        worker_b = stack.start_worker("host-b", backend=args.backend, governor=governor, cache=cache,
                                      cache_dir=cache_dir, cache_write_token=token)
    with WorkerClient(worker_b.address) as client:
        with step("host-b: loading the decoder"):
            load = client.load_model(MODEL_ID, "decoder", args.config, args.seed)
        result = client.generate(MODEL_ID, first_prompt, max_new_tokens, timeout=600)
        figures = snapshot(client)
    return {"load_seconds": load.load_seconds, "kernels_compiled_at_load": load.kernels_compiled,
            "kernels_from_cache_at_load": load.kernels_from_cache,
            "first_token_ms": result.first_token_seconds * 1000,
            "latency_ms": result.latency_seconds * 1000, **figures}


def memory_limits(values_mib: list[float], floor_span_mib: float = 8.0) -> tuple[float, float]:
    """Y limits around the memory curves: their own range, padded, at least `floor_span_mib` tall.

    The point of the plot is that memory stays flat while prompts grow and shrink, and steps only
    where a new shape plan or kernel variant is admitted (a few MiB on ~300). From 0 those steps
    are a pixel high; around the data they are visible, and a flat line still reads as flat."""
    low, high = min(values_mib), max(values_mib)
    pad = max((high - low) * 0.15, (floor_span_mib - (high - low)) / 2, 0.5)
    return max(0.0, low - pad), high + pad


def plot(rows: list[dict[str, Any]], path: pathlib.Path) -> bool:
    """Memory and evictions per request as a PNG; False (and no file) where matplotlib is missing.

    Top: device used and the ledger (they should coincide: the legend gives the largest gap, the
    unaccounted bytes), over the prompt lengths as grey bars. Bottom: what keeps memory flat,
    the cumulative kernel-variant and plan evictions, and the warm plans."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["index"] for r in rows]
    used = [r["device_used_bytes"] / MiB for r in rows]
    ledger = [r["ledger_bytes"] / MiB for r in rows]
    unaccounted = max(abs(r["unaccounted_bytes"]) for r in rows) / MiB
    fig, (ax, ev) = plt.subplots(2, 1, figsize=(10, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [3, 2]})
    bars = ax.twinx()
    bars.bar(x, [r["prompt_tokens"] for r in rows], alpha=0.15, color="grey", label="prompt tokens")
    bars.set_ylabel("prompt tokens")
    ax.set_zorder(bars.get_zorder() + 1)  # lines over the bars
    ax.patch.set_visible(False)
    ax.step(x, used, where="mid", color="tab:blue", linewidth=3, alpha=0.6, label="device used")
    ax.plot(x, ledger, "o", color="tab:orange", markersize=5,
            label=f"ledger (unaccounted at most {unaccounted:.1f} MiB)")
    ax.set_ylim(*memory_limits(used + ledger))
    ax.set_ylabel("MiB (axis around the data, not from 0)")
    ax.legend(loc="lower center")
    ax.set_title(f"memory per request, backend {rows[0]['backend']} ({rows[0]['device_name']})")
    # Kernel variants are evicted by the dozen, plans one at a time: one axis each.
    ev.step(x, [r["kernel_evictions"] for r in rows], where="mid", color="tab:red", linewidth=2,
            label="kernel variant evictions (cumulative, left)")
    ev.set_ylabel("kernel variant evictions")
    plans = ev.twinx()
    plans.step(x, [r["plan_evictions"] for r in rows], where="mid", color="tab:purple",
               linestyle="--", linewidth=2, label="plan evictions (cumulative, right)")
    plans.plot(x, [r["plans"] for r in rows], "s:", color="tab:green", markersize=4,
               label="warm plans (right)")
    plans.set_ylabel("plans")
    plans.set_ylim(0, max(max(r["plans"], r["plan_evictions"]) for r in rows) + 1)
    handles = ev.get_legend_handles_labels()[0] + plans.get_legend_handles_labels()[0]
    ev.legend(handles, [h.get_label() for h in handles], loc="upper left")
    ev.set_xlabel("request (ascending prompt lengths, then descending)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def run_demo(args: argparse.Namespace) -> int:
    var = pathlib.Path(args.var_dir)
    work = var / "demo"
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    report_dir = var / "report"
    report_dir.mkdir(parents=True, exist_ok=True)
    token = secrets.token_hex(16)
    rng = np.random.default_rng(args.seed)
    stack = Stack(work)
    try:
        with step("starting the memory governor"):
            governor = stack.start_governor(port=port_for(args, "governor"))
        with step("starting the kernel cache service (SQLite under var/demo/)"):
            cache = stack.start_cache(write_token=token, port=port_for(args, "cache"))
        with step(f"starting worker host-a (backend {args.backend})"):
            worker = stack.start_worker("host-a", backend=args.backend, governor=governor.address,
                                        cache=cache.address, cache_write_token=token,
                                        extra=model_root_flags(args),
                                        port=port_for(args, "worker"))
        print(f"governor {governor.address}, cache {cache.address}, worker {worker.address}; "
              f"logs in {stack.var_dir / 'logs'}")
        if args.serve:
            return serve_until_interrupted(stack, worker.address, governor.address, cache.address,
                                           token, args)
        with WorkerClient(worker.address) as client:
            with step(f"host-a: loading the {args.config} decoder (compiles its kernels)"):
                load = client.load_model(MODEL_ID, "decoder", args.config, args.seed)
            model = load.model
            lengths = prompt_lengths(model.max_context, args.max_new_tokens, args.requests)
            print(f"\n{model.model_id}: {model.family}/{model.config}, vocab {model.vocab_size}, "
                  f"context {model.max_context}, weights {model.weight_bytes / MiB:.1f} MiB, loaded "
                  f"in {load.load_seconds:.2f}s ({load.kernels_compiled} kernels compiled)\n")
            first_prompt = rng.integers(1, model.vocab_size, lengths[0]).tolist()
            first = client.generate(MODEL_ID, first_prompt, args.max_new_tokens, timeout=600)
            rows = replay(client, lengths, model.vocab_size, args.max_new_tokens, rng)
        host_b = warm_second_host(stack, args, cache.address, governor.address, token,
                                  first_prompt, args.max_new_tokens)
        host_a = {"load_seconds": load.load_seconds, "kernels_compiled_at_load": load.kernels_compiled,
                  "first_token_ms": first.first_token_seconds * 1000,
                  "latency_ms": first.latency_seconds * 1000}
        print_comparison(host_a, host_b)
        resources = governor_resources(governor.address)
        report = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "backend": rows[0]["backend"], "device": rows[0]["device_name"],
            "model": {"model_id": MODEL_ID, "config": args.config, "seed": args.seed,
                      "max_context": model.max_context, "vocab_size": model.vocab_size,
                      "weight_bytes": model.weight_bytes},
            "max_new_tokens": args.max_new_tokens, "prompt_lengths": lengths, "requests": rows,
            "host_a": host_a, "host_b": host_b, "governor": resources,
            "summary": summarize(rows),
        }
        print_summary(report["summary"])
        (report_dir / "report.json").write_text(json.dumps(report, indent=2))
        plotted = plot(rows, report_dir / "memory.png")
        print(f"\nreport: {report_dir / 'report.json'}, plot: "
              f"{report_dir / 'memory.png' if plotted else 'skipped (matplotlib not installed)'}")
    finally:
        with step("stopping the stack (SIGTERM, drain)"):
            codes = stack.stop()
        if codes:
            print("exit codes: " + ", ".join(f"{k} {v}" for k, v in codes.items()))
    return 0


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    asc = [r for r in rows if r["pass"] == "asc"]
    desc = [r for r in rows if r["pass"] == "desc"]
    return {
        "peak_device_used_bytes": max(r["device_used_bytes"] for r in rows),
        "peak_ascending_bytes": max(r["device_used_bytes"] for r in asc),
        "peak_descending_bytes": max(r["device_used_bytes"] for r in desc),
        "final_device_used_bytes": rows[-1]["device_used_bytes"],
        "max_unaccounted_bytes": max(abs(r["unaccounted_bytes"]) for r in rows),
        "max_variants_per_node": max(r["max_variants_per_node"] for r in rows),
        "kernel_evictions": rows[-1]["kernel_evictions"],
        "plan_evictions": rows[-1]["plan_evictions"],
        "max_plans": max(r["plans"] for r in rows),
    }


def print_summary(s: dict[str, Any]) -> None:
    verdict = "no" if s["peak_descending_bytes"] <= s["peak_ascending_bytes"] else "YES"
    print(f"\npeak device used {s['peak_device_used_bytes'] / MiB:.1f} MiB (ascending "
          f"{s['peak_ascending_bytes'] / MiB:.1f}, descending {s['peak_descending_bytes'] / MiB:.1f}: "
          f"{verdict} growth on the descending pass); max unaccounted "
          f"{s['max_unaccounted_bytes'] / MiB:.1f} MiB; at most {s['max_variants_per_node']} kernel "
          f"variants per node ({s['kernel_evictions']} evictions); at most {s['max_plans']} warm plans "
          f"({s['plan_evictions']} evictions)")


def print_comparison(a: dict[str, Any], b: dict[str, Any]) -> None:
    """Cold start to first token = LoadModel (which compiles or fetches every kernel, so no
    request pays a compile stall) + the first request's first token."""
    cold_a = a["load_seconds"] * 1000 + a["first_token_ms"]
    cold_b = b["load_seconds"] * 1000 + b["first_token_ms"]
    a["cold_first_token_ms"], b["cold_first_token_ms"] = cold_a, cold_b
    print(f"\nsecond host warmed from the shared cache: compiled {b['compiled']} kernels "
          f"(remote hits {b['compile_remote_hits']}, local hits {b['compile_local_hits']})")
    print(f"{'':<8} {'load':>9} {'first token':>12} {'cold start to 1st token':>24} {'compiled':>9}")
    print(f"{'host-a':<8} {a['load_seconds']:>8.2f}s {a['first_token_ms']:>10.1f}ms {cold_a:>22.1f}ms "
          f"{a['kernels_compiled_at_load']:>9}")
    print(f"{'host-b':<8} {b['load_seconds']:>8.2f}s {b['first_token_ms']:>10.1f}ms {cold_b:>22.1f}ms "
          f"{b['compiled']:>9}")
    print(f"host-b reached its first token {cold_a / max(cold_b, 1e-9):.1f}x sooner than host-a")


def governor_resources(address: str) -> dict[str, Any]:
    import grpc
    from google.protobuf import json_format
    from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc

    try:
        with grpc.insecure_channel(address) as channel:
            reply = governor_pb2_grpc.GovernorServiceStub(channel).GetResources(
                governor_pb2.GetResourcesRequest(), timeout=10.0)
    except grpc.RpcError as exc:
        return {"error": f"{exc.code().name}: {exc.details()}"}
    return json_format.MessageToDict(reply, preserving_proto_field_name=True)


def port_for(args: argparse.Namespace, service: str) -> int | None:
    """`--serve` listens on the services' default ports where they are free, so `gpuplane` and
    the operators' CLIs work without flags; `make run`, and a taken port, get a free one."""
    if not args.serve:
        return None
    port = DEFAULT_PORTS[service]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return None
    return port


def model_root_flags(args: argparse.Namespace) -> list[str]:
    return ["--model-root", str(pathlib.Path(args.model_root).resolve())] if args.model_root else []


def checkpoints_under(root: str) -> list[str]:
    """The checkpoint directories (a config.json inside) right under `root`, sorted."""
    base = pathlib.Path(root)
    return sorted(d.name for d in base.iterdir() if (d / "config.json").is_file()) if base.is_dir() else []


def serve_hints(worker: str, governor: str, cache: str, cache_db: pathlib.Path, token: str,
                model_root: str) -> str:
    """What `make serve` prints once the stack is up: the token (once) and commands to try."""
    gp = f".venv/bin/gpuplane --worker {worker}"
    lines = [
        "",
        f"the stack is up: worker {worker}, governor {governor}, kernel cache {cache}",
        f"cache write token (printed only here; `prune` needs it): {token}",
        "",
        "try:",
        f"  {gp} generate --model-id {MODEL_ID} --random 64",
        f"  {gp} stats",
        f"  .venv/bin/gpuplane --governor {governor} resources",
        f"  .venv/bin/python -m cache_service stats --target {cache}",
        f"  .venv/bin/python -m cache_service list --db {cache_db}",
        "  export GPUPLANE_CACHE_WRITE_TOKEN=<the token above>",
        f"  .venv/bin/python -m cache_service prune --target {cache}",
    ]
    names = checkpoints_under(model_root) if model_root else []
    if names:
        lines.append(f"checkpoints under {model_root}: {', '.join(names)}")
        lines.append(f"  {gp} load --model-id ckpt --checkpoint {names[0]}")
    lines.append("Ctrl-C stops it.")
    return "\n".join(lines)


def serve_until_interrupted(stack: Stack, worker: str, governor: str, cache: str, token: str,
                            args: argparse.Namespace) -> int:
    with WorkerClient(worker) as client, step(f"loading the {args.config} decoder as {MODEL_ID}"):
        client.load_model(MODEL_ID, "decoder", args.config, args.seed)
    print(serve_hints(worker, governor, cache, stack.var_dir / "kernel_cache.db", token,
                      args.model_root), flush=True)
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    while not done.wait(1.0):
        for p in stack.processes:
            if not p.alive():
                print(f"{p.name} exited with {p.proc.returncode}:\n{p.log_tail()}", file=sys.stderr)
                return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog="python -m gpu_worker.stack.demo",
                        description=__doc__.splitlines()[0], epilog=None)
    env_flag(parser, "--backend", "GPUPLANE_WORKER_BACKEND", "auto", "worker backend",
             choices=["auto", "cuda", "sim"])
    env_flag(parser, "--config", "GPUPLANE_DEMO_CONFIG", "tiny", "decoder config to load")
    env_flag(parser, "--seed", "GPUPLANE_DEMO_SEED", 0, "model and prompt seed", type=int)
    env_flag(parser, "--max-new-tokens", "GPUPLANE_DEMO_MAX_NEW_TOKENS", 8,
             "tokens generated per request", type=int)
    env_flag(parser, "--var-dir", "GPUPLANE_VAR_DIR", VAR_DIR, "where databases, logs, report go")
    env_flag(parser, "--requests", "GPUPLANE_DEMO_REQUESTS", 12,
             "prompt lengths per pass (2..12 of the incident's lengths)", type=int)
    env_flag(parser, "--model-root", "GPUPLANE_WORKER_MODEL_ROOT", "",
             "directory of Hugging Face checkpoints the worker may load (`make serve MODEL_ROOT=`)")
    parser.add_argument("--serve", action="store_true", help="keep the stack up until Ctrl-C")
    parser.add_argument("--keep", action="store_true",
                        help="keep var/demo from the last run (warm caches) instead of starting cold")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("GPUPLANE_LOG_FORMAT", "text")
    return run_demo(args)


if __name__ == "__main__":
    sys.exit(main())
