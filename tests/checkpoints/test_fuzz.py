"""A seeded fuzz of config.json and safetensors headers over every golden checkpoint: each outcome
is a successful load or a domain error, never an unexpected exception (INTERNAL to a client).

The domain errors allowed are INVALID_ARGUMENT (malformed input) and FAILED_PRECONDITION, which
the loader keeps for a well-formed config naming a feature it lacks (a rope scaling other than
llama3, act-order GPTQ, a short sliding window); a header mutation can only be the former,
except GPTQ's act-order indices. Each case opens the mutated checkpoint and streams every weight.
"""
from __future__ import annotations

import collections
import json
import math
import pathlib
import random
import shutil
import struct

import pytest

from gpu_worker.checkpoints import Checkpoint
from services.common.errors import FailedPrecondition, InvalidArgument

GOLDEN = pathlib.Path(__file__).parent / "golden"
NAMES = ("llama-tied", "llama-llama3-sharded", "qwen2-tied", "qwen2-untied", "bert-st", "llama-gptq")
CASES = 600
SEED = 20261201

_DEEP: list = [1]
for _ in range(40):   # deeper than the parser's bound (32)
    _DEEP = [_DEEP]
VALUES = [0, -1, 1, 2, 3, 7, 31, 33, 64, 1024, 1025, 10**6, 2**31, 2**63 - 1, 2**64, 1.5, 1e308,
          math.inf, -math.inf, math.nan, True, False, None, "", "x", "llama3", [], [1], ["x"], {},
          {"rope_type": "llama3"}, {"a": 1}, _DEEP]
CONFIG_KEYS = ["architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
               "num_hidden_layers", "intermediate_size", "vocab_size", "max_position_embeddings",
               "head_dim", "rms_norm_eps", "layer_norm_eps", "rope_theta", "rope_parameters",
               "rope_scaling", "tie_word_embeddings", "eos_token_id", "hidden_act",
               "sliding_window", "use_sliding_window", "quantization_config", "mlp_bias",
               "attention_bias", "position_embedding_type", "model_type"]
NESTED_KEYS = ["rope_type", "type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings", "bits", "group_size", "sym", "desc_act",
               "quant_method", "checkpoint_format"]


def _near(rng: random.Random, value: object) -> object:
    """A value near `value` (an off-by-one, a doubling) or one from VALUES."""
    if isinstance(value, int) and not isinstance(value, bool) and rng.random() < 0.5:
        return rng.choice([value + 1, value - 1, value * 2, value // 2, -value, value * 10**6])
    return rng.choice(VALUES)


def _mutate_config(rng: random.Random, cfg: dict) -> tuple[str, bytes]:
    """(what, new bytes of config.json)."""
    kind = rng.random()
    if kind < 0.08:
        text = json.dumps(cfg).encode()
        return "truncated", text[:rng.randrange(len(text))]
    if kind < 0.12:
        return "not an object", json.dumps(rng.choice([[cfg], 5, "cfg", None])).encode()
    if kind < 0.16:
        return "nested", json.dumps({**cfg, "extra": _DEEP * 3}).encode()[:-1] + b"[" * 5000 + b"}"
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(CONFIG_KEYS + list(cfg))
        inner = cfg.get(key)
        if isinstance(inner, dict) and inner and rng.random() < 0.6:
            inner = dict(inner)
            sub = rng.choice(NESTED_KEYS + list(inner))
            if rng.random() < 0.2:
                inner.pop(sub, None)
            else:
                inner[sub] = _near(rng, inner.get(sub))
            cfg[key] = inner
        elif rng.random() < 0.15:
            cfg.pop(key, None)
        else:
            cfg[key] = _near(rng, cfg.get(key))
    return "fields", json.dumps(cfg).encode()   # inf and nan as Infinity / NaN


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _join(header: object, data: bytes) -> bytes:
    blob = json.dumps(header).encode()
    return struct.pack("<Q", len(blob)) + blob + data


def _mutate_header(rng: random.Random, raw: bytes) -> tuple[str, bytes]:
    """(what, new bytes of the safetensors file): the data is kept, so offsets still mean it."""
    kind = rng.random()
    if kind < 0.06:
        return "length", struct.pack("<Q", rng.choice([0, 1, 2**63, 2**64 - 1, len(raw)])) + raw[8:]
    if kind < 0.12:
        return "truncated", raw[:rng.randrange(len(raw))]
    if kind < 0.18:
        i = rng.randrange(8, 8 + struct.unpack("<Q", raw[:8])[0])
        return "byte", raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1:]
    header, data = _split(raw)
    names = [n for n in header if n != "__metadata__"]
    if kind < 0.3:
        return "harmless", _join(_harmless(rng, header, names), data)
    field = "none"
    for _ in range(rng.randint(1, 2)):
        name = rng.choice(names)
        if not isinstance(header[name], dict):
            continue   # already replaced by a non-entry
        entry = dict(header[name])
        field = rng.choice(["dtype", "shape", "shape", "data_offsets", "data_offsets", "entry"])
        if field == "dtype":
            entry["dtype"] = rng.choice(["F32", "F16", "BF16", "I32", "I64", "U8", "BOOL", "F8",
                                         5, None])
        elif field == "shape":
            shape = list(entry["shape"]) if isinstance(entry.get("shape"), list) else [1]
            choice = rng.random()
            if choice < 0.3 and shape:
                shape[rng.randrange(len(shape))] = _near(rng, shape[0])
            elif choice < 0.5:
                shape = rng.choice([[2**40, 2**24], [2**59, 32], [2**62, 4], [0, 2**40], [1] * 9,
                                    [-1], [math.inf], [], "4"])
            elif choice < 0.7:
                shape = [*shape, rng.choice([1, 2])]
            else:
                shape = shape[::-1] if rng.random() < 0.5 else shape[1:]
            entry["shape"] = shape
        elif field == "data_offsets":
            offsets = entry.get("data_offsets")
            begin, end = offsets if isinstance(offsets, list) and len(offsets) == 2 else (0, 0)
            delta = rng.choice([1, 2, 4, end - begin, len(data)])
            entry["data_offsets"] = rng.choice([[begin + delta, end + delta], [begin, end - delta],
                                                [end, begin], [begin, math.inf], [begin * 1.0, end],
                                                [begin], [-delta, end], [begin, 2**64]])
        else:
            entry = rng.choice([None, [], {"dtype": "F32"}, _DEEP])
        header[name] = entry
        if rng.random() < 0.1:
            header["__metadata__"] = rng.choice([[1], {"a": 1}, "x", {"format": "pt"}])
    return f"{field}", _join(header, data)


def _harmless(rng: random.Random, header: dict, names: list[str]) -> dict:
    """A header that still describes the file: reordered, extra metadata, an unused empty
    tensor, or two same-sized tensors' ranges swapped (wrong values, valid layout)."""
    choice = rng.random()
    if choice < 0.25:
        return dict(rng.sample(list(header.items()), len(header)))
    if choice < 0.5:
        return {"__metadata__": {"format": "pt", "note": "[[[{"}, **header}
    if choice < 0.75:
        return {**header, "unused.extra": {"dtype": "F32", "shape": [0, 7], "data_offsets": [0, 0]}}
    by_size = collections.defaultdict(list)
    for n in names:
        e = header[n]
        by_size[e["dtype"], tuple(e["shape"])].append(n)
    pairs = [v for v in by_size.values() if len(v) > 1]
    if pairs:
        a, b = rng.sample(rng.choice(pairs), 2)
        header[a], header[b] = header[b], header[a]
    return header


def _weight_files(directory: pathlib.Path) -> list[pathlib.Path]:
    return sorted(directory.glob("*.safetensors"))


def _outcome(directory: pathlib.Path, weight_format: str) -> str:
    try:
        with Checkpoint.open(directory, 256, weight_format) as ckpt:
            for _ in ckpt.weights():
                pass
    except InvalidArgument:
        return "INVALID_ARGUMENT"
    except FailedPrecondition:
        return "FAILED_PRECONDITION"
    return "loaded"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, pathlib.Path]:
    base = tmp_path_factory.mktemp("golden")
    return {n: pathlib.Path(shutil.copytree(GOLDEN / n, base / n)) for n in NAMES}


def test_every_config_and_header_mutation_loads_or_is_a_domain_error(pristine, tmp_path):
    rng = random.Random(SEED)
    seen: collections.Counter[tuple[str, str]] = collections.Counter()
    for case in range(CASES):
        name = rng.choice(NAMES)
        directory = pathlib.Path(shutil.copytree(pristine[name], tmp_path / str(case)))
        target = "config" if rng.random() < 0.5 else "header"
        if target == "config":
            what, blob = _mutate_config(rng, json.loads((directory / "config.json").read_text()))
            path = directory / "config.json"
        else:
            path = rng.choice(_weight_files(directory))
            what, blob = _mutate_header(rng, path.read_bytes())
        path.write_bytes(blob)
        weight_format = "fp16" if name != "llama-gptq" and rng.random() < 0.25 else "int4"
        try:
            outcome = _outcome(directory, weight_format)
        except Exception as exc:
            raise AssertionError(f"case {case} ({name}, {target} mutation {what!r}, "
                                 f"{weight_format}): {type(exc).__name__}: {exc} would be "
                                 f"INTERNAL; {path.name} was {blob[:300]!r}") from exc
        if target == "header" and name != "llama-gptq":
            assert outcome != "FAILED_PRECONDITION", f"case {case}: a header names no feature"
        seen[target, outcome] += 1
        shutil.rmtree(directory)
    # Negative control of the fuzz itself: mutations must both land (refusals) and sometimes be
    # harmless (loads), for configs and for headers, or it proves nothing.
    for target in ("config", "header"):
        assert seen[target, "INVALID_ARGUMENT"] >= 40, seen
        assert seen[target, "loaded"] >= 5, seen
