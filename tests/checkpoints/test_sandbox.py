"""The model root is a sandbox for every file a checkpoint load reads, not only its directory:
each file resolves under the root (symlinks followed), only regular files are opened, and errors
name paths relative to the root without revealing anything about files outside it."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import socket
import threading

import pytest

from gpu_worker.checkpoints import Checkpoint, CheckpointError, CheckpointFiles
from gpu_worker.checkpoints.text import TextCodec
from services.common.errors import PermissionDenied

GOLDEN = pathlib.Path(__file__).parent / "golden"


@pytest.fixture
def root(tmp_path):
    """A model root `models/` next to a directory `outside/` that holds a copy of every golden
    file a hostile checkpoint could point at."""
    (tmp_path / "models").mkdir()
    shutil.copytree(GOLDEN / "llama-tied", tmp_path / "outside")
    (tmp_path / "outside" / "secret").write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x00{}" + b"s" * 61)
    return tmp_path / "models"


def _copy(root: pathlib.Path, name: str, as_name: str | None = None) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(GOLDEN / name, root / (as_name or name)))


def _open(root: pathlib.Path, name: str) -> Checkpoint:
    return Checkpoint.open(root / name, 256, root=root)


class _Opens:
    """Every path `os.open` is called with while installed (what the loader tried to read)."""

    def __init__(self, monkeypatch) -> None:
        self.paths: list[str] = []
        real = os.open

        def spy(path, *args, **kwargs):
            self.paths.append(os.fspath(path))
            return real(path, *args, **kwargs)
        monkeypatch.setattr(os, "open", spy)

    def under(self, directory: pathlib.Path) -> list[str]:
        d = os.path.realpath(directory)
        return [p for p in self.paths if os.path.realpath(p).startswith(d + os.sep)]


def test_a_checkpoint_inside_the_root_loads_through_the_sandbox(root):
    _copy(root, "llama-tied")
    with _open(root, "llama-tied") as ckpt:
        assert len(list(ckpt.weights())) > 0


def test_a_symlinked_weight_file_leading_outside_the_root_is_refused(root):
    d = _copy(root, "llama-tied")
    (d / "model.safetensors").unlink()
    os.symlink(root.parent / "outside" / "model.safetensors", d / "model.safetensors")
    with pytest.raises(PermissionDenied, match="llama-tied/model.safetensors resolves outside "
                                               "the model root") as err:
        _open(root, "llama-tied")
    assert "outside/" not in err.value.message, "the target's path must not be echoed"


def test_a_symlinked_config_leading_outside_the_root_is_refused(root):
    d = _copy(root, "llama-tied")
    (d / "config.json").unlink()
    os.symlink(root.parent / "outside" / "config.json", d / "config.json")
    with pytest.raises(PermissionDenied, match="llama-tied/config.json resolves outside"):
        _open(root, "llama-tied")


def test_a_symlinked_tokenizer_leading_outside_the_root_is_refused(root):
    d = _copy(root, "llama-tied")
    (d / "tokenizer.json").unlink()
    os.symlink(root.parent / "outside" / "tokenizer.json", d / "tokenizer.json")
    with pytest.raises(PermissionDenied, match="llama-tied/tokenizer.json resolves outside"):
        TextCodec.for_checkpoint(d, root)


def test_symlinks_that_stay_inside_the_root_are_followed(root):
    """A Hugging Face cache shares files between snapshots through symlinks into `blobs/`."""
    d = _copy(root, "llama-tied", "snapshots/abc")
    (root / "blobs").mkdir()
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (d / name).rename(root / "blobs" / name)
        os.symlink(os.path.join("..", "..", "blobs", name), d / name)
    assert TextCodec.for_checkpoint(d, root) is not None
    with _open(root, "snapshots/abc") as ckpt:
        assert len(list(ckpt.weights())) > 0


def test_without_the_model_root_the_directory_is_its_own_sandbox(root):
    """The strict default: a link to a sibling directory of the root is refused."""
    d = _copy(root, "llama-tied", "snapshots/abc")
    (root / "blobs").mkdir()
    (d / "config.json").rename(root / "blobs" / "config.json")
    os.symlink(root / "blobs" / "config.json", d / "config.json")
    with pytest.raises(PermissionDenied):
        Checkpoint.open(d, 256)


def _write_index(directory: pathlib.Path, shard: str) -> None:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))


def test_an_index_naming_a_shard_outside_the_root_is_refused_without_reading_it(root, monkeypatch):
    d = _copy(root, "llama-llama3-sharded", "s")
    _write_index(d, "../../outside/model.safetensors")
    opens = _Opens(monkeypatch)
    with pytest.raises(PermissionDenied, match=r"s/\.\./\.\./outside/model.safetensors resolves "
                                               "outside the model root"):
        _open(root, "s")
    assert opens.under(root.parent / "outside") == [], "a file outside the root was opened"
    assert not [p for p in opens.under(d) if p.endswith(".safetensors")], \
        "every name in the index is checked before any shard is opened"


@pytest.mark.parametrize("target", ["/etc/passwd", "/proc/self/environ", "secret"])
def test_an_index_pointing_at_a_host_file_reveals_nothing_about_it(root, monkeypatch, target):
    """The error is the same whether the file exists or not, and holds no number read from it
    (before the sandbox, /etc/passwd answered 'header length 3475222254926655346', its first 8
    bytes, and 'the file of 1221 bytes', its size)."""
    d = _copy(root, "llama-llama3-sharded", "s")
    shard = str(root.parent / "outside" / target) if target == "secret" else target
    _write_index(d, shard)
    opens = _Opens(monkeypatch)
    with pytest.raises(PermissionDenied) as exists:
        _open(root, "s")
    assert not [p for p in opens.paths if os.path.realpath(p) == os.path.realpath(shard)]
    _write_index(d, shard + ".does-not-exist")
    with pytest.raises(PermissionDenied) as absent:
        _open(root, "s")
    assert exists.value.message.replace(shard, "X") == absent.value.message.replace(
        shard + ".does-not-exist", "X"), "existence of a file outside the root must not show"
    assert "header" not in exists.value.message and "bytes" not in exists.value.message


def test_an_index_naming_dot_dot_inside_the_root_is_followed(root):
    """`..` is not refused as such: only where the name resolves matters."""
    d = _copy(root, "llama-llama3-sharded", "s")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    (root / "shared").mkdir()
    moved = "model-00002-of-00004.safetensors"
    (d / moved).rename(root / "shared" / moved)
    index["weight_map"] = {k: (f"../shared/{v}" if v == moved else v)
                           for k, v in index["weight_map"].items()}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with _open(root, "s") as ckpt:
        assert len(list(ckpt.weights())) > 0


def test_an_index_naming_too_many_files_is_refused_before_resolving_them(root, monkeypatch):
    d = _copy(root, "llama-llama3-sharded", "s")
    names = {f"t{i}": f"shard-{i}.safetensors" for i in range(5000)}
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    resolved: list[str] = []
    real = os.path.realpath
    monkeypatch.setattr(os.path, "realpath", lambda p, **kw: resolved.append(p) or real(p, **kw))
    with pytest.raises(CheckpointError, match="names 5000 files, more than the 4096"):
        _open(root, "s")
    assert not [p for p in resolved if "shard-" in os.fspath(p)]


def test_modules_json_path_outside_the_root_is_refused(root):
    d = _copy(root, "bert-st")
    (root.parent / "outside" / "pool").mkdir()
    (root.parent / "outside" / "pool" / "config.json").write_text(
        json.dumps({"pooling_mode_mean_tokens": True}))
    modules = json.loads((d / "modules.json").read_text())
    modules[1]["path"] = "../../outside/pool"
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PermissionDenied, match=r"bert-st/\.\./\.\./outside/pool/config.json "
                                               "resolves outside"):
        _open(root, "bert-st")


def test_modules_json_absolute_path_is_refused(root):
    d = _copy(root, "bert-st")
    modules = json.loads((d / "modules.json").read_text())
    modules[1]["path"] = str(root.parent / "outside")
    (d / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(PermissionDenied):
        _open(root, "bert-st")


def _refused_promptly(call, unblock: pathlib.Path) -> BaseException:
    """Run `call` in a thread; it must end (with an exception) within 10 s. If it blocks in an
    open or read of the FIFO `unblock`, opening the FIFO's other end releases it."""
    outcome: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001  (reported to the test thread)
            outcome.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10.0)
    if t.is_alive():
        fd = os.open(unblock, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10.0)
        pytest.fail("the load blocked on a FIFO")
    assert outcome, "a FIFO was accepted as a checkpoint file"
    return outcome[0]


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_a_fifo_in_place_of_the_weights_is_refused_without_blocking(root, name):
    d = _copy(root, "llama-tied")
    (d / name).unlink()
    os.mkfifo(d / name)

    def load() -> None:
        TextCodec.for_checkpoint(d, root)
        _open(root, "llama-tied").close()
    exc = _refused_promptly(load, d / name)
    assert isinstance(exc, CheckpointError), repr(exc)
    assert f"llama-tied/{name} is a FIFO, not a regular file" in exc.message


def test_a_socket_in_place_of_a_shard_is_refused(root, monkeypatch):
    d = _copy(root, "llama-llama3-sharded", "s")
    shard = d / "model-00003-of-00004.safetensors"
    shard.unlink()
    monkeypatch.chdir(d)   # bound by its relative name: a CI checkout's tmp path passes 108 bytes
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(shard.name)
        with pytest.raises(CheckpointError, match="is a socket, not a regular file"):
            _open(root, "s")


def test_a_device_linked_from_inside_the_root_is_refused(root):
    """A device is outside the root; the same link resolving inside still meets the stat check."""
    d = _copy(root, "llama-tied")
    (d / "model.safetensors").unlink()
    os.symlink("/dev/zero", d / "model.safetensors")
    with pytest.raises(PermissionDenied):
        _open(root, "llama-tied")
    files = CheckpointFiles(d, root)
    with pytest.raises(CheckpointError, match="is a directory, not a regular file"):
        files.open(".")


def test_errors_name_files_relative_to_the_root_never_by_absolute_path(root):
    d = _copy(root, "llama-llama3-sharded", "s")
    (d / "model-00003-of-00004.safetensors").unlink()
    with pytest.raises(CheckpointError) as err:
        _open(root, "s")
    assert err.value.message.startswith("s/model-00003-of-00004.safetensors: file is missing")
    assert str(root) not in err.value.message
    assert all(str(root) not in str(v) for v in err.value.details.values()), \
        "error details reach the client too"


def test_an_oversized_config_is_refused_before_it_is_read(root):
    d = _copy(root, "llama-tied")
    with open(d / "config.json", "ab") as f:
        f.truncate(2 << 20)   # sparse: 2 MiB of zeros after the JSON
    with pytest.raises(CheckpointError, match="llama-tied/config.json is 2097152 bytes, more "
                                              "than the 1048576"):
        _open(root, "llama-tied")
