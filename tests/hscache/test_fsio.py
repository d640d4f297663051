"""The store's one file-hash and atomic-write helpers (used by capture, store and scorer)."""

from __future__ import annotations

import hashlib

import pytest

from hscache.store import fsio


def test_file_sha256_equals_hashlib_over_the_whole_file_across_blocks(tmp_path):
    path = tmp_path / "f.bin"
    data = bytes(range(256)) * 1000 + b"tail"
    path.write_bytes(data)
    assert fsio.file_sha256(path, block_bytes=4096) == hashlib.sha256(data).hexdigest()


def test_atomic_write_with_publishes_whole_files_or_nothing(tmp_path):
    path = tmp_path / "model.safetensors"
    assert fsio.atomic_write_with(path, lambda p: p.write_bytes(b"new")) == path
    assert path.read_bytes() == b"new"

    def torn(p):
        p.write_bytes(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        fsio.atomic_write_with(path, torn)
    assert path.read_bytes() == b"new"  # the old file stays, and no temp file is left behind
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
