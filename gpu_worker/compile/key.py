"""The kernel cache key: a spelled-out, stable digest of all that decides an artifact's bytes.

Hazard: a key that omits an input serves a stale or foreign artifact that the driver loads and runs
without complaint (a header edit, a changed -D option, another arch, another NVRTC). A key built
from Python's `hash()` changes between processes (PYTHONHASHSEED), so a disk or shared cache would
never hit. A key over plain concatenation lets ("ab", "c") and ("a", "bc") collide.

Contract: `artifact_key` hashes, with SHA-256 (full 256 bits, lowercase hex), a sequence of
labelled, length-prefixed fields in this order: the key-schema version, module name, source, every
header's name and content (sorted by name, count-prefixed), the exact option list (in order,
count-prefixed), arch, artifact kind and NVRTC version. Every length is an 8-byte big-endian
integer, so no two different field tuples encode to the same bytes. The golden test in
tests/compile/test_key.py pins one key: changing the encoding, or the options the compiler adds on
its own (nvrtc.arch_options), must bump KEY_SCHEMA_VERSION.

Cost: one SHA-256 over the source text (~1 us per KiB); the compiler memoizes keys per source.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterable, Mapping

# Bump when the encoding below or the options nvrtc.py adds by itself change: old entries then
# simply stop matching instead of being served.
KEY_SCHEMA_VERSION = 1

ARTIFACT_KINDS = ("ptx", "cubin")


def _field(h: hashlib._Hash, label: str, value: bytes) -> None:
    label_bytes = label.encode("ascii")
    h.update(struct.pack(">Q", len(label_bytes)))
    h.update(label_bytes)
    h.update(struct.pack(">Q", len(value)))
    h.update(value)


def _count(h: hashlib._Hash, label: str, n: int) -> None:
    _field(h, label, struct.pack(">Q", n))


def artifact_key(
    *,
    module_name: str,
    source: str,
    headers: Mapping[str, str],
    arch: str,
    options: Iterable[str],
    kind: str,
    nvrtc_version: str,
) -> str:
    """The lowercase hex SHA-256 key of one compiled artifact; see the module docstring."""
    if kind not in ARTIFACT_KINDS:
        raise ValueError(f"artifact kind must be one of {ARTIFACT_KINDS}, not {kind!r}")
    h = hashlib.sha256()
    _field(h, "schema", str(KEY_SCHEMA_VERSION).encode("ascii"))
    _field(h, "module_name", module_name.encode("utf-8"))
    _field(h, "source", source.encode("utf-8"))
    header_items = sorted(headers.items())
    _count(h, "headers", len(header_items))
    for name, content in header_items:
        _field(h, "header_name", name.encode("utf-8"))
        _field(h, "header_content", content.encode("utf-8"))
    option_list = list(options)
    _count(h, "options", len(option_list))
    for option in option_list:
        _field(h, "option", option.encode("utf-8"))
    _field(h, "arch", arch.encode("ascii"))
    _field(h, "kind", kind.encode("ascii"))
    _field(h, "nvrtc_version", nvrtc_version.encode("ascii"))
    return h.hexdigest()
