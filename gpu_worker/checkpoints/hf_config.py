"""`config.json` (+ `generation_config.json`) of a Hugging Face checkpoint -> our `ModelConfig`.

What is supported, and the message every refusal repeats:
- LlamaForCausalLM (Llama 2, 3, 3.1, 3.2: GQA, rope_scaling "llama3", tied embeddings),
- MistralForCausalLM (no sliding window shorter than the served context),
- Qwen2ForCausalLM (q/k/v biases, tied embeddings);
- for Embed, BertModel (and BERT task models, whose `bert.` prefix is skipped) as
  sentence-transformers ship it: absolute positions, post-LayerNorm, GELU, mean pooling, and
  unit-length output when modules.json lists a Normalize module;
unquantized F32/F16/BF16 weights, quantized to our int4 block format on load, or symmetric 4-bit
GPTQ without act-order (group size a multiple of 32), taken over without requantizing.
Refusals: an unknown architecture or a malformed config is INVALID_ARGUMENT; a known model whose
feature we lack (act-order GPTQ, another rope scaling, a short sliding window) is
FAILED_PRECONDITION, since the checkpoint itself is fine.
"""
from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

from gpu_worker.models.configs import QUANT_BLOCK, ModelConfig
from gpu_worker.models.rope import Llama3Scaling
from services.common.errors import FailedPrecondition, InvalidArgument

DECODERS = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
ENCODERS = ("BertModel", "BertForMaskedLM", "BertForPreTraining")
SUPPORTED = DECODERS + ENCODERS
SUPPORTED_TEXT = ("supported: LlamaForCausalLM, MistralForCausalLM and Qwen2ForCausalLM (Generate), "
                  "BertModel (Embed), with F32/F16/BF16 safetensors (quantized to int4 on load) "
                  f"or symmetric 4-bit GPTQ without act-order, group size a multiple of {QUANT_BLOCK}")
# transformers' activation names: "gelu" is the erf form; these two are the tanh approximation
_GELU = {"gelu": True, "gelu_new": False, "gelu_pytorch_tanh": False}


@dataclass(frozen=True)
class CheckpointSpec:
    """What the loader needs beyond the shapes: which tensors exist and how generation stops."""
    cfg: ModelConfig
    architecture: str
    tied_embeddings: bool
    eos_token_ids: tuple[int, ...]
    positions: int = 0          # the checkpoint's max_position_embeddings (rows of a BERT table)
    gptq_group: int = 0         # pre-quantized GPTQ: its group size (-1: one group); 0: unquantized
    gptq_v2: bool = False       # GPTQ v2 stores the true zero point (v1 stores zero - 1)
    normalize: bool = False     # encoders: sentence-transformers' Normalize module is present


def _read_json(path: pathlib.Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidArgument(f"{path.name} is missing from the checkpoint directory",
                              file=str(path)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{path.name} is not valid JSON ({exc})", file=str(path)) from None
    if not isinstance(data, dict):
        raise InvalidArgument(f"{path.name} is not a JSON object", file=str(path))
    return data


def _eos(value: object) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, int) for v in value):
        return tuple(value)
    raise InvalidArgument(f"eos_token_id must be an integer or a list of integers, got {value!r}")


def _rope(raw: dict) -> tuple[float, Llama3Scaling | None]:
    # transformers v5 moves theta and the scaling into `rope_parameters`; accept both spellings.
    params = raw.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = raw.get("rope_scaling") or (params if "rope_type" in params or "type" in params else None)
    if not scaling:
        return theta, None
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return theta, None
    if kind != "llama3":
        raise FailedPrecondition(f"rope_scaling of type {kind!r} is not supported (only 'llama3')")
    try:
        return theta, Llama3Scaling(float(scaling["factor"]), float(scaling["low_freq_factor"]),
                                    float(scaling["high_freq_factor"]),
                                    int(scaling["original_max_position_embeddings"]))
    except (KeyError, TypeError, ValueError):
        raise InvalidArgument(f"rope_scaling {scaling!r} lacks a llama3 field") from None


def read_spec(directory: pathlib.Path, max_context: int) -> CheckpointSpec:
    """Parse `directory/config.json`; serve min(max_position_embeddings, max_context) tokens."""
    raw = _read_json(directory / "config.json")
    archs = raw.get("architectures") or []
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED:
        raise InvalidArgument(f"config.json: architecture {archs or raw.get('model_type')!r} is not "
                              f"supported; {SUPPORTED_TEXT}", architecture=str(archs))
    if arch in ENCODERS:
        return _bert_spec(directory, raw, arch, max_context)
    gptq_group, gptq_v2 = _gptq(directory, raw)
    if raw.get("hidden_act", "silu") != "silu":
        raise InvalidArgument(f"config.json: hidden_act {raw['hidden_act']!r}; {arch} is served "
                              "with SiLU only")
    if raw.get("mlp_bias") or (arch != "Qwen2ForCausalLM" and raw.get("attention_bias")):
        raise FailedPrecondition("config.json: mlp_bias / attention_bias are not supported")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        layers, ffn, vocab = (int(raw["num_hidden_layers"]), int(raw["intermediate_size"]),
                              int(raw["vocab_size"]))
        positions = int(raw.get("max_position_embeddings", max_context))
        eps = float(raw.get("rms_norm_eps", 1e-6))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"config.json: field {exc} is missing or not a number") from None
    if raw.get("head_dim") not in (None, hidden // heads):
        raise FailedPrecondition(f"config.json: head_dim {raw['head_dim']} != hidden_size / "
                                 f"num_attention_heads ({hidden // heads}) is not supported")
    served = min(positions, max_context)
    window = raw.get("sliding_window")
    uses_window = raw.get("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and uses_window and int(window) < served:
        raise FailedPrecondition(
            f"config.json: sliding_window {window} is shorter than the served context of {served} "
            "tokens; sliding-window attention is not supported (lower the worker's "
            "--checkpoint-context to at most the window)", sliding_window=int(window))
    theta, scaling = _rope(raw)
    tied = bool(raw.get("tie_word_embeddings", False))  # LlamaConfig and Qwen2Config default
    eos = _eos(raw.get("eos_token_id"))
    gen = directory / "generation_config.json"
    if gen.exists():
        eos = _eos(_read_json(gen).get("eos_token_id")) or eos
    cfg = ModelConfig(directory.name or "checkpoint", "decoder", vocab_size=vocab, hidden=hidden,
                      layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, max_context=served,
                      eps=eps, rope_theta=theta, qkv_bias=arch == "Qwen2ForCausalLM",
                      rope_scaling=scaling)
    return CheckpointSpec(cfg, arch, tied, eos, gptq_group=gptq_group, gptq_v2=gptq_v2)


def _gptq(directory: pathlib.Path, raw: dict) -> tuple[int, bool]:
    """(group size, v2 zeros) of a pre-quantized GPTQ checkpoint; (0, False) when unquantized.
    Symmetric 4-bit GPTQ without act-order maps exactly onto our blocks of 32 (each group's scale
    repeated, nibble q standing for q - 8), so it loads without requantizing; anything else is
    refused."""
    quant = raw.get("quantization_config")
    separate = directory / "quantize_config.json"
    if not quant and separate.exists():
        quant = {"quant_method": "gptq", **_read_json(separate)}
    if not quant:
        return 0, False
    method = quant.get("quant_method", "?")
    supported = SUPPORTED_TEXT
    if method != "gptq" or quant.get("bits") != 4 or not quant.get("sym", True):
        raise InvalidArgument(f"config.json: quantization {method!r} (bits {quant.get('bits')}, "
                              f"sym {quant.get('sym', True)}) is not supported; {supported}",
                              quant_method=str(method))
    group = int(quant.get("group_size", 128))
    fmt = quant.get("checkpoint_format", "gptq")
    if quant.get("desc_act") or (group != -1 and (group <= 0 or group % QUANT_BLOCK)) \
            or fmt not in ("gptq", "gptq_v2"):
        raise FailedPrecondition(f"GPTQ with desc_act {quant.get('desc_act')}, group_size {group}, "
                                 f"checkpoint_format {fmt!r} is not supported; {supported}")
    return group, fmt == "gptq_v2"



def _bert_spec(directory: pathlib.Path, raw: dict, arch: str, max_context: int) -> CheckpointSpec:
    if raw.get("position_embedding_type", "absolute") != "absolute":
        raise FailedPrecondition(f"config.json: position_embedding_type "
                                 f"{raw['position_embedding_type']!r}; only 'absolute' is supported")
    act = raw.get("hidden_act", "gelu")
    if act not in _GELU:
        raise InvalidArgument(f"config.json: hidden_act {act!r}; BERT is served with {sorted(_GELU)}")
    if raw.get("quantization_config"):
        raise InvalidArgument(f"config.json: quantized BERT checkpoints are not supported; {SUPPORTED_TEXT}")
    try:
        hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
        layers, ffn, vocab = (int(raw["num_hidden_layers"]), int(raw["intermediate_size"]),
                              int(raw["vocab_size"]))
        positions = int(raw.get("max_position_embeddings", 512))
        eps = float(raw.get("layer_norm_eps", 1e-12))
    except (KeyError, TypeError, ValueError) as exc:
        raise InvalidArgument(f"config.json: field {exc} is missing or not a number") from None
    normalize = False
    modules = directory / "modules.json"
    if modules.exists():
        for module in _read_json_list(modules):
            kind = str(module.get("type", ""))
            if kind.endswith("Normalize"):
                normalize = True
            elif kind.endswith("Pooling"):
                pooling = _read_json(directory / str(module.get("path", "")) / "config.json")
                other = [k for k, v in pooling.items()
                         if k.startswith("pooling_mode_") and v and k != "pooling_mode_mean_tokens"]
                if other or not pooling.get("pooling_mode_mean_tokens", False):
                    raise FailedPrecondition(f"{module.get('path')}/config.json: pooling {other} is "
                                             "not supported; only mean pooling")
            elif not kind.endswith("Transformer"):
                raise FailedPrecondition(f"modules.json: module {kind!r} is not supported "
                                         "(Transformer, mean Pooling and Normalize are)")
    cfg = ModelConfig(directory.name or "checkpoint", "encoder", vocab_size=vocab, hidden=hidden,
                      layers=layers, heads=heads, kv_heads=heads, ffn=ffn,
                      max_context=min(positions, max_context), eps=eps, linear_bias=True,
                      gelu_exact=_GELU[act])
    return CheckpointSpec(cfg, arch, False, (), positions=positions, normalize=normalize)


def _read_json_list(path: pathlib.Path) -> list[dict]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{path.name} is not valid JSON ({exc})", file=str(path)) from None
    if not isinstance(data, list) or not all(isinstance(m, dict) for m in data):
        raise InvalidArgument(f"{path.name} is not a list of modules", file=str(path))
    return data
