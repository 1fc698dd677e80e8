"""Build tiny random Hugging Face checkpoints with `transformers` and record its outputs as goldens.

Run in a separate environment that has torch (CPU) and transformers, never the project's:
    python -m venv /tmp/peer-venv && /tmp/peer-venv/bin/pip install torch transformers tokenizers numpy
    /tmp/peer-venv/bin/python scripts/make_checkpoint_goldens.py tests/checkpoints/golden

For each model (Llama with llama3 rope scaling, sharded; Llama tied; Qwen2 tied; Qwen2 untied) it
writes `<name>/` (config.json, bf16 safetensors, generation_config.json) and `<name>.npz`:
  prompts     int32 (P, L)       prompts fed to the peer
  logits      float32 (P, vocab) transformers' fp32 logits at each prompt's last position
  greedy      int32 (P, 16)      transformers' greedy tokens
The peer runs on the weights our loader serves: every linear dequantized from our int4 block
format (gpu_worker.models.weights.quantize), the embedding table rounded to fp16, so the goldens
check the loader's mapping and our graph, not the quantization error.
The Llama directory also gets a tokenizer.json (a byte-level BPE trained here) and
`tokenizer.npz`: transformers' ids for sample texts and its decoding of them.
`bert-st/` is a BertModel in the sentence-transformers layout (modules.json, mean Pooling,
Normalize, a WordPiece tokenizer.json, names without the `bert.` prefix, exact GELU) and
`bert-st.npz` transformers' mean-pooled, normalized embeddings of token sequences and of texts.
`llama-gptq/` is a Llama in GPTQ v1 layout (sym, 4-bit, group 128, no act-order, lm_head float),
`llama-gptq.npz` transformers' outputs on its dequantized weights plus one dequantized linear.

`--fp16-peer` (issue 15, `weight_format: fp16`): reads the checkpoints already in the directory
(changes none of them) and writes `<name>-fp16.npz` for every float checkpoint: the peer in fp32 on
the weights the fp16 load serves (every linear and the embedding tables rounded to fp16, the rest
f32), same arrays as above (`embeddings` for bert-st).
    /tmp/peer-venv/bin/python scripts/make_checkpoint_goldens.py --fp16-peer tests/checkpoints/golden
"""
from __future__ import annotations

import json
import pathlib
import sys

import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
from gpu_worker.models.weights import quantize

VOCAB = 288
STEPS = 16
PROMPTS = [[1, 17, 42, 99, 7, 250, 3, 64], [5, 200, 11, 11, 140, 33, 8, 2]]
TEXTS = ["Hello, world!", "gpuplane serves checkpoints — naïve café 日本語 🙂", "  spaces\tand\nlines "]
CORPUS = ("the quick brown fox jumps over the lazy dog. hello world, hello gpuplane. "
          "checkpoints are loaded from safetensors and quantized on load. ") * 20

SHAPES = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
          "initializer_range": 0.25, "bos_token_id": 1, "eos_token_id": 2}


def models_to_build() -> dict[str, tuple[type, object]]:
    return {
        "llama-llama3-sharded": (LlamaForCausalLM, LlamaConfig(
            **SHAPES, rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 32})),
        "llama-tied": (LlamaForCausalLM, LlamaConfig(**SHAPES, rms_norm_eps=1e-5,
                                                     tie_word_embeddings=True)),
        "qwen2-tied": (Qwen2ForCausalLM, Qwen2Config(**SHAPES, rms_norm_eps=1e-6,
                                                     rope_theta=1000000.0, tie_word_embeddings=True)),
        "qwen2-untied": (Qwen2ForCausalLM, Qwen2Config(**SHAPES, rms_norm_eps=1e-6,
                                                       rope_theta=1000000.0, tie_word_embeddings=False)),
    }


def roundtrip(w: torch.Tensor) -> torch.Tensor:
    """The float32 weight our int4 kernels compute with."""
    return torch.from_numpy(quantize(w.float().numpy()).dequantize())


def served_weights(model: torch.nn.Module, tied: bool) -> dict[str, torch.Tensor]:
    """The state dict as our loader serves it (int4 linears, fp16 embedding, f32 rest)."""
    state = {k: v.float().clone() for k, v in model.state_dict().items()}
    embed = state["model.embed_tokens.weight"]
    out = {}
    for name, value in state.items():
        if name == "model.embed_tokens.weight":
            out[name] = value.half().float()
        elif name.endswith("_proj.weight") or name == "lm_head.weight":
            out[name] = roundtrip(value)
        else:
            out[name] = value
    out["lm_head.weight"] = roundtrip(embed if tied else state["lm_head.weight"])
    return out


def greedy(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = []
    with torch.no_grad():
        for _ in range(STEPS):
            nxt = int(model(ids).logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out


def build(root: pathlib.Path, name: str, cls: type, config) -> None:
    torch.manual_seed(sum(map(ord, name)))
    model = cls(config).eval()
    with torch.no_grad():  # non-trivial norms and biases, so a mapping mistake shows
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith(".bias"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in pname
                        else torch.empty_like(p).uniform_(-0.5, 0.5))
    model = model.to(torch.bfloat16)
    shard = "20KB" if "sharded" in name else "10GB"
    model.save_pretrained(root / name, safe_serialization=True, max_shard_size=shard)

    # The peer: the same architecture in fp32, untied, on the weights we serve.
    peer_cfg = cls.config_class.from_dict({**config.to_dict(), "tie_word_embeddings": False})
    peer = cls(peer_cfg).eval()
    peer.load_state_dict(served_weights(model, config.tie_word_embeddings), strict=True)
    with torch.no_grad():
        logits = np.stack([peer(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
    np.savez_compressed(root / f"{name}.npz", prompts=np.array(PROMPTS, np.int32),
                        logits=logits.astype(np.float32),
                        greedy=np.array([greedy(peer, p) for p in PROMPTS], np.int32))


def build_tokenizer(directory: pathlib.Path, root: pathlib.Path) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 3, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([CORPUS], trainer)
    tok.save(str(directory / "tokenizer.json"))
    hf = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    ids = [hf.encode(t, add_special_tokens=False) for t in TEXTS]
    width = max(map(len, ids))
    padded = np.full((len(ids), width), -1, np.int32)
    for i, row in enumerate(ids):
        padded[i, :len(row)] = row
    np.savez_compressed(root / "tokenizer.npz", texts=np.array(TEXTS), ids=padded,
                        decoded=np.array([hf.decode(r) for r in ids]))


def build_bert(root: pathlib.Path) -> None:
    name, directory = "bert-st", root / "bert-st"
    torch.manual_seed(sum(map(ord, name)))
    config = BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, type_vocab_size=2,
                        hidden_act="gelu", initializer_range=0.25, layer_norm_eps=1e-12)
    model = BertModel(config, add_pooling_layer=False).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "LayerNorm" in pname or pname.endswith(".bias"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if pname.endswith("LayerNorm.weight")
                        else torch.empty_like(p).uniform_(-0.5, 0.5))
    model.to(torch.bfloat16).save_pretrained(directory, safe_serialization=True)
    (directory / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ], indent=2))
    (directory / "1_Pooling").mkdir(exist_ok=True)
    (directory / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": False,
        "pooling_mode_mean_tokens": True, "pooling_mode_max_tokens": False}, indent=2))
    # A fixed vocabulary (the WordPiece trainer's order varies between runs): specials, the
    # corpus's words, then every character alone and as a continuation.
    chars = sorted(set("abcdefghijklmnopqrstuvwxyz0123456789.,!?'-"))
    words = sorted(set(CORPUS.replace(".", " ").replace(",", " ").split()))
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words, *chars, *("##" + c for c in chars)]
    assert len(vocab) <= VOCAB
    tok = Tokenizer(models.WordPiece({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = __import__("tokenizers").normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = __import__("tokenizers").processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)])
    tok.save(str(directory / "tokenizer.json"))

    state = {k: v.float().clone() for k, v in model.state_dict().items()}
    served = {}
    for k, v in state.items():
        if k == "embeddings.word_embeddings.weight":
            served[k] = v.half().float()
        elif k == "embeddings.position_embeddings.weight":  # token type 0 folded in, as we load it
            served[k] = (v + state["embeddings.token_type_embeddings.weight"][0]).half().float()
        elif k == "embeddings.token_type_embeddings.weight":
            served[k] = torch.zeros_like(v)
        elif k.endswith(".weight") and "LayerNorm" not in k:
            served[k] = roundtrip(v)
        else:
            served[k] = v
    peer = BertModel(config, add_pooling_layer=False).eval()
    peer.load_state_dict(served, strict=True)

    def embed(ids: list[list[int]]) -> np.ndarray:
        with torch.no_grad():
            h = peer(torch.tensor(ids)).last_hidden_state.mean(dim=1)
        return torch.nn.functional.normalize(h, dim=-1).numpy()

    sequences = [[2, 17, 42, 99, 7, 250, 3], [2, 5, 200, 11, 140, 33, 3]]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"))
    texts = ["hello world", "the lazy dog jumps over the quick brown fox"]
    text_vectors = np.concatenate([embed([hf.encode(t)]) for t in texts])
    np.savez_compressed(root / f"{name}.npz", sequences=np.array(sequences, np.int32),
                        embeddings=embed(sequences), texts=np.array(texts), text_embeddings=text_vectors)


def gptq_pack(w: np.ndarray, group: int, v2: bool) -> dict[str, np.ndarray]:
    """GPTQ's symmetric 4-bit layout of an f32 (out, in) weight (the format's documented packing:
    nibbles along the input, lowest bits first; zeros along the output; v1 stores zero - 1)."""
    out_dim, in_dim = w.shape
    groups = w.reshape(out_dim, in_dim // group, group)
    scales = (np.abs(groups).max(axis=2) / 7.0).astype(np.float16)          # (out, in/g)
    q = np.clip(np.rint(groups / scales.astype(np.float32)[..., None]) + 8, 0, 15)
    q = q.reshape(out_dim, in_dim).astype(np.uint32).T                       # (in, out)
    qweight = np.zeros((in_dim // 8, out_dim), np.uint32)
    for j in range(8):
        qweight |= q[j::8] << np.uint32(4 * j)
    stored_zero = 8 if v2 else 7
    qzeros = np.zeros((in_dim // group, out_dim // 8), np.uint32)
    for j in range(8):
        qzeros |= np.uint32(stored_zero) << np.uint32(4 * j)
    return {"qweight": qweight.view(np.int32), "qzeros": qzeros.view(np.int32),
            "scales": np.ascontiguousarray(scales.T), "g_idx": (np.arange(in_dim) // group).astype(np.int32)}


def gptq_dequant(parts: dict[str, np.ndarray], group: int) -> np.ndarray:
    """w = (q - 8) * scale, straight from the packed tensors (the peer's view of the weight)."""
    words = parts["qweight"].view(np.uint32)
    q = np.stack([(words >> np.uint32(4 * j)) & 0xF for j in range(8)], axis=1).reshape(-1, words.shape[1])
    s = np.repeat(parts["scales"].astype(np.float32), group, axis=0)        # (in, out)
    return ((q.astype(np.float32) - 8.0) * s).T                               # (out, in)


def build_gptq(root: pathlib.Path) -> None:
    """Llama, tied, group 128, GPTQ v1, lm_head left unquantized (the usual layout)."""
    from safetensors.numpy import save_file
    name, directory, group = "llama-gptq", root / "llama-gptq", 128
    torch.manual_seed(sum(map(ord, name)))
    config = LlamaConfig(**{**SHAPES, "hidden_size": 128, "intermediate_size": 256,
                            "num_hidden_layers": 1}, rms_norm_eps=1e-5, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(directory, safe_serialization=True)   # config.json, generation_config.json
    (directory / "model.safetensors").unlink()
    cfg = json.loads((directory / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group,
                                  "desc_act": False, "sym": True, "checkpoint_format": "gptq"}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    tensors, served = {}, {}
    for pname, value in model.state_dict().items():
        w = value.float().numpy()
        if pname.endswith("_proj.weight"):
            parts = gptq_pack(w, group, v2=False)
            base = pname.removesuffix(".weight")
            tensors.update({f"{base}.{k}": v for k, v in parts.items()})
            served[pname] = torch.from_numpy(gptq_dequant(parts, group))
        elif pname != "lm_head.weight":
            tensors[pname] = w.astype(np.float16)
            served[pname] = torch.from_numpy(w.astype(np.float16).astype(np.float32))
    embed = tensors["model.embed_tokens.weight"].astype(np.float32)
    served["lm_head.weight"] = roundtrip(torch.from_numpy(embed))   # we quantize the tied head
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    peer = LlamaForCausalLM(LlamaConfig.from_dict({**config.to_dict(), "tie_word_embeddings": False})).eval()
    peer.load_state_dict(served, strict=True)
    with torch.no_grad():
        logits = np.stack([peer(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
    np.savez_compressed(root / f"{name}.npz", prompts=np.array(PROMPTS, np.int32), logits=logits,
                        greedy=np.array([greedy(peer, p) for p in PROMPTS], np.int32),
                        wq0=served["model.layers.0.self_attn.q_proj.weight"].numpy())


def fp16_served(state: dict[str, torch.Tensor], tied_head: str | None) -> dict[str, torch.Tensor]:
    """The state dict as `weight_format: fp16` serves it: linears and tables rounded to fp16."""
    out = {}
    for name, value in state.items():
        v = value.float()
        rounded = name.endswith(".weight") and "norm" not in name.lower() and v.dim() == 2
        out[name] = v.half().float() if rounded else v
    if tied_head:
        out["lm_head.weight"] = out[tied_head].clone()
    return out


def build_fp16_peer(root: pathlib.Path) -> None:
    """`<name>-fp16.npz`: the peer on the fp16-served weights of the committed checkpoints."""
    for name, (cls, config) in models_to_build().items():
        model = cls.from_pretrained(root / name, torch_dtype=torch.float32).eval()
        tied = "model.embed_tokens.weight" if config.tie_word_embeddings else None
        state = fp16_served({k: v for k, v in model.state_dict().items()
                             if not (tied and k == "lm_head.weight")}, tied)
        peer_cfg = cls.config_class.from_dict({**config.to_dict(), "tie_word_embeddings": False})
        peer = cls(peer_cfg).eval()
        peer.load_state_dict(state, strict=True)
        with torch.no_grad():
            logits = np.stack([peer(torch.tensor([p])).logits[0, -1].numpy() for p in PROMPTS])
        np.savez_compressed(root / f"{name}-fp16.npz", prompts=np.array(PROMPTS, np.int32),
                            logits=logits.astype(np.float32),
                            greedy=np.array([greedy(peer, p) for p in PROMPTS], np.int32))
    bert = BertModel.from_pretrained(root / "bert-st", torch_dtype=torch.float32,
                                     add_pooling_layer=False).eval()
    state = {k: v.float().clone() for k, v in bert.state_dict().items()}
    types = state["embeddings.token_type_embeddings.weight"]
    # token type 0 folded into the position table, as the loader does (then rounded to fp16)
    state["embeddings.position_embeddings.weight"] += types[0]
    state["embeddings.token_type_embeddings.weight"] = torch.zeros_like(types)
    served = fp16_served(state, None)
    peer = BertModel(bert.config, add_pooling_layer=False).eval()
    peer.load_state_dict(served, strict=True)
    sequences = np.load(root / "bert-st.npz")["sequences"]
    with torch.no_grad():
        h = peer(torch.tensor(sequences.tolist())).last_hidden_state.mean(dim=1)
    np.savez_compressed(root / "bert-st-fp16.npz", sequences=sequences,
                        embeddings=torch.nn.functional.normalize(h, dim=-1).numpy())


def main() -> None:
    if sys.argv[1:2] == ["--fp16-peer"]:
        build_fp16_peer(pathlib.Path(sys.argv[2] if len(sys.argv) > 2 else "tests/checkpoints/golden"))
        return
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else "tests/checkpoints/golden")
    root.mkdir(parents=True, exist_ok=True)
    for name, (cls, config) in models_to_build().items():
        build(root, name, cls, config)
    build_tokenizer(root / "llama-tied", root)
    build_bert(root)
    build_gptq(root)
    (root / "README.md").write_text(
        "Made by scripts/make_checkpoint_goldens.py with transformers "
        f"{__import__('transformers').__version__} and torch {torch.__version__}; do not edit.\n")
    print(json.dumps(sorted(p.name for p in root.iterdir())))


if __name__ == "__main__":
    main()
