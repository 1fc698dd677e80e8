"""KernelSource: a value that cannot change after it was keyed."""

from __future__ import annotations

import pytest

from gpu_worker.compile import KernelSource


def test_a_source_copies_its_headers_so_the_caller_cannot_change_it_after_keying() -> None:
    headers = {"a.h": "#define A 1\n"}
    src = KernelSource("m", "int x;", headers, ["-DX"])
    headers["a.h"] = "#define A 2\n"
    assert src.headers["a.h"] == "#define A 1\n", "a caller's later edit leaked into the source"
    with pytest.raises(TypeError):
        src.headers["b.h"] = ""  # type: ignore[index]
    assert src.options == ("-DX",), "options must be an immutable tuple"


def test_equal_sources_hash_alike_so_per_source_memos_work() -> None:
    a = KernelSource("m", "int x;", {"a.h": "1"}, ("-O3",))
    b = KernelSource("m", "int x;", {"a.h": "1"}, ["-O3"])
    assert a == b and hash(a) == hash(b)
    assert a != KernelSource("m", "int x;", {"a.h": "2"}, ("-O3",))


def test_a_source_without_a_module_name_is_refused() -> None:
    with pytest.raises(ValueError, match="module_name"):
        KernelSource("", "int x;")
