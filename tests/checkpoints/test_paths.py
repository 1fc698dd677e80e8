"""A checkpoint path from a client may only name a directory inside the worker's model root."""
from __future__ import annotations

import os

import pytest

from gpu_worker.checkpoints.paths import resolve_checkpoint
from services.common.errors import FailedPrecondition, NotFound, PermissionDenied


@pytest.fixture
def root(tmp_path):
    (tmp_path / "models" / "llama").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    return tmp_path / "models"


def test_relative_and_absolute_paths_inside_the_root_resolve(root):
    assert resolve_checkpoint(root, "llama") == (root / "llama").resolve()
    assert resolve_checkpoint(root, str(root / "llama")) == (root / "llama").resolve()


@pytest.mark.parametrize("path", ["../outside", "/etc", "llama/../../outside"])
def test_paths_that_leave_the_root_are_permission_denied(root, path):
    with pytest.raises(PermissionDenied, match="outside the model root"):
        resolve_checkpoint(root, path)


def test_a_symlink_out_of_the_root_is_permission_denied(root):
    os.symlink(root.parent / "outside", root / "sneaky")
    with pytest.raises(PermissionDenied):
        resolve_checkpoint(root, "sneaky")


def test_a_missing_directory_inside_the_root_is_not_found(root):
    with pytest.raises(NotFound, match="does not exist"):
        resolve_checkpoint(root, "nope")


def test_a_worker_without_a_model_root_refuses_every_checkpoint(root):
    with pytest.raises(FailedPrecondition, match="--model-root"):
        resolve_checkpoint(None, "llama")
