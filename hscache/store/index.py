"""The per-sequence index: its parquet schema, part files, and the expanded metadata columns.

One row per sequence (``seq_id``, ``record_id``, ``offset``, ``length``, ``prompt_len``,
``stop_reason``, ``token_sha256``, ``metadata_json``), in parts ``index/part-NNNNNN.parquet``
that the manifest lists. The writer appends parts; the reader, shards and verify read them.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from hscache.errors import CacheFormatError
from hscache.store import jsonio
from hscache.store.layout import MANIFEST

__all__ = [
    "INDEX_SCHEMA",
    "empty_index",
    "expand_metadata",
    "index_part_path",
    "parquet_bytes",
    "read_part",
    "read_part_bytes",
]

INDEX_SCHEMA = pa.schema(
    [
        ("seq_id", pa.int64()),
        ("record_id", pa.string()),
        ("offset", pa.int64()),
        ("length", pa.int32()),
        ("prompt_len", pa.int32()),
        ("stop_reason", pa.string()),
        ("token_sha256", pa.string()),
        ("metadata_json", pa.string()),
    ]
)

_PART_NAME = re.compile(r"^index/part-\d{6}\.parquet$")


def index_part_path(root: Path, name: str) -> Path:
    """The file of index part ``name`` (as listed in the manifest), checked to stay inside ``root``.

    Raises:
        CacheFormatError: ``name`` is not ``index/part-NNNNNN.parquet`` or resolves outside ``root``
            (e.g. through a symlink).
    """
    if not isinstance(name, str) or not _PART_NAME.match(name):
        raise CacheFormatError(f"manifest lists index part {name!r}, which is not index/part-NNNNNN.parquet")
    path = (Path(root) / name).resolve()
    if Path(root).resolve() not in path.parents:
        raise CacheFormatError(f"index part {name!r} points outside the cache directory")
    return path


def read_part(root: Path, name: str) -> pa.Table:
    """Index part ``name`` of the cache at ``root``.

    Raises:
        CacheFormatError: the part is missing, unreadable, or its name is not a part name.
    """
    path = index_part_path(root, name)
    try:
        return pq.read_table(path)
    except FileNotFoundError as exc:
        raise CacheFormatError(
            f"index part {name} listed in {MANIFEST} is missing; the cache is damaged: run `hscache verify "
            f"{root}`, then re-extract with --overwrite"
        ) from exc
    except (OSError, pa.ArrowException) as exc:
        raise CacheFormatError(
            f"index part {name} is unreadable ({exc}); run `hscache verify {root}`"
        ) from exc


def read_part_bytes(name: str, data: bytes) -> pa.Table:
    """Index part ``name`` from its bytes, already read (and checked) by the caller.

    Raises:
        CacheFormatError: the bytes are not a parquet file.
    """
    try:
        return pq.read_table(pa.BufferReader(data))
    except (OSError, pa.ArrowException) as exc:
        raise CacheFormatError(f"index part {name} is unreadable ({exc})") from exc


def expand_metadata(table: pa.Table) -> pa.Table:
    """Turn the ``metadata_json`` column into one column per key (e.g. ``category``).

    Only the distinct metadata strings are parsed (a million sequences usually carry a handful
    of distinct ``{"category": ...}`` objects); the columns are then gathered in Arrow.
    """
    if table.num_rows == 0:
        return table
    encoded = table.column("metadata_json").combine_chunks().dictionary_encode()
    try:
        records = [jsonio.loads(s) if s else {} for s in encoded.dictionary.to_pylist()]
    except json.JSONDecodeError as exc:
        raise CacheFormatError(
            f"an index row's metadata_json is not valid JSON ({exc}); the cache is damaged"
        ) from exc
    if not all(isinstance(r, dict) for r in records):
        raise CacheFormatError("an index row's metadata_json is not a JSON object; the cache is damaged")
    keys = sorted({k for r in records for k in r} - set(table.column_names))
    for key in keys:
        values = [r.get(key) for r in records]
        try:
            column = pa.array(values)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            column = pa.array([None if v is None else json.dumps(v) for v in values])
        table = table.append_column(key, column.take(encoded.indices))
    return table


def empty_index() -> pa.Table:
    """The index of a cache with no committed sequence."""
    return INDEX_SCHEMA.empty_table()


def parquet_bytes(table: pa.Table) -> bytes:
    """``table`` as the bytes of one index part file."""
    sink = io.BytesIO()
    pq.write_table(table, sink, compression="zstd", row_group_size=65536)
    return sink.getvalue()
