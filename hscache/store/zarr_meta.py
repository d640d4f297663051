"""A zarr array opened from the ``zarr.json`` bytes that were checked, never from a second read.

``check_array_metadata`` (store/integrity.py) reads and hashes each array's ``zarr.json``; zarr's own
``group[name]`` would read it again (or take it from the group's consolidated metadata), so a file
swapped in between would set the dtype, codecs and shape the rows are decoded with (issue 52). The
reader builds the array from the checked document instead.
"""

from __future__ import annotations

from typing import Any

import zarr

from hscache.store import jsonio

__all__ = ["array_from_metadata"]


def array_from_metadata(group: zarr.Group, name: str, document: bytes) -> zarr.Array:
    """Array ``name`` of ``group`` (its store: local or remote) with ``document`` as its metadata,
    parsed as zarr parses a ``zarr.json`` (``zarr.core.group._read_metadata_v3``)."""
    from zarr.core.array import AsyncArray
    from zarr.core.metadata import ArrayV3Metadata
    from zarr.storage import StorePath

    meta: Any = jsonio.loads(document)
    path = f"{group.path}/{name}" if group.path else name
    return zarr.Array(AsyncArray(ArrayV3Metadata.from_dict(meta), store_path=StorePath(group.store, path)))
