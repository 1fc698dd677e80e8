"""NumPy references for every kernel of the library: the correctness oracle.

float32 throughout, written to the same conventions as the model references
(gpu_worker/models/reference.py): rotary pairs (i, i + d/2) ("rotate half") with angles computed in
float32, GQA query head h reads KV head h // (heads // kv_heads), softmax scale 1/sqrt(head_dim) unless
given, tanh-approximated GELU, argmax ties to the lowest index.

int4 layout (block 32 along K, fp16 scales, signed by a zero offset of 8): a row of W (N, K) is
ceil(K/32) blocks; block b is 16 bytes, byte i holding k = 32b + 2i in its low nibble and 32b + 2i + 1
in its high nibble; nibble n stands for n - 8. K is padded up to a multiple of 32 with the nibble 8
(zero), so packed is (N, 16 * ceil(K/32)) uint8 and scales (N, ceil(K/32)) float16. When K is a
multiple of 32 this is exactly gpu_worker.models.weights' layout.
"""
from __future__ import annotations

import numpy as np

QUANT_BLOCK = 32


def int4_blocks(k: int) -> int:
    return -(-k // QUANT_BLOCK)


def int4_quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 per block of 32 along K (absmax / 7, fp16 scales); any K (zero-padded)."""
    n, k = w.shape
    kb = int4_blocks(k)
    padded = np.zeros((n, kb * QUANT_BLOCK), np.float32)
    padded[:, :k] = w
    blocks = padded.reshape(n, kb, QUANT_BLOCK)
    scales = (np.abs(blocks).max(axis=2) / 7.0).astype(np.float16)
    safe = np.where(scales == 0, np.float16(1), scales).astype(np.float32)[..., None]
    q = np.clip(np.rint(blocks / safe), -8, 7).astype(np.int16).reshape(n, kb * QUANT_BLOCK)
    nib = (q + 8).astype(np.uint8)
    packed = (nib[:, 0::2] | (nib[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales


def stored_to_f32(raw: np.ndarray, dtype: str) -> np.ndarray:
    """A checkpoint's stored values (BF16 as uint16 bits, F16, F32) widened exactly to f32."""
    if dtype == "BF16":   # bf16 is the top half of an f32
        return (np.asarray(raw).astype(np.uint32) << 16).view(np.float32)
    return np.asarray(raw).astype(np.float32)


def int4_quantize_stored(raw: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """int4_quantize of stored rows (the device quantizer's oracle; K a multiple of 32)."""
    with np.errstate(all="ignore"):   # inf / NaN inputs quantize silently, as the loader's do
        return int4_quantize(stored_to_f32(raw, dtype))


def int4_unpack(packed: np.ndarray) -> np.ndarray:
    """The signed integers in [-8, 7] of a packed matrix, (N, 32 * blocks) int8, padding included."""
    q = np.empty((packed.shape[0], packed.shape[1] * 2), np.int8)
    q[:, 0::2] = (packed & 0x0F).astype(np.int8) - 8
    q[:, 1::2] = (packed >> 4).astype(np.int8) - 8
    return q


def int4_dequantize(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """float32 (N, K): nibble - 8 times its block's fp16 scale (exact in float32)."""
    n = packed.shape[0]
    q = int4_unpack(packed).astype(np.float32).reshape(n, -1, QUANT_BLOCK)
    return (q * scales.astype(np.float32)[..., None]).reshape(n, -1)[:, :k]


def int4_dequantize_f16(packed: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """fp16 (N, K): the exact f32 product rounded to nearest even (as cvt.rn.f16.f32)."""
    return int4_dequantize(packed, scales, k).astype(np.float16)


def to_f16(x: np.ndarray) -> np.ndarray:
    """f32 -> fp16, round to nearest even; beyond 65504 -> inf (as cvt.rn.f16.f32)."""
    with np.errstate(over="ignore"):
        return np.asarray(x, np.float32).astype(np.float16)


def from_f16(x: np.ndarray) -> np.ndarray:
    """fp16 -> f32: exact (every fp16 value, inf and NaN included, is an f32 value)."""
    return np.asarray(x, np.float16).astype(np.float32)


def gemm_nt_f16(x16: np.ndarray, w16: np.ndarray) -> np.ndarray:
    """y = x @ w.T from fp16 operands with f32 accumulation (the tensor-core linear), f32 out."""
    return matmul_nt(x16.astype(np.float32), w16.astype(np.float32))


def int4_linear_f16(x: np.ndarray, packed: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """An int4 linear from f32 x: x rounded to fp16 (the producer's cast), then int4_matmul."""
    return int4_matmul(to_f16(x), packed, scales)


def matmul_nt(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """y = x @ w.T (+ bias): x (M, K), w (N, K) float32.

    Accumulated in float64 and rounded once: a float32 product's last bits depend on the host BLAS's
    blocking (which changes with M and with the CPU's kernel), so a padded batch and its solo rows, or
    the same test on two CI hosts, would differ by ~1e-5; rounded float64 sums agree."""
    y = (x.astype(np.float64) @ w.astype(np.float64).T).astype(np.float32)
    return y if bias is None else (y + bias).astype(np.float32)


def int4_matmul(x16: np.ndarray, packed: np.ndarray, scales: np.ndarray,
                bias: np.ndarray | None = None) -> np.ndarray:
    """Every int4 linear's contract (the GEMV, int4_mma, the prefill's dequant tile + cuBLAS):
    y = x16 @ f16(dequant(W)).T (+ bias) in f32, K = x16.shape[1], x fp16 as stored and each
    weight its exact dequantized value rounded once to fp16. One contract for every row count, so
    a row's result does not depend on the batch that carried it (up to summation order)."""
    w16 = int4_dequantize_f16(packed, scales, x16.shape[1])
    return matmul_nt(from_f16(x16), w16.astype(np.float32), bias)


def embedding_gather(table: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Rows of an fp16 table as float32; an id outside [0, vocab) gives a zero row."""
    ids = np.asarray(ids, np.int64)
    valid = (ids >= 0) & (ids < table.shape[0])
    out = table[np.where(valid, ids, 0)].astype(np.float32)
    out[~valid] = 0.0
    return out


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return ((x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)) * w).astype(np.float32)


def layernorm(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, eps: float) -> np.ndarray:
    mu = x.mean(axis=-1, keepdims=True)
    var = ((x - mu) ** 2).mean(axis=-1, keepdims=True)
    y = (x - mu) / np.sqrt(var + eps) * w
    return (y if b is None else y + b).astype(np.float32)


def rotary(x: np.ndarray, positions: np.ndarray, theta: float,
           inv_freq: np.ndarray | None = None) -> np.ndarray:
    """x (tokens, heads, head_dim) rotated at `positions` (tokens,), rotate-half convention;
    `inv_freq` (head_dim // 2,) f32 replaces theta's frequencies when given."""
    d = x.shape[-1]
    half = d // 2
    # float64 angles, as the CUDA kernel forms them (see gp_rotary in rotary.py).
    inv = np.float64(theta) ** (-np.arange(0, half, dtype=np.float64) * 2.0 / d)
    if inv_freq is not None:
        inv = np.asarray(inv_freq, np.float32).astype(np.float64)
    ang = np.asarray(positions).astype(np.float64)[:, None] * inv[None, :]
    cos = np.cos(ang).astype(np.float32)[:, None, :]
    sin = np.sin(ang).astype(np.float32)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(np.float32)


def rotary_rows(x: np.ndarray, positions: np.ndarray, theta: float,
                inv_freq: np.ndarray | None = None) -> np.ndarray:
    """x (rows, heads, head_dim), row r rotated at positions[r]; a row at a negative position
    (padding) becomes zeros."""
    positions = np.asarray(positions)
    out = np.zeros(x.shape, np.float32)
    live = positions >= 0
    if live.any():
        out[live] = rotary(x[live], positions[live], theta, inv_freq)
    return out


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, causal: bool,
              n_valid: int | None = None, scale: float | None = None) -> np.ndarray:
    """q (S, H, d), k/v (T, KV, d). Query i sees key j when j < n_valid and (not causal or
    j <= q_pos[i]); a query that sees no key gets zeros."""
    s, heads, d = q.shape
    t = k.shape[0]
    if t == 0:
        return np.zeros(q.shape, np.float32)
    group = heads // k.shape[1]
    kk = np.repeat(k, group, axis=1)
    vv = np.repeat(v, group, axis=1)
    sc = np.float32(1.0 / np.sqrt(d)) if scale is None else np.float32(scale)
    scores = np.einsum("shd,thd->hst", q, kk).astype(np.float32) * sc
    visible = np.arange(t)[None, :] < (t if n_valid is None else n_valid)
    visible = np.broadcast_to(visible, (s, t))
    if causal:
        visible = visible & (np.arange(t)[None, :] <= np.asarray(q_pos)[:, None])
    scores = np.where(visible[None], scores, np.float32(-np.inf))
    row_max = scores.max(axis=-1, keepdims=True)
    p = np.exp(scores - np.where(np.isfinite(row_max), row_max, 0))
    denom = p.sum(axis=-1, keepdims=True)
    p = np.where(denom > 0, p / np.where(denom > 0, denom, 1), 0)
    return np.einsum("hst,thd->shd", p, vv).astype(np.float32)


def attention_partial(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                      scale: float | None = None) -> np.ndarray:
    """Unnormalised softmax state of one query row per head over keys k/v (T, KV, d):
    (heads, 2 + d) = (max score, sum of exp(score - max), sum of exp(score - max) * v);
    (-inf, 0, 0...) when there are no keys."""
    heads, d = q.shape
    out = np.zeros((heads, 2 + d), np.float32)
    out[:, 0] = -np.inf
    if k.shape[0] == 0:
        return out
    group = heads // k.shape[1]
    kk, vv = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    sc = np.float32(1.0 / np.sqrt(d)) if scale is None else np.float32(scale)
    scores = np.einsum("hd,thd->ht", q, kk).astype(np.float32) * sc
    mx = scores.max(axis=1)
    p = np.exp(scores - mx[:, None])
    out[:, 0], out[:, 1] = mx, p.sum(axis=1)
    out[:, 2:] = np.einsum("ht,thd->hd", p, vv)
    return out


def attention_combine(partials: np.ndarray) -> np.ndarray:
    """Merge partial states (splits, heads, 2 + d) into the attention output (heads, d)."""
    mx = partials[:, :, 0].max(axis=0)
    safe = np.where(np.isfinite(mx), mx, 0)
    w = np.where(partials[:, :, 1] > 0, np.exp(partials[:, :, 0] - safe[None]), 0)
    denom = (partials[:, :, 1] * w).sum(axis=0)
    acc = (partials[:, :, 2:] * w[..., None]).sum(axis=0)
    return np.where(denom[:, None] > 0, acc / np.where(denom > 0, denom, 1)[:, None], 0).astype(np.float32)


def silu_gate(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    return (gate / (np.float32(1.0) + np.exp(-gate)) * up).astype(np.float32)


def gelu(x: np.ndarray, exact: bool = False) -> np.ndarray:
    """tanh approximation (as the model reference's), or the erf form (`exact`, transformers'
    "gelu" as BERT checkpoints use it)."""
    if exact:
        from math import erf
        return (0.5 * x * (1.0 + np.vectorize(erf, otypes=[np.float64])(x / np.sqrt(2.0)))).astype(np.float32)
    return (0.5 * x * (1.0 + np.tanh(0.7978845608028654 * (x + 0.044715 * x**3)))).astype(np.float32)


def add(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a + b).astype(np.float32)


def add_i32(values: np.ndarray, delta: int) -> np.ndarray:
    """values + delta as int32 (a device position or length counter advanced in place)."""
    return (np.asarray(values) + delta).astype(np.int32)


def bias_add(x: np.ndarray, bias: np.ndarray) -> np.ndarray:
    return (x + bias[None, :]).astype(np.float32)


def argmax(x: np.ndarray) -> np.ndarray:
    """Per row, int32; ties go to the lowest index."""
    return np.argmax(x, axis=-1).astype(np.int32)


def mean_pool(x: np.ndarray, lens: np.ndarray | None = None) -> np.ndarray:
    """x (B, S, H) -> (B, H): mean over the first lens[b] positions (all when None; 0 gives zeros)."""
    b, s, h = x.shape
    out = np.zeros((b, h), np.float32)
    for i in range(b):
        n = s if lens is None else int(min(max(int(lens[i]), 0), s))
        if n:
            out[i] = x[i, :n].mean(axis=0)
    return out


def kv_append(cache: np.ndarray, new: np.ndarray, pos: int) -> np.ndarray:
    """cache (max_len, KV, d) with new (tokens, KV, d) written at pos..; rows past max_len dropped."""
    out = cache.copy()
    for t in range(new.shape[0]):
        if 0 <= pos + t < cache.shape[0]:
            out[pos + t] = new[t]
    return out


# -- fp16 attention (flash_attention.py): fp16 in, fp32 math, fp16 out ----------------------
def attention_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray, q_pos: np.ndarray, causal: bool,
                  n_valid: int | None = None, scale: float | None = None) -> np.ndarray:
    """attention over fp16 inputs (exact in fp32), rounded to fp16."""
    f = np.float32
    return attention(q.astype(f), k.astype(f), v.astype(f), q_pos, causal, n_valid=n_valid,
                     scale=scale).astype(np.float16)


def attention_partial_f16(q: np.ndarray, k: np.ndarray, v: np.ndarray,
                          scale: float | None = None) -> np.ndarray:
    """attention_partial over fp16 inputs: the fp32 workspace state of one split."""
    f = np.float32
    return attention_partial(q.astype(f), k.astype(f), v.astype(f), scale)


def attention_combine_f16(partials: np.ndarray) -> np.ndarray:
    return attention_combine(partials).astype(np.float16)


# -- paged KV (paged_attention.py): the pool (capacity, layers, 2, block_tokens, kv_heads, d) -
def paged_kv(pool: np.ndarray, table_row: np.ndarray, layer: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """K and V (n, kv_heads, head_dim) of positions [0, n) of one sequence, gathered."""
    bt = pool.shape[3]
    pos = np.arange(n)
    blocks = np.asarray(table_row, np.int64)[pos // bt]
    return pool[blocks, layer, 0, pos % bt], pool[blocks, layer, 1, pos % bt]


def kv_append_paged(pool: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
                    table: np.ndarray, layer: int) -> np.ndarray:
    """The pool after appending rows of k/v (R, kv_heads * head_dim) f32 at `positions` through
    `table` (row r uses table row r when it has R rows, else row 0); -1 rows write nothing."""
    out = pool.copy()
    bt, kvh, d = pool.shape[3:]
    rows = k.shape[0]
    for r in range(rows):
        p = int(positions[r])
        if p < 0 or p >= table.shape[1] * bt:
            continue
        blk = int(table[r if table.shape[0] == rows else 0, p // bt])
        with np.errstate(over="ignore"):
            out[blk, layer, 0, p % bt] = k[r].reshape(kvh, d).astype(np.float16)
            out[blk, layer, 1, p % bt] = v[r].reshape(kvh, d).astype(np.float16)
    return out


def flash_decode_paged(q: np.ndarray, pool: np.ndarray, positions: np.ndarray, table: np.ndarray,
                       layer: int, heads: int) -> np.ndarray:
    """fp16 (B, heads * d): row r attends to positions [0, positions[r]]; -1 rows are zero."""
    d = pool.shape[5]
    out = np.zeros((q.shape[0], heads * d), np.float16)
    for r, p in enumerate(np.asarray(positions, np.int64)):
        if p < 0:
            continue
        k, v = paged_kv(pool, table[r], layer, int(p) + 1)
        out[r] = attention_f16(q[r].reshape(1, heads, d), k, v, np.array([p]), False).reshape(-1)
    return out


def flash_prefill_paged(q: np.ndarray, pool: np.ndarray, start: int, chunk_len: int,
                        table_row: np.ndarray, layer: int, heads: int) -> np.ndarray:
    """fp16 (S, heads * d): token t < chunk_len sees positions [0, start + t]; other rows zero."""
    s, d = q.shape[0], pool.shape[5]
    out = np.zeros((s, heads * d), np.float16)
    n = min(max(chunk_len, 0), s) if start >= 0 else 0
    if n == 0:
        return out
    k, v = paged_kv(pool, table_row, layer, start + n)
    qq = q[:n].reshape(n, heads, d)
    out[:n] = attention_f16(qq, k, v, start + np.arange(n), True).reshape(n, -1)
    return out


def paged_decode_nkeys(positions: np.ndarray, capacity: int) -> np.ndarray:
    """Keys per row of the paged decode: positions + 1 clamped to [0, capacity] (-1 rows: 0)."""
    return np.clip(np.asarray(positions, np.int64) + 1, 0, capacity)


def flash_decode_paged_partials(q: np.ndarray, pool: np.ndarray, positions: np.ndarray,
                                table: np.ndarray, layer: int, heads: int, span: int,
                                splits: int, scale: float | None = None) -> np.ndarray:
    """The split kernel's workspace, (B, heads, splits, 2 + d) f32: slot s of row r holds the
    attention_partial state of keys [s * span, (s + 1) * span) when s < ceil(nkeys_r / span),
    and NaN where no split ran (the kernel must not write there; the combine must not read)."""
    d = pool.shape[5]
    capacity = table.shape[1] * pool.shape[3]
    out = np.full((q.shape[0], heads, splits, 2 + d), np.nan, np.float32)
    for r, n in enumerate(paged_decode_nkeys(positions, capacity)):
        k, v = paged_kv(pool, table[r], layer, int(n))
        qr = q[r].reshape(heads, d)
        for s in range(-(-int(n) // span)):
            out[r, :, s] = attention_partial_f16(qr, k[s * span:(s + 1) * span],
                                                 v[s * span:(s + 1) * span], scale)
    return out


def flash_decode_paged_combine(partials: np.ndarray, positions: np.ndarray, capacity: int,
                               span: int) -> np.ndarray:
    """fp16 (B, heads * d): row r merges only its ceil(nkeys_r / span) splits (zeros if none)."""
    b, heads, _, w = partials.shape
    out = np.zeros((b, heads * (w - 2)), np.float16)
    for r, n in enumerate(paged_decode_nkeys(positions, capacity)):
        ran = -(-int(n) // span)
        if ran:
            out[r] = attention_combine_f16(partials[r, :, :ran].transpose(1, 0, 2)).reshape(-1)
    return out


# -- the fused decoder layer (qkv.py, norm.py's rmsnorm_f16, elementwise.py's silu_gate_f16) --
def _split_qkv(qkv: np.ndarray, bias: np.ndarray | None, heads: int, kv_heads: int,
               d: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q (R, heads, d), k (R, kv_heads, d), v (R, kv_heads * d) of fused q | k | v rows (+ bias)."""
    x = np.asarray(qkv, np.float32)
    if bias is not None:
        x = (x + np.asarray(bias, np.float32)[None, :]).astype(np.float32)
    qw, kvw = heads * d, kv_heads * d
    return (x[:, :qw].reshape(-1, heads, d), x[:, qw:qw + kvw].reshape(-1, kv_heads, d),
            x[:, qw + kvw:qw + 2 * kvw])


def qkv_rope_append_paged(qkv: np.ndarray, bias: np.ndarray | None, positions: np.ndarray,
                          table: np.ndarray, pool: np.ndarray, layer: int, heads: int,
                          kv_heads: int, theta: float,
                          inv_freq: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(q fp16 (R, heads * d), the pool after the append): qkv (R, (heads + 2 kv_heads) * d) f32
    rows (+ bias) rotated at `positions` (rotary_rows: -1 rows zero), k and v appended through
    `table` (kv_append_paged), q cast (to_f16)."""
    d = pool.shape[5]
    q, k, v = _split_qkv(qkv, bias, heads, kv_heads, d)
    q = rotary_rows(q, positions, theta, inv_freq).reshape(q.shape[0], -1)
    k = rotary_rows(k, positions, theta, inv_freq).reshape(k.shape[0], -1)
    return to_f16(q), kv_append_paged(pool, k, v, positions, table, layer)


def qkv_rope_append(qkv: np.ndarray, bias: np.ndarray | None, start: int, k_cache: np.ndarray,
                    v_cache: np.ndarray, heads: int, kv_heads: int, theta: float,
                    inv_freq: np.ndarray | None = None,
                    q_half: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(q, k cache, v cache) after one sequence's tokens at start..: q (T, heads * d) rotated
    (fp16 when `q_half`, else f32), k rotated and v appended to the fp16 caches (max_len,
    kv_heads, d) (kv_append: rows past the cache dropped)."""
    d = k_cache.shape[-1]
    q, k, v = _split_qkv(qkv, bias, heads, kv_heads, d)
    pos = start + np.arange(q.shape[0])
    q = rotary(q, pos, theta, inv_freq).reshape(q.shape[0], -1)
    k = rotary(k, pos, theta, inv_freq)
    with np.errstate(over="ignore"):
        kc = kv_append(k_cache, k.astype(np.float16), start)
        vc = kv_append(v_cache, v.reshape(-1, kv_heads, d).astype(np.float16), start)
    return (to_f16(q) if q_half else q), kc, vc


def rmsnorm_f16(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    """rmsnorm rounded to fp16 (the next linear's tensor-core operand, without a to_f16 node)."""
    return to_f16(rmsnorm(x, w, eps))


def silu_gate_f16(gate: np.ndarray, up: np.ndarray) -> np.ndarray:
    """silu_gate rounded to fp16 (the down projection's tensor-core operand)."""
    return to_f16(silu_gate(gate, up))


# -- sampling (sampling.py): the per-row sampler's exact oracle (its module docstring) --------
def _fmix32(h: np.ndarray) -> np.ndarray:
    h = h ^ (h >> np.uint32(16))
    h = h * np.uint32(0x85EBCA6B)
    h = h ^ (h >> np.uint32(13))
    h = h * np.uint32(0xC2B2AE35)
    return h ^ (h >> np.uint32(16))


def uniform(seed: int, position: int, tokens: np.ndarray) -> np.ndarray:
    """The device's u in (0, 1) for these token indices (float32, exact)."""
    with np.errstate(over="ignore"):
        s = _fmix32(np.array([seed + 0x632BE5AB], np.int64).astype(np.uint32))
        ps = _fmix32(np.array([position], np.int64).astype(np.uint32) * np.uint32(0x85EBCA77) + s)
        h = _fmix32(np.asarray(tokens, np.int64).astype(np.uint32) * np.uint32(0x9E3779B1) + ps)
    return (((h >> np.uint32(8)).astype(np.float32) + np.float32(0.5))
            * np.float32(5.9604644775390625e-8)).astype(np.float32)


def fkey(z: np.ndarray) -> np.ndarray:
    u = np.asarray(z, np.float32).view(np.uint32)
    return np.where(u & np.uint32(0x80000000), ~u, u | np.uint32(0x80000000)).astype(np.uint32)


def sample_row(x: np.ndarray, position: int, temperature: float, top_p: float, top_k: int,
               seed: int) -> int:
    """One row of `sample` (see the module docstring)."""
    x = np.asarray(x, np.float32)
    vocab = x.shape[0]
    if position < 0:
        return -1
    if not np.float32(temperature) > 0:
        return int(np.argmax(x))
    z = (x / np.float32(temperature)).astype(np.float32)
    keys = fkey(z)
    kmax = int(keys.max())
    thr = 0
    if 0 < top_k < vocab:
        thr = int(np.sort(keys)[vocab - top_k])
    if np.float32(top_p) < 1:
        # fixed-point masses, as the device sums them: floor(exp(z - max z) * 2^32), exact sums
        e = np.exp((z - z.max()).astype(np.float32)).astype(np.float64)
        e = np.where(keys >= thr, np.floor(e * 4294967296.0), 0.0).astype(np.uint64)
        target = float(np.float32(top_p)) * float(e.sum())
        order = np.argsort(-keys.astype(np.int64), kind="stable")
        sk, mass = keys[order], np.cumsum(e[order]).astype(np.float64)
        # mass(t) for t = a key value counts every token with key >= t: the last of its ties.
        last = np.searchsorted(-sk.astype(np.int64), -sk.astype(np.int64), side="right") - 1
        reach = np.flatnonzero(mass[last] >= target)
        t = int(sk[reach[0]]) if reach.size else 0
        thr = max(thr, t)
    thr = min(thr, kmax)
    kept = np.flatnonzero(keys >= thr)
    u = uniform(int(seed), int(position), kept)
    g = (z[kept] - np.log(-np.log(u))).astype(np.float32)
    return int(kept[int(np.argmax(g))])


def sample(logits: np.ndarray, positions: np.ndarray, temperature: np.ndarray, top_p: np.ndarray,
           top_k: np.ndarray, seed: np.ndarray) -> np.ndarray:
    """next_token (B,) int32 for logits (B, vocab) f32 and the per-row parameters."""
    return np.array([sample_row(logits[r], int(positions[r]), float(temperature[r]),
                                float(top_p[r]), int(top_k[r]), int(seed[r]))
                     for r in range(logits.shape[0])], np.int32)
