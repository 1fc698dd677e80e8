"""The local disk tier: atomic publish, digest-checked reads, LRU byte budget."""

from __future__ import annotations

import hashlib
import pathlib

import pytest

from gpu_worker.compile import local_cache
from gpu_worker.compile.local_cache import LocalKernelCache


def key(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def test_put_then_get_returns_the_exact_bytes_and_leaves_no_temp_files(
    tmp_path: pathlib.Path,
) -> None:
    cache = LocalKernelCache(tmp_path)
    data = bytes(range(256)) * 10
    assert cache.put(key(1), data), "publish failed"
    assert cache.get(key(1)) == data, "the cache returned different bytes than were stored"
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file() and not p.name.endswith(".bin")]
    assert leftovers == [], f"temp files left behind: {leftovers}"
    assert cache.get(key(2)) is None, "a key never stored must miss"


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage"])
def test_a_corrupt_file_is_a_miss_and_is_removed(tmp_path: pathlib.Path, damage: str) -> None:
    cache = LocalKernelCache(tmp_path)
    cache.put(key(1), b"\x7fELF" + b"x" * 1000)
    path = cache.path_for(key(1))
    blob = bytearray(path.read_bytes())
    if damage == "flip_payload":
        blob[-1] ^= 0xFF
    elif damage == "truncate":
        blob = blob[:20]
    else:
        blob = bytearray(b"not a cache file at all")
    path.write_bytes(bytes(blob))
    assert cache.get(key(1)) is None, "damaged bytes were served"
    assert not path.exists(), "a corrupt file must be removed so it is rewritten"
    assert cache.stats()["corrupt"] == 1


def test_pruning_keeps_the_byte_budget_and_evicts_least_recently_used(
    tmp_path: pathlib.Path,
) -> None:
    payload = 1000
    file_bytes = payload + len(local_cache.MAGIC) + local_cache.DIGEST_BYTES
    cache = LocalKernelCache(tmp_path, max_bytes=3 * file_bytes)
    for n in range(3):
        cache.put(key(n), bytes([n]) * payload)
    assert cache.get(key(0)) is not None, "key 0 should still be cached (budget holds three)"
    cache.put(key(3), b"\x03" * payload)  # over budget: key 1 is now the least recently used
    assert cache.get(key(1)) is None, "the least recently used entry (1) should have been evicted"
    for n in (0, 2, 3):
        assert cache.get(key(n)) is not None, f"entry {n} was evicted although 1 was older"
    stats = cache.stats()
    assert stats["bytes"] <= 3 * file_bytes, f"budget exceeded: {stats}"
    assert stats["evictions"] == 1, f"expected exactly one eviction: {stats}"


def test_a_zero_budget_is_unbounded(tmp_path: pathlib.Path) -> None:
    cache = LocalKernelCache(tmp_path, max_bytes=0)
    for n in range(20):
        cache.put(key(n), b"y" * 4096)
    assert cache.stats()["entries"] == 20, "max_bytes=0 must never evict"


def test_a_second_instance_on_the_same_directory_sees_the_entries(tmp_path: pathlib.Path) -> None:
    LocalKernelCache(tmp_path).put(key(7), b"shared")
    assert LocalKernelCache(tmp_path).get(key(7)) == b"shared", "entries must outlive the instance"


def test_an_unwritable_directory_makes_put_fail_softly(tmp_path: pathlib.Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cache = LocalKernelCache(blocker / "kernels")  # its parent is a file: mkdir fails
    assert cache.put(key(1), b"data") is False, "a failed write must report False, not raise"
    assert cache.get(key(1)) is None


def test_keys_that_are_not_hex_digests_are_refused(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="not a cache key"):
        LocalKernelCache(tmp_path).get("../../etc/passwd")


def test_defaults_come_from_xdg_cache_home_and_the_budget_variable(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert local_cache.default_cache_dir() == tmp_path / "gpuplane" / "kernels"
    monkeypatch.delenv(local_cache.MAX_BYTES_ENV, raising=False)
    assert local_cache.default_max_bytes() == 256 << 20, "the default budget is 256 MiB"
    monkeypatch.setenv(local_cache.MAX_BYTES_ENV, "0")
    assert local_cache.default_max_bytes() == 0
    monkeypatch.setenv(local_cache.MAX_BYTES_ENV, "64MiB")
    assert local_cache.default_max_bytes() == 64 << 20
    monkeypatch.setenv(local_cache.MAX_BYTES_ENV, "-5")
    with pytest.raises(ValueError, match=local_cache.MAX_BYTES_ENV):
        local_cache.default_max_bytes()


def test_put_many_publishes_every_item_then_prunes_to_the_budget(tmp_path: pathlib.Path) -> None:
    file_bytes = 1000 + len(local_cache.MAGIC) + local_cache.DIGEST_BYTES
    cache = LocalKernelCache(tmp_path, max_bytes=2 * file_bytes)
    assert cache.put_many({key(n): bytes([n]) * 1000 for n in range(2)}) == 2
    cache.put_many({key(2): b"\x02" * 1000})
    stats = cache.stats()
    assert stats["entries"] == 2 and stats["bytes"] <= 2 * file_bytes, f"budget not kept: {stats}"
    assert cache.get(key(2)) is not None, "the newest entry must survive its own prune"
