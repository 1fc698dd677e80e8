"""HF tensor names -> our weight keys, and how each is converted.

Name mapping (Llama, Mistral and Qwen2 share it):
  model.embed_tokens.weight -> embed (f16)         model.norm.weight -> final_norm.w (f32)
  model.layers.{i}.input_layernorm.weight -> layers.{i}.attn_norm.w
  model.layers.{i}.post_attention_layernorm.weight -> layers.{i}.mlp_norm.w
  model.layers.{i}.self_attn.{q,k,v,o}_proj.weight -> layers.{i}.w{q,k,v,o}.{q,s} (int4)
  model.layers.{i}.self_attn.{q,k,v}_proj.bias -> layers.{i}.w{q,k,v}.b (Qwen2, f32)
  model.layers.{i}.mlp.{gate,up,down}_proj.weight -> layers.{i}.w_{gate,up,down}.{q,s} (int4)
  lm_head.weight -> lm_head.{q,s}; with tied embeddings, the embedding table quantized
BERT ([bert.] prefix optional; LayerNorm gamma/beta accepted for weight/bias):
  embeddings.word_embeddings -> embed; embeddings.position_embeddings (first max_context rows)
  + token_type_embeddings row 0 -> pos_embed; embeddings.LayerNorm -> embed_norm.{w,b}
  encoder.layer.{i}.attention.self.{query,key,value}, attention.output.dense, intermediate.dense,
  output.dense -> layers.{i}.{wq,wk,wv,wo,w_up,w_down} (int4 + .b biases);
  attention.output.LayerNorm -> attn_norm, output.LayerNorm -> mlp_norm
"""
from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.checkpoints.hf_config import CheckpointSpec

_LINEARS = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
            "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
            "w_down": "mlp.down_proj"}


@dataclass(frozen=True)
class Source:
    """Where one of our weights comes from: an HF tensor, and how it is converted."""
    hf_name: str
    kind: str                    # "table" (f16) | "vector" (f32) | "int4" (.q/.s pair) |
                                 # "gptq" (.q/.s pair from `<hf_name>.qweight/.qzeros/.scales`)
    shape: tuple[int, ...]       # ours
    hf_shape: tuple[int, ...] | None = None  # the stored one, where it differs (position table)
    plus_row0: str = ""          # BERT: token-type row 0 folded into the position table


# BERT (sentence-transformers layout): our encoder weight -> the tensor under `encoder.layer.{i}.`
_BERT_LINEARS = {"wq": "attention.self.query", "wk": "attention.self.key",
                 "wv": "attention.self.value", "wo": "attention.output.dense",
                 "w_up": "intermediate.dense", "w_down": "output.dense"}
_BERT_NORMS = {"attn_norm": "attention.output.LayerNorm", "mlp_norm": "output.LayerNorm"}


def sources(spec: CheckpointSpec, prefix: str = "") -> dict[str, Source]:
    """Our weight name (without .q/.s) -> its HF source, in load order. `prefix`: "bert." for
    BERT checkpoints saved from a task model, "" for a bare BertModel."""
    if spec.cfg.family == "encoder":
        return _encoder_sources(spec, prefix)
    cfg = spec.cfg
    h, kvd = cfg.hidden, cfg.kv_heads * cfg.head_dim
    out = {"embed": Source("model.embed_tokens.weight", "table", (cfg.vocab_size, h))}
    shapes = cfg.linear_shapes()
    for i in range(cfg.layers):
        hf, p = f"model.layers.{i}.", f"layers.{i}."
        out[p + "attn_norm.w"] = Source(hf + "input_layernorm.weight", "vector", (h,))
        out[p + "mlp_norm.w"] = Source(hf + "post_attention_layernorm.weight", "vector", (h,))
        for lin, name in _LINEARS.items():
            out[p + lin] = (Source(hf + name, "gptq", shapes[lin]) if spec.gptq_group
                            else Source(hf + name + ".weight", "int4", shapes[lin]))
        if cfg.qkv_bias:
            for lin, dim in (("wq", h), ("wk", kvd), ("wv", kvd)):
                out[p + lin + ".b"] = Source(hf + _LINEARS[lin] + ".bias", "vector", (dim,))
    out["final_norm.w"] = Source("model.norm.weight", "vector", (h,))
    head = "model.embed_tokens.weight" if spec.tied_embeddings else "lm_head.weight"
    out["lm_head"] = Source(head, "int4", (cfg.vocab_size, h))
    return out


def _encoder_sources(spec: CheckpointSpec, prefix: str) -> dict[str, Source]:
    cfg, h, e = spec.cfg, spec.cfg.hidden, prefix + "embeddings."
    out = {"embed": Source(e + "word_embeddings.weight", "table", (cfg.vocab_size, h)),
           "pos_embed": Source(e + "position_embeddings.weight", "table", (cfg.max_context, h),
                               (spec.positions, h), e + "token_type_embeddings.weight"),
           "embed_norm.w": Source(e + "LayerNorm.weight", "vector", (h,)),
           "embed_norm.b": Source(e + "LayerNorm.bias", "vector", (h,))}
    shapes = cfg.linear_shapes()
    for i in range(cfg.layers):
        hf, p = f"{prefix}encoder.layer.{i}.", f"layers.{i}."
        for ours, theirs in _BERT_NORMS.items():
            out[p + ours + ".w"] = Source(hf + theirs + ".weight", "vector", (h,))
            out[p + ours + ".b"] = Source(hf + theirs + ".bias", "vector", (h,))
        for lin, name in _BERT_LINEARS.items():
            out[p + lin] = Source(hf + name + ".weight", "int4", shapes[lin])
            out[p + lin + ".b"] = Source(hf + name + ".bias", "vector", (shapes[lin][0],))
    return out
