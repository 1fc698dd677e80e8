"""Checkpoints and text over real gRPC: a sim worker with a --model-root holding golden checkpoints."""
from __future__ import annotations

import json
import pathlib
import shutil
from collections.abc import Iterator

import grpc
import numpy as np
import pytest
from gpuplane.worker.v1 import worker_pb2
from opentelemetry.sdk.trace import TracerProvider

from gpu_worker.checkpoints.text import TextCodec
from gpu_worker.edge.client import WorkerClient

GOLDEN = pathlib.Path(__file__).parents[1] / "checkpoints" / "golden"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> pathlib.Path:
    root = tmp_path_factory.mktemp("models")
    for name in ("llama-tied", "qwen2-untied", "bert-st", "llama-gptq"):
        shutil.copytree(GOLDEN / name, root / name)
    stop = shutil.copytree(GOLDEN / "llama-tied", root / "llama-eos")
    eos = int(np.load(GOLDEN / "llama-tied.npz")["greedy"][0][3])
    (stop / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 9999]}))
    bad = shutil.copytree(GOLDEN / "llama-tied", root / "llama-bad")
    cfg = json.loads((bad / "config.json").read_text())
    cfg["intermediate_size"] = 96   # the tensors say 64
    (bad / "config.json").write_text(json.dumps(cfg))
    (root.parent / "elsewhere").mkdir(exist_ok=True)
    return root


@pytest.fixture(scope="module")
def worker(root, tmp_path_factory) -> Iterator[WorkerClient]:
    from gpu_worker import WorkerConfig, WorkerRuntime
    from gpu_worker.edge.servicer import serve_worker
    runtime = WorkerRuntime(WorkerConfig(backend="sim", cache_dir=tmp_path_factory.mktemp("k"),
                                         worker_id="ckpt-worker", model_root=root))
    runtime.start()
    server = serve_worker(runtime, "127.0.0.1:0", TracerProvider())
    client = WorkerClient(server.address, deadline_s=120.0)
    client.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="llama", checkpoint="llama-tied"))
    client.load_model("synthetic", "decoder", "tiny", 7)
    try:
        yield client
    finally:
        client.close()
        server.stop(grace=5.0)


def _generate(worker, **fields) -> list[worker_pb2.GenerateResponse]:
    return list(worker.stub.Generate(worker_pb2.GenerateRequest(**fields), timeout=120))


def test_a_loaded_checkpoint_is_listed_with_its_source(worker):
    info = {m.model_id: m for m in worker.list_models()}["llama"]
    assert (info.checkpoint, info.architecture, info.weight_format) == ("llama-tied", "LlamaForCausalLM", "int4")
    assert info.has_tokenizer and info.vocab_size == 288 and info.max_context == 256


def test_token_generation_over_grpc_equals_transformers_greedy(worker):
    g = np.load(GOLDEN / "llama-tied.npz")
    out = _generate(worker, model_id="llama", prompt_tokens=list(g["prompts"][0]), max_new_tokens=16)
    tokens = [t for r in out for t in r.tokens]
    assert tokens == list(g["greedy"][0]) and out[-1].done
    assert all(r.text == "" for r in out), "token-only clients get no text"


def test_text_in_text_out_concatenates_to_the_decoded_tokens(worker):
    out = _generate(worker, model_id="llama", prompt="hello world, naïve 🙂", max_new_tokens=12)
    tokens = [t for r in out for t in r.tokens]
    codec = TextCodec.for_checkpoint(GOLDEN / "llama-tied")
    assert out[0].prompt_tokens == len(codec.encode("hello world, naïve 🙂"))
    assert "".join(r.text for r in out) == codec.decode(tokens)


def test_generation_stops_at_an_eos_token_from_the_list(worker):
    worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="eos", checkpoint="llama-eos"))
    try:
        g = np.load(GOLDEN / "llama-tied.npz")
        out = _generate(worker, model_id="eos", prompt_tokens=list(g["prompts"][0]), max_new_tokens=16)
        tokens = [t for r in out for t in r.tokens]
        assert tokens == list(g["greedy"][0][:4]), "must stop right after the EOS token"
        assert out[-1].done and out[-1].stopped_at_eos
    finally:
        worker.unload_model("eos")


@pytest.mark.parametrize("fields, code", [
    ({"checkpoint": "../elsewhere"}, grpc.StatusCode.PERMISSION_DENIED),
    ({"checkpoint": "/etc"}, grpc.StatusCode.PERMISSION_DENIED),
    ({"checkpoint": "missing"}, grpc.StatusCode.NOT_FOUND),
    ({"checkpoint": "llama-bad"}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"checkpoint": "llama-gptq", "weight_format": "fp16"}, grpc.StatusCode.INVALID_ARGUMENT),
    ({"checkpoint": "qwen2-untied", "weight_format": "int8"}, grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_failed_checkpoint_load_changes_nothing(worker, fields, code):
    before_models = sorted(m.model_id for m in worker.list_models())
    before_ledger = worker.stats().ledger_bytes
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="x", **fields))
    assert err.value.code() == code, err.value.details()
    assert sorted(m.model_id for m in worker.list_models()) == before_models
    assert worker.stats().ledger_bytes == before_ledger, "a failed load left bytes booked"


def test_an_fp16_load_is_listed_as_fp16_and_generates_transformers_greedy_tokens(worker):
    reply = worker.stub.LoadModel(worker_pb2.LoadModelRequest(
        model_id="qwen16", checkpoint="qwen2-untied", weight_format="fp16"))
    try:
        int4 = {m.model_id: m for m in worker.list_models()}["llama"]
        info = reply.model
        assert (info.checkpoint, info.architecture, info.weight_format) == (
            "qwen2-untied", "Qwen2ForCausalLM", "fp16")
        assert info.weight_bytes > int4.weight_bytes, "fp16 linears take more than int4's"
        g = np.load(GOLDEN / "qwen2-untied-fp16.npz")
        out = _generate(worker, model_id="qwen16", prompt_tokens=list(g["prompts"][1]),
                        max_new_tokens=16)
        assert [t for r in out for t in r.tokens] == list(g["greedy"][1])
    finally:
        worker.unload_model("qwen16")


def test_the_bad_checkpoint_error_names_file_and_tensor(worker):
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="x", checkpoint="llama-bad"))
    assert "model.safetensors, tensor 'model.layers.0.mlp.gate_proj.weight'" in err.value.details()


def test_text_to_a_model_without_tokenizer_is_failed_precondition(worker):
    with pytest.raises(grpc.RpcError) as err:
        _generate(worker, model_id="synthetic", prompt="hi", max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(grpc.RpcError) as err:
        _generate(worker, model_id="llama", prompt="hi", prompt_tokens=[1], max_new_tokens=2)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _held(worker) -> int:
    """Booked bytes less the arena's pool of reusable handles (worker-wide, kept across unloads)."""
    s = worker.stats()
    return s.ledger_bytes - s.arena.pooled_bytes


def test_an_absolute_path_inside_the_root_loads_qwen2_which_stops_at_its_eos(worker, root):
    before = _held(worker)
    worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="qwen",
                                                      checkpoint=str(root / "qwen2-untied")))
    g = np.load(GOLDEN / "qwen2-untied.npz")
    out = _generate(worker, model_id="qwen", prompt_tokens=list(g["prompts"][1]), max_new_tokens=16)
    want = list(g["greedy"][1])
    want = want[:want.index(2) + 1] if 2 in want else want   # eos_token_id 2 ends generation
    assert [t for r in out for t in r.tokens] == want
    assert out[-1].stopped_at_eos == (want[-1] == 2)
    worker.unload_model("qwen")
    assert _held(worker) == before, "unload must return every byte of the load"


def test_the_cli_loads_a_checkpoint_and_streams_text(worker, capsys):
    from gpu_worker.edge.user_cli import main
    assert main(["--worker", worker.target, "load", "--model-id", "cli", "--checkpoint",
                 "qwen2-untied"]) == 0
    assert "qwen2-untied (Qwen2ForCausalLM, int4)" in capsys.readouterr().out
    worker.unload_model("cli")
    assert main(["--worker", worker.target, "generate", "--model-id", "llama", "--prompt",
                 "hello world", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    codec = TextCodec.for_checkpoint(GOLDEN / "llama-tied")
    assert out["text"] == codec.decode(out["tokens"]) and out["prompt_tokens"] == len(codec.encode("hello world"))


def test_the_serve_flags_set_the_model_root_and_context(tmp_path):
    from gpu_worker.__main__ import build_parser, worker_config
    cfg = worker_config(build_parser().parse_args(
        ["serve", "--model-root", str(tmp_path), "--checkpoint-context", "4096"]))
    assert cfg.model_root == tmp_path and cfg.checkpoint_context == 4096
    assert worker_config(build_parser().parse_args(["serve"])).model_root is None


def test_embed_texts_of_different_lengths_match_transformers_in_order(worker, capsys):
    worker.stub.LoadModel(worker_pb2.LoadModelRequest(model_id="bert", checkpoint="bert-st"))
    try:
        info = {m.model_id: m for m in worker.list_models()}["bert"]
        assert (info.family, info.architecture, info.has_tokenizer) == ("encoder", "BertModel", True)
        g = np.load(GOLDEN / "bert-st.npz")
        texts = [str(t) for t in g["texts"]]
        reply = worker.stub.Embed(worker_pb2.EmbedRequest(model_id="bert", texts=texts), timeout=120)
        got = np.array([list(e.values) for e in reply.embeddings], np.float32)
        # The texts run as one padded batch of more than 16 rows: tensor-core linears with fp16
        # activations, so both the reference with that rounding and transformers (f32
        # activations) match within fp16 rounding (a flip moves a value by 2^-11 relative).
        # The fused f32 path's 2e-6 agreement is tests/checkpoints/test_goldens.py's.
        want = _bert_reference([TextCodec.for_checkpoint(GOLDEN / "bert-st").encode(t)
                                for t in texts])
        np.testing.assert_allclose(got, want, atol=5e-4, err_msg="served != reference, same rounding")
        np.testing.assert_allclose(got, g["text_embeddings"], atol=1e-3)
        from gpu_worker.edge.user_cli import main
        assert main(["--worker", worker.target, "embed", "--model-id", "bert", "--json",
                     *(a for t in texts for a in ("--text", t))]) == 0
        np.testing.assert_allclose(json.loads(capsys.readouterr().out), got, atol=1e-6)
        with pytest.raises(grpc.RpcError) as err:
            worker.stub.Embed(worker_pb2.EmbedRequest(model_id="llama", texts=["hi"]), timeout=60)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, "a decoder cannot embed"
    finally:
        worker.unload_model("bert")


def _bert_reference(sequences: list[list[int]]) -> np.ndarray:
    """Normalized reference embeddings of the bert-st golden, each sequence alone, with the linear
    rounding of the worker's padded plan for them."""
    from gpu_worker.checkpoints import Checkpoint
    from gpu_worker.models.encoder import padded_shape
    from gpu_worker.models.reference import EncoderReference
    with Checkpoint.open(GOLDEN / "bert-st", max_context=256) as ckpt:
        cfg, host = ckpt.cfg, ckpt.host_weights()
    batch, seq = padded_shape([len(s) for s in sequences], cfg.max_context)
    pooled = EncoderReference(cfg, host).embed(sequences, rows=batch * seq)
    return pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
