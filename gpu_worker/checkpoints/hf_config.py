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
Every file is read through the checkpoint's `CheckpointFiles` (the model-root sandbox, including
each sentence-transformers module `path`), and every field through `schema.Fields`: a type and a
bounded range checked before the value is used, so no malformed config reaches arithmetic
(a zero head count, an infinity, a list where an object belongs are INVALID_ARGUMENT).
"""
from __future__ import annotations

import pathlib
from dataclasses import dataclass

from gpu_worker.checkpoints.paths import CheckpointError, CheckpointFiles
from gpu_worker.checkpoints.schema import (
    MAX_CONFIG_BYTES,
    MAX_EOS_IDS,
    MAX_FFN,
    MAX_HEADS,
    MAX_HIDDEN,
    MAX_LAYERS,
    MAX_MODULES,
    MAX_POSITIONS,
    MAX_ROPE_FACTOR,
    MAX_ROPE_THETA,
    MAX_TOKEN_ID,
    MAX_VOCAB,
    Fields,
    parse_json,
    quote,
)
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
_EPS_MAX = 1.0


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


def _read_json(files: CheckpointFiles, rel: str) -> object:
    """A small JSON file of the checkpoint (config.json and its kin), through the sandbox."""
    name = files.name(rel)
    if not files.exists(rel):
        raise CheckpointError(f"{name} is missing from the checkpoint directory", file=name)
    return parse_json(files.read_bytes(rel, MAX_CONFIG_BYTES, "config file"), name)


def _read_fields(files: CheckpointFiles, rel: str) -> Fields:
    return Fields(_read_json(files, rel), files.name(rel))


def _eos(f: Fields) -> tuple[int, ...]:
    """eos_token_id: a token id or a list of them (an id the vocab lacks is never generated, so
    it is harmless; a list may name ids of a larger tokenizer)."""
    value = f.raw.get("eos_token_id")
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if len(ids) > MAX_EOS_IDS or not all(isinstance(v, int) and not isinstance(v, bool)
                                         and 0 <= v <= MAX_TOKEN_ID for v in ids):
        raise f.fail("eos_token_id", f"must be a token id (0 to {MAX_TOKEN_ID}) or a list of at "
                     f"most {MAX_EOS_IDS} of them, found {quote(value)}")
    return tuple(ids)


def _rope(f: Fields) -> tuple[float, Llama3Scaling | None]:
    # transformers v5 moves theta and the scaling into `rope_parameters`; accept both spellings.
    params = f.obj("rope_parameters")
    theta = (params if params is not None and params.has("rope_theta") else f).number(
        "rope_theta", 0.0, MAX_ROPE_THETA, 10000.0, above=True)
    scaling = f.obj("rope_scaling")
    if scaling is None and params is not None and (params.has("rope_type") or params.has("type")):
        scaling = params
    if scaling is None:
        return theta, None
    kind = scaling.str("rope_type", None) if scaling.has("rope_type") else scaling.str("type", "default")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise FailedPrecondition(f"{scaling.where}: rope scaling of type {quote(kind)} is not "
                                 "supported (only 'llama3')")
    low = scaling.number("low_freq_factor", 0.0, MAX_ROPE_FACTOR, above=True)
    high = scaling.number("high_freq_factor", low, MAX_ROPE_FACTOR, above=True)
    return theta, Llama3Scaling(scaling.number("factor", 0.0, MAX_ROPE_FACTOR, above=True), low,
                                high, scaling.int("original_max_position_embeddings", 1,
                                                  MAX_POSITIONS))


def _architecture(f: Fields) -> str:
    archs = f.str_list("architectures", 16)
    arch = archs[0] if len(archs) == 1 else None
    if arch not in SUPPORTED:
        found = archs or (f.raw.get("model_type") if isinstance(f.raw.get("model_type"), str) else None)
        raise InvalidArgument(f"{f.where}: architecture {quote(found)} is not supported; "
                              f"{SUPPORTED_TEXT}", architecture=quote(archs))
    return arch


def _shape(f: Fields, positions_default: int) -> tuple[int, int, int, int, int, int]:
    """(hidden, heads, layers, ffn, vocab, positions), each a positive integer within its bound."""
    return (f.int("hidden_size", 1, MAX_HIDDEN), f.int("num_attention_heads", 1, MAX_HEADS),
            f.int("num_hidden_layers", 1, MAX_LAYERS), f.int("intermediate_size", 1, MAX_FFN),
            f.int("vocab_size", 1, MAX_VOCAB),
            f.int("max_position_embeddings", 1, MAX_POSITIONS, positions_default))


def read_spec(directory: pathlib.Path, max_context: int,
              files: CheckpointFiles | None = None) -> CheckpointSpec:
    """Parse config.json (through `files`, the checkpoint's sandbox; by default the directory is
    its own root); serve min(max_position_embeddings, max_context) tokens. Every field is checked
    for type and range before any is used (schema.py's bounds)."""
    files = files or CheckpointFiles(directory)
    f = _read_fields(files, "config.json")
    arch = _architecture(f)
    if arch in ENCODERS:
        return _bert_spec(files, f, arch, max_context)
    gptq_group, gptq_v2 = _gptq(files, f)
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise InvalidArgument(f"{f.where}: hidden_act {quote(act)}; {arch} is served with SiLU only")
    if f.bool("mlp_bias", False) or (arch != "Qwen2ForCausalLM" and f.bool("attention_bias", False)):
        raise FailedPrecondition(f"{f.where}: mlp_bias / attention_bias are not supported")
    hidden, heads, layers, ffn, vocab, positions = _shape(f, max_context)
    kv_heads = f.int("num_key_value_heads", 1, heads, heads)
    eps = f.number("rms_norm_eps", 0.0, _EPS_MAX, 1e-6, above=True)
    head_dim = f.int("head_dim", 1, MAX_HIDDEN, hidden // heads)
    if head_dim != hidden // heads:
        raise FailedPrecondition(f"{f.where}: head_dim {head_dim} != hidden_size / "
                                 f"num_attention_heads ({hidden // heads}) is not supported")
    served = min(positions, max_context)
    window = f.int("sliding_window", 1, MAX_POSITIONS, 0) or None
    uses_window = f.bool("use_sliding_window", arch == "MistralForCausalLM")
    if window is not None and uses_window and window < served:
        raise FailedPrecondition(
            f"{f.where}: sliding_window {window} is shorter than the served context of {served} "
            "tokens; sliding-window attention is not supported (lower the worker's "
            "--checkpoint-context to at most the window)", sliding_window=window)
    theta, scaling = _rope(f)
    tied = f.bool("tie_word_embeddings", False)  # LlamaConfig and Qwen2Config default
    eos = _eos(f)
    if files.exists("generation_config.json"):
        eos = _eos(_read_fields(files, "generation_config.json")) or eos
    cfg = ModelConfig(files.path.name or "checkpoint", "decoder", vocab_size=vocab, hidden=hidden,
                      layers=layers, heads=heads, kv_heads=kv_heads, ffn=ffn, max_context=served,
                      eps=eps, rope_theta=theta, qkv_bias=arch == "Qwen2ForCausalLM",
                      rope_scaling=scaling)
    return CheckpointSpec(cfg, arch, tied, eos, gptq_group=gptq_group, gptq_v2=gptq_v2)


def _gptq(files: CheckpointFiles, f: Fields) -> tuple[int, bool]:
    """(group size, v2 zeros) of a pre-quantized GPTQ checkpoint; (0, False) when unquantized.
    Symmetric 4-bit GPTQ without act-order maps exactly onto our blocks of 32 (each group's scale
    repeated, nibble q standing for q - 8), so it loads without requantizing; anything else is
    refused."""
    quant = f.obj("quantization_config")
    if (quant is None or not quant.raw) and files.exists("quantize_config.json"):
        separate = _read_fields(files, "quantize_config.json")
        quant = Fields({"quant_method": "gptq", **separate.raw}, separate.where)
    if quant is None or not quant.raw:
        return 0, False
    method = quant.str("quant_method", "?")
    bits = quant.int("bits", 1, 64, 0)
    sym = quant.bool("sym", True)
    if method != "gptq" or bits != 4 or not sym:
        raise InvalidArgument(f"{quant.where}: quantization {quote(method)} (bits {bits}, sym "
                              f"{sym}) is not supported; {SUPPORTED_TEXT}", quant_method=quote(method))
    group = quant.int("group_size", -1, MAX_HIDDEN * 4, 128)
    fmt = quant.str("checkpoint_format", "gptq")
    desc_act = quant.bool("desc_act", False)
    if desc_act or (group != -1 and (group <= 0 or group % QUANT_BLOCK)) \
            or fmt not in ("gptq", "gptq_v2"):
        raise FailedPrecondition(f"GPTQ with desc_act {desc_act}, group_size {group}, "
                                 f"checkpoint_format {quote(fmt)} is not supported; {SUPPORTED_TEXT}")
    return group, fmt == "gptq_v2"


def _bert_spec(files: CheckpointFiles, f: Fields, arch: str, max_context: int) -> CheckpointSpec:
    position_type = f.str("position_embedding_type", "absolute")
    if position_type != "absolute":
        raise FailedPrecondition(f"{f.where}: position_embedding_type {quote(position_type)}; "
                                 "only 'absolute' is supported")
    act = f.str("hidden_act", "gelu")
    if act not in _GELU:
        raise InvalidArgument(f"{f.where}: hidden_act {quote(act)}; BERT is served with {sorted(_GELU)}")
    if f.raw.get("quantization_config"):
        raise InvalidArgument(f"{f.where}: quantized BERT checkpoints are not supported; {SUPPORTED_TEXT}")
    hidden, heads, layers, ffn, vocab, positions = _shape(f, 512)
    eps = f.number("layer_norm_eps", 0.0, _EPS_MAX, 1e-12, above=True)
    normalize = files.exists("modules.json") and _modules(files)
    cfg = ModelConfig(files.path.name or "checkpoint", "encoder", vocab_size=vocab, hidden=hidden,
                      layers=layers, heads=heads, kv_heads=heads, ffn=ffn,
                      max_context=min(positions, max_context), eps=eps, linear_bias=True,
                      gelu_exact=_GELU[act])
    return CheckpointSpec(cfg, arch, False, (), positions=positions, normalize=normalize)


def _modules(files: CheckpointFiles) -> bool:
    """Check a sentence-transformers modules.json (Transformer, mean Pooling, Normalize); True
    when it lists Normalize. Each module's `path` is a hostile name: read through the sandbox."""
    name = files.name("modules.json")
    modules = _read_json(files, "modules.json")
    if not isinstance(modules, list) or len(modules) > MAX_MODULES:
        raise CheckpointError(f"{name} is not a list of at most {MAX_MODULES} modules", file=name)
    normalize = False
    for i, raw in enumerate(modules):
        module = Fields(raw, f"{name}[{i}]")
        kind = module.str("type", "")
        if kind.endswith("Normalize"):
            normalize = True
        elif kind.endswith("Pooling"):
            path = module.str("path", "")
            rel = f"{path.rstrip('/')}/config.json" if path else "config.json"
            pooling = _read_fields(files, rel)
            modes = {k: pooling.bool(k, False) for k in pooling.raw if k.startswith("pooling_mode_")}
            other = [k for k, on in modes.items() if on and k != "pooling_mode_mean_tokens"]
            if other or not modes.get("pooling_mode_mean_tokens", False):
                raise FailedPrecondition(f"{pooling.where}: pooling {other} is not supported; "
                                         "only mean pooling")
        elif not kind.endswith("Transformer"):
            raise FailedPrecondition(f"{name}: module {quote(kind)} is not supported "
                                     "(Transformer, mean Pooling and Normalize are)")
    return normalize
