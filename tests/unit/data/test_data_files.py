"""Tests of flaxformer_lite.atomic_files.atomic_write: a file is replaced whole or not at all."""

from __future__ import annotations

import os

import pytest

from flaxformer_lite import atomic_files


def test_writes_a_new_file(tmp_path):
    path = tmp_path / "model.spm"
    atomic_files.atomic_write(path, b"first")
    assert path.read_bytes() == b"first"
    assert os.listdir(tmp_path) == ["model.spm"]


def test_replaces_an_existing_file(tmp_path):
    path = tmp_path / "model.spm"
    path.write_bytes(b"a much longer old content")
    atomic_files.atomic_write(str(path), b"new")
    assert path.read_bytes() == b"new"
    assert os.listdir(tmp_path) == ["model.spm"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.spm"
    path.write_bytes(b"old")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        atomic_files.atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["model.spm"]
