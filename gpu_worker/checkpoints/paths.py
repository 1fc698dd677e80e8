"""The model root is a sandbox: every directory and every file a checkpoint load reads lies under it.

Hazard: both the path (`LoadModelRequest.checkpoint`, from any client) and the checkpoint's own
files are hostile input. A symlinked `config.json`, an index whose `weight_map` names
`../../elsewhere/x.safetensors` or `/etc/passwd`, a sentence-transformers `modules.json` `path` of
`../../` would otherwise make the worker read any file it can; a FIFO in place of the weights
blocks the reading thread forever; and an error message that quotes a header length or a file size
turns the worker into an oracle for the contents and existence of files outside the root.

Contract:
- `resolve_checkpoint` resolves the directory (symlinks followed) and requires it under the
  resolved root: PERMISSION_DENIED outside, FAILED_PRECONDITION without a root, NOT_FOUND when
  absent.
- `CheckpointFiles` is the one gate every file read of a load goes through. A name (relative to
  the checkpoint directory, as the checkpoint writes it) is resolved with every symlink followed
  and must stay under the root (PERMISSION_DENIED, the message naming only the name as written:
  nothing about the target, not even whether it exists); then only a regular file is opened: it
  is checked with `stat` before the open (no device is ever opened), opened with O_NONBLOCK (a
  FIFO swapped in after the check cannot block), and checked again with `fstat` and, on Linux,
  through `/proc/self/fd` (a path component swapped for a symlink after the check is caught).
  Anything else about a file under the root (missing, not regular, too large) is INVALID_ARGUMENT.
- Errors name files relative to the root (`llama/model.safetensors`), never by absolute path.
Cost: a realpath, a stat and an fstat per file opened; at most a few dozen files per checkpoint.
"""
from __future__ import annotations

import os
import pathlib
import stat

from services.common.errors import FailedPrecondition, InvalidArgument, NotFound, PermissionDenied

_PROC_FD = pathlib.Path("/proc/self/fd")


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def resolve_checkpoint(model_root: pathlib.Path | None, checkpoint: str) -> pathlib.Path:
    """The real directory of `checkpoint` (relative to `model_root`, or absolute inside it)."""
    if model_root is None:
        raise FailedPrecondition("this worker has no --model-root (GPUPLANE_WORKER_MODEL_ROOT): "
                                 "it serves synthetic models only")
    root = os.path.realpath(model_root)
    resolved = os.path.realpath(os.path.join(root, checkpoint))
    if not _inside(resolved, root):
        raise PermissionDenied(f"checkpoint {checkpoint!r} resolves outside the model root "
                               f"{root!r}: only directories under it may be loaded",
                               checkpoint=checkpoint)
    if not os.path.isdir(resolved):
        raise NotFound(f"checkpoint directory {checkpoint!r} does not exist under the model root "
                       f"{root!r}", checkpoint=checkpoint)
    return pathlib.Path(resolved)


class CheckpointError(InvalidArgument):
    """A checkpoint file or tensor that cannot be used as it is (INVALID_ARGUMENT)."""


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "directory"), (stat.S_ISFIFO, "FIFO"),
                       (stat.S_ISSOCK, "socket"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device")):
        if test(mode):
            return name
    return "special file"


class CheckpointFiles:
    """The files of one checkpoint directory, read only through the model-root sandbox.

    `root` is the model root (the sandbox); None makes the checkpoint directory its own root,
    the strictest choice (tests and tools that open a directory directly). Checkpoints that share
    files through symlinks inside the root (a Hugging Face cache's `snapshots/` -> `blobs/`) need
    the model root passed."""

    def __init__(self, directory: pathlib.Path, root: pathlib.Path | None = None) -> None:
        self.directory = os.path.realpath(directory)
        self.root = os.path.realpath(root) if root is not None else self.directory
        if not _inside(self.directory, self.root):
            raise PermissionDenied(f"checkpoint {os.path.basename(self.directory)!r} resolves "
                                   "outside the model root")
        rel = os.path.relpath(self.directory, self.root)
        self._prefix = "" if rel == "." else rel + "/"

    @property
    def path(self) -> pathlib.Path:
        """The checkpoint directory, resolved."""
        return pathlib.Path(self.directory)

    def name(self, rel: str) -> str:
        """How errors name `rel`: relative to the model root, as the checkpoint spells it."""
        return self._prefix + rel

    def resolve(self, rel: str) -> str:
        """The real path of `rel` (relative to the checkpoint directory), which must lie under
        the root. Raises PERMISSION_DENIED otherwise, saying nothing about the target."""
        if not isinstance(rel, str) or not rel or "\0" in rel:
            raise CheckpointError(f"a file name of the checkpoint is not a non-empty path: "
                                  f"{str(rel)[:80]!r}")
        real = os.path.realpath(os.path.join(self.directory, rel))
        if not _inside(real, self.root):
            raise PermissionDenied(f"{self.name(rel)} resolves outside the model root: every file "
                                   "a checkpoint reads (directly, through a symlink, or named by "
                                   "an index or modules.json) must lie under it",
                                   file=self.name(rel))
        return real

    def exists(self, rel: str) -> bool:
        """Whether the checkpoint has an entry `rel` (a dangling symlink counts: opening it then
        says it is missing). The name must resolve under the root even to be asked about."""
        self.resolve(rel)
        return os.path.lexists(os.path.join(self.directory, rel))

    def open(self, rel: str) -> int:
        """A read-only file descriptor of the regular file `rel`; the caller closes it."""
        real = self.resolve(rel)
        name = self.name(rel)
        try:
            mode = os.stat(real).st_mode
        except FileNotFoundError:
            raise CheckpointError(f"{name}: file is missing", file=name) from None
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot be read ({exc.strerror})", file=name) from None
        if not stat.S_ISREG(mode):
            raise CheckpointError(f"{name} is a {_kind(mode)}, not a regular file: only regular "
                                  "files are read from a checkpoint", file=name)
        try:
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise CheckpointError(f"{name}: cannot be read ({exc.strerror})", file=name) from None
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                raise CheckpointError(f"{name} is a {_kind(mode)}, not a regular file: only "
                                      "regular files are read from a checkpoint", file=name)
            self._check_opened(fd, rel)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_opened(self, fd: int, rel: str) -> None:
        """What was opened is what was checked: a path component replaced by a symlink between
        the realpath and the open would show here (Linux; elsewhere the stat checks stand)."""
        try:
            opened = os.readlink(_PROC_FD / str(fd))
        except OSError:
            return
        if not _inside(opened, self.root):
            raise PermissionDenied(f"{self.name(rel)} resolves outside the model root: every file "
                                   "a checkpoint reads must lie under it", file=self.name(rel))

    def read_bytes(self, rel: str, limit: int, what: str) -> bytes:
        """The whole of `rel`, refused (before reading) when larger than `limit` bytes."""
        fd = self.open(rel)
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise CheckpointError(f"{self.name(rel)} is {size} bytes, more than the {limit} a "
                                      f"{what} may have", file=self.name(rel))
            chunks, left = [], limit + 1   # a file that grows while read is cut at the limit
            while left > 0:
                chunk = os.read(fd, min(left, 1 << 20))
                if not chunk:
                    break
                chunks.append(chunk)
                left -= len(chunk)
        except BlockingIOError:
            raise CheckpointError(f"{self.name(rel)}: not readable without blocking",
                                  file=self.name(rel)) from None
        finally:
            os.close(fd)
        data = b"".join(chunks)
        if len(data) > limit:
            raise CheckpointError(f"{self.name(rel)} grew past the {limit} bytes a {what} may "
                                  "have while it was read", file=self.name(rel))
        return data
