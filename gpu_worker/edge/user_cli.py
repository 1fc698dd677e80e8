"""`gpuplane`: the command line for users of a running stack.

    gpuplane load --model-id m1 --family decoder --config tiny --seed 0
    gpuplane load --model-id llama --checkpoint Llama-3.2-1B [--weight-format fp16]
    gpuplane generate --model-id m1 --tokens 1,2,3 --max-new-tokens 16
    gpuplane generate --model-id llama --prompt "Once upon a time" --max-new-tokens 32
    gpuplane embed --model-id e1 --tokens 1,2,3 --tokens 4,5,6
    gpuplane embed --model-id bert --text "first text" --text "second"
    gpuplane stats [--json]
    gpuplane resources [--json]          (asks the governor)
    gpuplane models | unload | trim
    gpuplane offload --model-id m1       (weights to pinned host; the next request wakes it)

Each command opens a client, makes one call and prints it, sizes for people (`298.0 MiB`);
`--json` prints the response message as JSON, sizes in bytes. Failures print
`gpuplane COMMAND: error: STATUS: details` and exit with the codes of services.common.cli
(1 not found, 2 usage, 3 the call failed, 4 no server answered).
"""
from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import grpc
import numpy as np

from gpu_worker.models.configs import CONFIGS, WEIGHT_FORMATS
from services.common import cli, security
from services.common.channels import open_channel
from services.common.cli import CommandError, Endpoint, human_bytes
from services.common.config import env_flag, parse_bytes
from services.common.errors import GpuplaneError
from services.governor.report import zone_rows

PROG = "gpuplane"
# Why a zone's content can exceed its committed bytes; printed under the zones when one does.
def _tokens(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token list: {text!r} (try 1,2,3)") from None


def _print_json(message: Any) -> None:
    print(json.dumps(cli.message_dict(message), indent=2))


def _mib(n: int) -> str:
    return human_bytes(n)


def cmd_load(args: argparse.Namespace) -> None:
    if args.weight_format and not args.checkpoint:
        raise CommandError("--weight-format applies to --checkpoint loads only")
    with _worker(args) as client:
        if args.checkpoint:
            reply = client.load_checkpoint(args.model_id, args.checkpoint, args.weight_format or "")
        else:
            reply = client.load_model(args.model_id, args.family, args.config, args.seed)
    if args.json:
        return _print_json(reply)
    m = reply.model
    source = (f"{m.checkpoint} ({m.architecture}, {m.weight_format})" if m.checkpoint
              else f"{m.family}/{m.config} seed {m.seed}")
    print(f"loaded {m.model_id}: {source}, vocab {m.vocab_size}, "
          f"context {m.max_context}, weights {_mib(m.weight_bytes)} in {reply.load_seconds:.2f}s "
          f"(kernels compiled {reply.kernels_compiled}, from cache {reply.kernels_from_cache})")


def cmd_unload(args: argparse.Namespace) -> None:
    with _worker(args) as client:
        freed = client.unload_model(args.model_id)
    if args.json:
        print(json.dumps({"model_id": args.model_id, "freed_bytes": freed}))
        return
    print(f"unloaded {args.model_id}: freed {_mib(freed)}")


def cmd_offload(args: argparse.Namespace) -> None:
    with _worker(args) as client:
        reply = client.offload_model(args.model_id)
    if args.json:
        return _print_json(reply)
    print(f"offloaded {args.model_id}: freed {_mib(reply.freed_bytes)}, state {reply.model.state}, "
          f"resident {_mib(reply.model.resident_bytes)} of {_mib(reply.model.weight_bytes)}")


def cmd_models(args: argparse.Namespace) -> None:
    with _worker(args) as client:
        models = client.list_models()
    if args.json:
        print(json.dumps([cli.message_dict(m) for m in models], indent=2))
        return
    for m in models:
        print(f"{m.model_id}\t{m.family}/{m.config}\tvocab {m.vocab_size}\tcontext {m.max_context}"
              f"\tweights {_mib(m.weight_bytes)}\t{m.state} {_mib(m.resident_bytes)}")


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = args.tokens
    if args.random:
        prompt = np.random.default_rng(args.seed).integers(1, args.vocab, args.random).tolist()
    if not prompt and not args.prompt:
        raise CommandError("give a prompt with --prompt TEXT, --tokens 1,2,3 or --random N")
    with _worker(args, deadline_s=args.timeout) as client:
        produced: list[int] = []
        text: list[str] = []
        first = 0.0
        prompt_tokens = len(prompt)
        sampling = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                    "seed": args.sampling_seed, "stop_token_ids": args.stop_tokens}
        finish = ""
        for message in client.generate_stream(args.model_id, [] if args.prompt else prompt,
                                              args.max_new_tokens, prompt=args.prompt,
                                              sampling=sampling):
            finish = message.finish_reason or finish
            if message.first_token_seconds:
                first = message.first_token_seconds
            prompt_tokens = message.prompt_tokens or prompt_tokens
            produced.extend(message.tokens)
            text.append(message.text)
            if not args.json and args.prompt:
                print(message.text, end="", flush=True)
            elif not args.json and message.tokens:
                print(" ".join(map(str, message.tokens)), end=" ", flush=True)
    if args.json:
        out = {"prompt_tokens": prompt_tokens, "tokens": produced, "first_token_seconds": first,
               "finish_reason": finish}
        if args.prompt:
            out["text"] = "".join(text)
        print(json.dumps(out))
    else:
        print(f"\n({len(produced)} tokens, finish {finish or '?'}; first token after "
              f"{first * 1000:.1f} ms)")


def cmd_embed(args: argparse.Namespace) -> None:
    if bool(args.tokens) == bool(args.text):
        raise CommandError("give --tokens 1,2,3 or --text TEXT (repeatable), not both")
    with _worker(args, deadline_s=args.timeout) as client:
        vectors = (client.embed_texts(args.model_id, args.text) if args.text
                   else client.embed(args.model_id, args.tokens))
    if args.json:
        print(json.dumps(vectors.tolist()))
        return
    for i, row in enumerate(vectors):
        head = ", ".join(f"{x:+.4f}" for x in row[:6])
        print(f"[{i}] dim {row.shape[0]}, norm {float(np.linalg.norm(row)):.4f}: {head}, ...")


def cmd_stats(args: argparse.Namespace) -> None:

    with _worker(args) as client:
        s = client.stats()
    if args.json:
        return _print_json(s)
    print(f"{s.backend} {s.device_name}: used {_mib(s.device_used_bytes)} of "
          f"{_mib(s.device_total_bytes)}, ledger {_mib(s.ledger_bytes)}, unaccounted "
          f"{_mib(s.unaccounted_bytes)}, governor {'connected' if s.governor_connected else 'local'}")
    for line in zone_rows(s.zones):
        print(f"  {line}")
    k, p, c = s.kernel_cache, s.plans, s.compile
    print(f"kernel cache: {k.entries} variants (max {k.max_variants_per_node}/node, bound "
          f"{k.variant_bound}), hits {k.hits}, misses {k.misses}, evictions {k.evictions}, "
          f"workspace {_mib(k.workspace_bytes)}")
    print(f"plans: {p.entries} warm, hits {p.hits}, misses {p.misses}, evictions {p.evictions}, "
          f"graphs {_mib(p.graph_bytes)}")
    print(f"compile: compiled {c.compiled} ({c.compile_seconds:.2f}s), memo {c.memo_hits}, "
          f"local {c.local_hits}, remote {c.remote_hits}, remote errors {c.remote_errors}; "
          f"claims {c.claims_granted}, waits {c.claim_waits} ({c.claim_wait_hits} hits, "
          f"{c.claim_takeovers} takeovers, {c.claim_wait_timeouts} timed out)")
    print(f"capture: {s.capture.captures} captures, {s.capture.replays} replays, "
          f"{s.capture.invalidations} invalidations, {s.capture.gate_waits} gate waits")
    b = s.scheduler
    print(f"prefix cache: {b.prefix_cache_hit_tokens} of {b.prefix_cache_queried_tokens} prompt "
          f"tokens hit, {b.kv_blocks_cached} kv blocks cached")
    print(f"scheduler: {b.running} running, {b.waiting} waiting (peak batch {b.peak_batch_size}), "
          f"{b.steps} steps, {b.prefill_tokens} prefill + {b.decode_tokens} decode tokens, "
          f"{b.preemptions} preemptions, {b.cancelled} cancelled, {b.rejected} rejected; kv "
          f"blocks {b.kv_blocks_used}/{b.kv_blocks_total} of {b.kv_block_tokens} tokens")
    budget = _mib(b.kv_swap_host_budget_bytes) if b.kv_swap_host_budget_bytes else "off"
    print(f"kv swap: host {_mib(b.kv_swap_host_bytes)} of {budget}, {b.kv_swap_outs} out "
          f"({b.kv_swapped_out_blocks} blocks), {b.kv_swap_ins} in ({b.kv_swapped_in_blocks} "
          f"blocks); recomputed: {b.kv_swap_declined} declined, {b.kv_swap_refused} refused, "
          f"{b.kv_swap_failed} failed")
    if b.steps and b.step_device_us:
        wall = b.step_host_us + b.step_wait_us
        print(f"steps: {wall / b.steps / 1e3:.2f} ms end to end (host {b.step_host_us / b.steps / 1e3:.2f}"
              f" ms), {b.step_device_us / b.steps / 1e3:.2f} ms on the device; end to end / device "
              f"{wall / b.step_device_us:.3f}")


def cmd_trim(args: argparse.Namespace) -> None:
    with _worker(args) as client:
        reply = client.trim(args.target_bytes)
    if args.json:
        return _print_json(reply)
    print(f"freed {_mib(reply.freed_bytes)}, ledger now {_mib(reply.ledger_bytes)}")


def cmd_resources(args: argparse.Namespace) -> None:
    from gpuplane.governor.v1 import governor_pb2, governor_pb2_grpc


    channel = open_channel(args.governor, "gpuplane.governor.v1.GovernorService",
                           ["GetResources"], tls=security.channel_tls_from_args(args),
                           metadata_token=args.token or None)
    try:
        stub = governor_pb2_grpc.GovernorServiceStub(channel)
        reply = stub.GetResources(governor_pb2.GetResourcesRequest(), timeout=10.0)
    finally:
        channel.close()
    if args.json:
        return _print_json(reply)
    from services.governor.report import resource_lines
    print("\n".join(resource_lines(reply)))


def _worker(args: argparse.Namespace, **kwargs: Any) -> Any:
    from gpu_worker.edge.client import WorkerClient

    return WorkerClient(args.worker, tls=security.channel_tls_from_args(args),
                        token=args.token or None, **kwargs)


def _config_help() -> str:
    decoders = [c.name for c in CONFIGS.values() if c.family == "decoder"]
    encoders = [c.name for c in CONFIGS.values() if c.family == "encoder"]
    return (f"a named synthetic config: decoders {', '.join(decoders)}; encoders "
            f"{', '.join(encoders)} (with --family encoder, NAME means NAME-encoder when that "
            f"exists; default tiny)")


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(prog=PROG, description="Use a running gpuplane stack.")
    env_flag(parser, "--worker", "GPUPLANE_WORKER", "127.0.0.1:50071", "worker HOST:PORT")
    env_flag(parser, "--governor", "GPUPLANE_GOVERNOR", "127.0.0.1:50061", "governor HOST:PORT")
    parser.add_argument("--json", action="store_true",
                        help="print the response as JSON (sizes in bytes)")
    security.add_client_flags(parser, "CLI")
    env_flag(parser, "--token", "GPUPLANE_CLI_TOKEN", "",
             "bearer token to send (deployments without mutual TLS)")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    # --json is accepted after the command too; SUPPRESS keeps the top-level value when absent.
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="print the response as JSON (sizes in bytes)")

    def add(name: str, fn: Callable[[argparse.Namespace], None], help: str) -> argparse.ArgumentParser:
        p = commands.add_parser(name, help=help, description=help, parents=[common])
        p.set_defaults(fn=fn)
        return p

    def model_id(p: argparse.ArgumentParser, what: str) -> None:
        p.add_argument("--model-id", required=True, metavar="ID", help=what)

    p = add("load", cmd_load, "load a model onto the worker: a synthetic one (--family, --config, "
                              "--seed) or a Hugging Face checkpoint (--checkpoint)")
    model_id(p, "the name later commands use for this model (any string you choose)")
    p.add_argument("--family", default="decoder", choices=["decoder", "encoder"],
                   help="decoder: generates tokens (generate); encoder: embeds sequences (embed); "
                        "default decoder")
    p.add_argument("--config", default="tiny", choices=sorted(CONFIGS), metavar="NAME",
                   help=_config_help())
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the synthetic weights (same seed, same model); default 0")
    p.add_argument("--checkpoint", default="", metavar="DIR",
                   help="a Hugging Face checkpoint directory under the worker's --model-root "
                        "(instead of --family/--config/--seed)")
    p.add_argument("--weight-format", default=None, choices=list(WEIGHT_FORMATS),
                   help="with --checkpoint: int4 (default: quantized on load) or fp16 (kept as "
                        "stored, ~3.6x the memory)")
    p = add("unload", cmd_unload, "unload a model and free its memory")
    model_id(p, "the model to unload")
    add("models", cmd_models, "list the loaded models")
    p = add("offload", cmd_offload, "page a model's weights out to pinned host and drop its caches")
    model_id(p, "the model to offload (the next request to it wakes it)")
    p = add("generate", cmd_generate, "generate tokens from a prompt (streamed as produced)")
    model_id(p, "a loaded decoder")
    p.add_argument("--tokens", type=_tokens, default=[], metavar="IDS",
                   help="prompt token ids, e.g. 1,2,3")
    p.add_argument("--prompt", default="", metavar="TEXT",
                   help="prompt text (a model with a tokenizer); the reply is streamed as text")
    p.add_argument("--random", type=int, default=0, metavar="N",
                   help="use N random prompt tokens instead")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary for --random; default 1024")
    p.add_argument("--seed", type=int, default=0, help="seed for --random; default 0")
    p.add_argument("--max-new-tokens", type=int, default=16, metavar="N",
                   help="tokens to generate at most; default 16")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0: greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus mass kept (0, 1]")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens; 0: all")
    p.add_argument("--sampling-seed", type=int, default=0,
                   help="seed of the sampler (same seed, same tokens)")
    p.add_argument("--stop-tokens", type=_tokens, default=[], metavar="IDS",
                   help="token ids that end the stream, e.g. 2,13")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="deadline in seconds; default 120")
    p = add("embed", cmd_embed, "embed token sequences (or texts) with an encoder model")
    model_id(p, "a loaded encoder")
    p.add_argument("--tokens", type=_tokens, action="append", default=[], metavar="IDS",
                   help="one sequence, e.g. 1,2,3 (repeat for a batch; lengths may differ)")
    p.add_argument("--text", action="append", default=[],
                   help="one text (repeat for a batch; a model with a tokenizer)")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="deadline in seconds; default 120")
    add("stats", cmd_stats, "the worker's memory, caches, plans, compiles and captures")
    add("resources", cmd_resources, "the governor's ledger per device, worker and zone")
    p = add("trim", cmd_trim, "drop worker caches until the ledger is at or under a target")
    p.add_argument("--target-bytes", type=parse_bytes, required=True, metavar="BYTES",
                   help="the ledger size to trim to, e.g. 0 or 256MiB")
    return parser


def _endpoint(args: argparse.Namespace) -> Endpoint:
    if args.command == "resources":
        return Endpoint(args.governor, "--governor", "GPUPLANE_GOVERNOR", "governor")
    return Endpoint(args.worker, "--worker", "GPUPLANE_WORKER", "worker")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"{PROG} {args.command}"
    try:
        args.fn(args)
    except grpc.RpcError as exc:
        return cli.rpc_failure(prog, exc, _endpoint(args))
    except CommandError as exc:
        return cli.fail(prog, exc.message, exc.code)
    except GpuplaneError as exc:  # a flag combination that cannot work, e.g. --tls-cert alone
        return cli.fail(prog, exc.message, cli.EXIT_USAGE)
    return cli.EXIT_OK


def console() -> None:
    """The `gpuplane` console script."""
    cli.run(main)


if __name__ == "__main__":
    console()
