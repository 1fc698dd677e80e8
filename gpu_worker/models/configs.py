"""Named model configurations, from `tiny` (CI on the sim backend, seconds) to sizes that fill
tens of GiB of an H200 (benchmarks).

Shapes follow public model families so the figures mean something: `8b-int4` has Llama-3-8B's
shapes, `large` has Llama-2-70B's trunk (int4: ~36 GiB of weights).
"""
from __future__ import annotations

from dataclasses import dataclass

from gpu_worker.models.rope import Llama3Scaling
from services.common.errors import InvalidArgument

QUANT_BLOCK = 32  # int4 block size along the input dimension; fp16 scale per block
# How linear weights live on the device: "int4" (block-quantized `.q` nibbles + `.s` scales, the
# default) or "fp16" (checkpoints served unquantized: one `.h` fp16 matrix, 2 bytes a weight
# against int4's 4.5 bits: 32/9 of its bytes).
WEIGHT_FORMATS = ("int4", "fp16")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    family: str          # "decoder" | "encoder"
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    max_context: int
    eps: float = 1e-5
    rope_theta: float = 10000.0
    # Structure flags of real checkpoints (gpu_worker/checkpoints): Qwen2's q/k/v biases, and
    # Llama 3.1's rescaled rotary frequencies (carried as the weight `rope.inv_freq`).
    qkv_bias: bool = False
    rope_scaling: Llama3Scaling | None = None
    # BERT checkpoints: a bias on every encoder linear, and the exact (erf) GELU
    linear_bias: bool = False
    gelu_exact: bool = False
    weight_format: str = "int4"   # WEIGHT_FORMATS

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def __post_init__(self) -> None:
        if self.family not in ("decoder", "encoder"):
            raise InvalidArgument(f"unknown model family {self.family!r} (decoder or encoder)")
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise InvalidArgument(f"{self.name}: heads must divide hidden and kv_heads divide heads")
        if self.hidden % QUANT_BLOCK or self.ffn % QUANT_BLOCK:
            raise InvalidArgument(f"{self.name}: hidden and ffn must be multiples of {QUANT_BLOCK}")
        if self.head_dim % 2:
            raise InvalidArgument(f"{self.name}: rotary needs an even head_dim")
        if self.weight_format not in WEIGHT_FORMATS:
            raise InvalidArgument(f"weight_format {self.weight_format!r}: use one of {WEIGHT_FORMATS}")

    def linear_keys(self, name: str) -> list[str]:
        """The weight keys of linear `name`: `.q`/`.s` (int4) or `.h` (fp16)."""
        return [name + ".h"] if self.weight_format == "fp16" else [name + ".q", name + ".s"]

    def linear_sizes(self, out_dim: int, in_dim: int) -> list[int]:
        """Bytes of each of `linear_keys`' tensors for an (out, in) linear."""
        if self.weight_format == "fp16":
            return [out_dim * in_dim * 2]
        return [out_dim * in_dim // 2, out_dim * (in_dim // QUANT_BLOCK) * 2]

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of every linear weight of one layer."""
        h, kv = self.hidden, self.kv_heads * self.head_dim
        if self.family == "decoder":
            return {"wq": (h, h), "wk": (kv, h), "wv": (kv, h), "wo": (h, h),
                    "w_gate": (self.ffn, h), "w_up": (self.ffn, h), "w_down": (h, self.ffn)}
        return {"wq": (h, h), "wk": (h, h), "wv": (h, h), "wo": (h, h),
                "w_up": (self.ffn, h), "w_down": (h, self.ffn)}

    def weight_bytes(self) -> int:
        """Bytes of the weights as stored on the device (int4 + fp16 scales or fp16 linears;
        f32 norms, f16 embed)."""
        from gpu_worker.models.weights import weight_sizes  # one account of every tensor
        return sum(weight_sizes(self))

    def kv_bytes(self, context: int | None = None) -> int:
        """KV cache bytes (f32) for one sequence of `context` tokens."""
        ctx = self.max_context if context is None else context
        return 2 * self.layers * ctx * self.kv_heads * self.head_dim * 2   # fp16 K and V


CONFIGS: dict[str, ModelConfig] = {c.name: c for c in (
    ModelConfig("tiny", "decoder", vocab_size=1024, hidden=64, layers=2, heads=4, kv_heads=2,
                ffn=128, max_context=1024),
    ModelConfig("small", "decoder", vocab_size=8192, hidden=512, layers=8, heads=8, kv_heads=4,
                ffn=1536, max_context=4096),
    ModelConfig("8b-int4", "decoder", vocab_size=128256, hidden=4096, layers=32, heads=32,
                kv_heads=8, ffn=14336, max_context=8192, rope_theta=500000.0),
    ModelConfig("large", "decoder", vocab_size=32000, hidden=8192, layers=80, heads=64,
                kv_heads=8, ffn=28672, max_context=8192),
    ModelConfig("tiny-encoder", "encoder", vocab_size=1024, hidden=64, layers=2, heads=4,
                kv_heads=4, ffn=128, max_context=1024, eps=1e-12),
    ModelConfig("small-encoder", "encoder", vocab_size=8192, hidden=384, layers=6, heads=6,
                kv_heads=6, ffn=1536, max_context=1024, eps=1e-12),
    ModelConfig("large-encoder", "encoder", vocab_size=30522, hidden=1024, layers=24, heads=16,
                kv_heads=16, ffn=4096, max_context=4096, eps=1e-12),
)}


def _article(family: str) -> str:
    """'a decoder', 'an encoder'."""
    return f"{'an' if family and family[0] in 'aeiou' else 'a'} {family}"


def get_config(name: str, family: str | None = None) -> ModelConfig:
    """The named config; `family`, when given, must match. Unknown names are INVALID_ARGUMENT."""
    cfg = CONFIGS.get(name)
    if family == "encoder" and (cfg is None or cfg.family != "encoder") and f"{name}-encoder" in CONFIGS:
        cfg = CONFIGS[f"{name}-encoder"]
    if cfg is None:
        raise InvalidArgument(f"unknown model config {name!r}; known: {sorted(CONFIGS)}")
    if family is not None and cfg.family != family:
        raise InvalidArgument(f"config {name!r} is {_article(cfg.family)}, not {_article(family)}")
    return cfg
