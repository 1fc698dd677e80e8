"""Checkpoint JSON as a schema: bounded parsing and typed, bounded fields, checked before any use.

Hazard: config.json, the index, modules.json and every safetensors header are written by whoever
wrote the checkpoint. Unchecked, `num_attention_heads: 0` is a ZeroDivisionError, `1e400` an
infinity that overflows `int()`, ten thousand nested brackets a RecursionError, `architectures: 5`
a TypeError (all INTERNAL to the client), and `num_hidden_layers: 1000000` builds millions of
objects (gigabytes, tens of seconds) before any tensor is found missing.
Contract: `parse_json` refuses, before parsing, text nested deeper than MAX_JSON_DEPTH; it refuses
NaN, Infinity, numbers that overflow a float and integers beyond 64 bits; `Fields` reads one JSON
object with a type and a range for every field (an absent or null field takes its default). Every
refusal is INVALID_ARGUMENT (`CheckpointError`) naming the file and the field, and quotes at most
MAX_QUOTE characters of what it found. The bounds below are generous for real models: Llama 3.1
405B has 126 layers, hidden 16384, 128 heads, intermediate 53248, vocab 128256.
Cost: one C-speed pass to strip strings and count brackets before `json.loads`.
"""
from __future__ import annotations

import json
import math
import re

import numpy as np

from gpu_worker.checkpoints.paths import CheckpointError

MAX_JSON_DEPTH = 32               # HF configs nest 3-4 deep, safetensors headers 3
MAX_CONFIG_BYTES = 1 << 20        # config.json, generation_config.json, modules.json, ...
MAX_INDEX_BYTES = 64 << 20        # model.safetensors.index.json (405B: ~100 KiB)
MAX_INT_DIGITS = 19               # any integer a checkpoint needs fits in 63 bits
MAX_QUOTE = 80                    # characters of a bad value an error message repeats

# Config bounds (inclusive). Each is several times the largest public model's value.
MAX_LAYERS = 1024
MAX_HIDDEN = 1 << 16              # 65536
MAX_HEADS = 1024
MAX_FFN = 1 << 18                 # 262144
MAX_VOCAB = 1 << 22               # 4194304
MAX_POSITIONS = 1 << 24           # 16777216 (max_position_embeddings, sliding_window)
MAX_EOS_IDS = 1024
MAX_TOKEN_ID = (1 << 31) - 1     # token ids are int32 on the wire and the device
MAX_MODULES = 64                  # entries of a sentence-transformers modules.json
MAX_ROPE_THETA = 1e12
MAX_ROPE_FACTOR = 1e6

# A JSON string, or an unterminated one up to the end: every match attempt from a quote succeeds,
# so stripping strings is one linear pass (a pattern that can fail rescans the rest of the text
# from each escaped quote: quadratic in `"` followed by many `\"`).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")
_DEPTH_PIECE = 1 << 20
_REQUIRED = object()


def quote(value: object) -> str:
    """`value` for an error message, cut at MAX_QUOTE characters."""
    text = repr(value)
    return text if len(text) <= MAX_QUOTE else text[:MAX_QUOTE] + "..."


def json_depth(data: bytes) -> int:
    """The deepest nesting of brackets in `data` outside strings (without recursing)."""
    brackets = np.frombuffer(_STRING.sub(b"", data).translate(None, _NOT_BRACKETS), np.uint8)
    depth = deepest = 0
    for start in range(0, len(brackets), _DEPTH_PIECE):   # pieces: bounded scratch memory
        piece = brackets[start:start + _DEPTH_PIECE]
        levels = np.cumsum(np.where((piece == ord("[")) | (piece == ord("{")), 1, -1)) + depth
        deepest, depth = max(deepest, int(levels.max())), int(levels[-1])
    return deepest


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:MAX_QUOTE]} is not a finite float")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits is beyond 64 bits")
    return int(text)


def _no_constant(text: str) -> None:
    raise ValueError(f"{text} is not a finite number")


def parse_json(data: bytes, name: str) -> object:
    """`data` as JSON, refused (CheckpointError naming `name`) when it is not UTF-8, nests deeper
    than MAX_JSON_DEPTH, or holds NaN, an infinity or an integer beyond 64 bits."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise CheckpointError(f"{name} is not UTF-8 JSON (not UTF-8)", file=name) from None
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise CheckpointError(f"{name} nests {depth} levels deep, more than the "
                              f"{MAX_JSON_DEPTH} allowed", file=name)
    try:
        return json.loads(text, parse_float=_finite, parse_int=_bounded_int,
                          parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:   # JSONDecodeError is a ValueError
        raise CheckpointError(f"{name} is not UTF-8 JSON ({str(exc)[:200]})", file=name) from None


class Fields:
    """Typed, bounded reads of one JSON object. `where` names it in errors (`config.json`,
    `config.json: quantization_config`)."""

    def __init__(self, raw: object, where: str) -> None:
        if not isinstance(raw, dict):
            raise CheckpointError(f"{where} is not a JSON object (found {type(raw).__name__})")
        self.raw, self.where = raw, where

    def fail(self, key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{self.where}: {key} {why}", field=key)

    def has(self, key: str) -> bool:
        return self.raw.get(key) is not None

    def _absent(self, key: str, default: object) -> object:
        """The value of an absent (or null) field: its default, unchecked, or a refusal."""
        if default is _REQUIRED:
            raise self.fail(key, "is missing")
        return default

    def int(self, key: str, lo: int, hi: int, default: object = _REQUIRED) -> int:
        value = self.raw.get(key)
        if value is None:
            return self._absent(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"is not a number: it must be an integer, found {quote(value)}")
        if not isinstance(value, int):
            raise self.fail(key, f"must be an integer, found {quote(value)}")
        if not lo <= value <= hi:
            raise self.fail(key, f"is {value}; it must be between {lo} and {hi}")
        return value

    def number(self, key: str, lo: float, hi: float, default: object = _REQUIRED,
               above: bool = False) -> float:
        """A finite number in [lo, hi] (in (lo, hi] when `above`)."""
        value = self.raw.get(key)
        if value is None:
            return self._absent(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.fail(key, f"is not a number, found {quote(value)}")
        value = float(value)
        if not math.isfinite(value) or not (lo < value if above else lo <= value) or value > hi:
            low = f"above {lo}" if above else f"at least {lo}"
            raise self.fail(key, f"is {value}; it must be finite, {low} and at most {hi}")
        return value

    def bool(self, key: str, default: object = _REQUIRED) -> bool:
        value = self.raw.get(key)
        if value is None:
            return self._absent(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, found {quote(value)}")
        return value

    def str(self, key: str, default: object = _REQUIRED) -> str:
        value = self.raw.get(key)
        if value is None:
            return self._absent(key, default)
        if not isinstance(value, str):
            raise self.fail(key, f"must be a string, found {quote(value)}")
        return value

    def str_list(self, key: str, most: int) -> list[str]:
        value = self.raw.get(key)
        if value is None:
            return []
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self.fail(key, f"must be a list of strings, found {quote(value)}")
        if len(value) > most:
            raise self.fail(key, f"lists {len(value)} entries, more than {most}")
        return value

    def obj(self, key: str) -> Fields | None:
        """The nested object `key` (None when absent or null)."""
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a JSON object, found {quote(value)}")
        return Fields(value, f"{self.where}: {key}")
