"""The kernel cache key: pinned, sensitive to every field, immune to concatenation collisions."""

from __future__ import annotations

import hashlib
import struct
import subprocess
import sys

import pytest

from gpu_worker.compile.key import KEY_SCHEMA_VERSION, artifact_key

GOLDEN_FIELDS = {
    "module_name": "golden",
    "source": 'extern "C" __global__ void k(float* x) { x[0] = 1.0f; }\n',
    "headers": {"b.h": "#define B 2\n", "a.h": "#define A 1\n"},
    "arch": "sm_90",
    "options": ("-DX=1", "--use_fast_math"),
    "kind": "cubin",
    "nvrtc_version": "13.0",
}
GOLDEN_KEY = "1ef5a76935e259c5ada975392038923db17aa41bb6e6a48c8508903389bd6298"


def test_golden_key_is_pinned_so_an_accidental_key_change_is_caught() -> None:
    assert KEY_SCHEMA_VERSION == 1, "schema bumped: re-pin GOLDEN_KEY for the new schema"
    assert artifact_key(**GOLDEN_FIELDS) == GOLDEN_KEY, (
        "the key of a fixed input changed: every cached artifact would miss (or worse, a field "
        "dropped out). If intended, bump KEY_SCHEMA_VERSION and re-pin"
    )


def test_key_encoding_is_the_documented_labelled_length_prefixed_sha256() -> None:
    def field(label: str, value: bytes) -> bytes:
        lab = label.encode()
        return struct.pack(">Q", len(lab)) + lab + struct.pack(">Q", len(value)) + value

    f = GOLDEN_FIELDS
    blob = (
        field("schema", b"1")
        + field("module_name", b"golden")
        + field("source", f["source"].encode())
    )
    blob += field("headers", struct.pack(">Q", 2))
    for name in ("a.h", "b.h"):  # sorted by name
        blob += field("header_name", name.encode()) + field(
            "header_content", f["headers"][name].encode()
        )
    blob += field("options", struct.pack(">Q", 2))
    blob += field("option", b"-DX=1") + field("option", b"--use_fast_math")
    blob += field("arch", b"sm_90") + field("kind", b"cubin") + field("nvrtc_version", b"13.0")
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_KEY, (
        "the key no longer follows key.py's docstring"
    )


def test_key_is_the_same_in_another_process_with_another_hash_seed() -> None:
    code = (
        f"from gpu_worker.compile.key import artifact_key;print(artifact_key(**{GOLDEN_FIELDS!r}))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": ""},
        cwd=None,
    )
    assert out.stdout.strip() == GOLDEN_KEY, "the key depends on the process (Python's hash()?)"


CHANGES = {
    "module_name": "golden2",
    "source": GOLDEN_FIELDS["source"] + " ",
    "headers": {"b.h": "#define B 2\n", "a.h": "#define A 2\n"},
    "arch": "sm_80",
    "options": ("-DX=1",),
    "kind": "ptx",
    "nvrtc_version": "13.5",
}


@pytest.mark.parametrize("name", sorted(CHANGES))
def test_every_key_field_changes_the_key(name: str) -> None:
    changed = dict(GOLDEN_FIELDS, **{name: CHANGES[name]})
    assert artifact_key(**changed) != GOLDEN_KEY, f"changing {name} did not change the key"


def test_a_header_name_alone_changes_the_key() -> None:
    renamed = dict(GOLDEN_FIELDS, headers={"b.h": "#define B 2\n", "c.h": "#define A 1\n"})
    assert artifact_key(**renamed) != GOLDEN_KEY, "renaming an included header kept the key"


def test_option_order_changes_the_key_but_header_dict_order_does_not() -> None:
    reordered = dict(GOLDEN_FIELDS, options=("--use_fast_math", "-DX=1"))
    assert artifact_key(**reordered) != GOLDEN_KEY, "the exact option order must be part of the key"
    same = dict(GOLDEN_FIELDS, headers=dict(reversed(list(GOLDEN_FIELDS["headers"].items()))))
    assert artifact_key(**same) == GOLDEN_KEY, "header dict insertion order must not change the key"


def test_length_prefixing_prevents_concatenation_collisions() -> None:
    base = dict(GOLDEN_FIELDS)
    pairs = [
        (dict(base, module_name="ab", source="c"), dict(base, module_name="a", source="bc")),
        (dict(base, options=("ab", "c")), dict(base, options=("a", "bc"))),
        (dict(base, options=("a", "")), dict(base, options=("a",))),
        (dict(base, headers={"ab": "c"}), dict(base, headers={"a": "bc"})),
    ]
    for left, right in pairs:
        assert artifact_key(**left) != artifact_key(**right), f"collision: {left} vs {right}"


def test_unknown_artifact_kind_is_refused() -> None:
    with pytest.raises(ValueError, match="artifact kind"):
        artifact_key(**dict(GOLDEN_FIELDS, kind="fatbin"))
