"""An Arrow IPC stream read with its inflated size bounded before anything is inflated.

``pa.ipc.open_stream(...).read_all()`` inflates every compressed buffer at the size the stream
declares: a 49,992-byte zstd stream describing 1.49 GiB took 171 s and 3.4 GB before any check
(issue 52). Here each record batch's declared buffer sizes (the int64 that prefixes every compressed
buffer, Arrow columnar format "Compression") are summed from its metadata, read from the flatbuffer by
hand (Message.fbs: Message.header -> RecordBatch.buffers / .compression), and the stream is refused
once they pass ``inflate_limit`` of the file's size (the bound SpecForge files have, interop/common.py)
before the batch is decoded.
"""

from __future__ import annotations

import struct
from typing import Any

import pyarrow as pa

from hscache.errors import InputError
from hscache.interop.common import INFLATE_RATIO, inflate_limit

__all__ = ["read_bounded_stream"]


class _Flat:
    """Just enough of a flatbuffer reader for Arrow's Message table (bounds checked: struct.error)."""

    def __init__(self, data: bytes):
        self.data = data

    def u32(self, at: int) -> int:
        return struct.unpack_from("<I", self.data, at)[0]

    def field(self, table: int, index: int) -> int | None:
        """The position of field ``index`` of the table at ``table``, or None when absent."""
        vtable = table - struct.unpack_from("<i", self.data, table)[0]
        size = struct.unpack_from("<H", self.data, vtable)[0]
        if 4 + 2 * index + 2 > size:
            return None
        offset = struct.unpack_from("<H", self.data, vtable + 4 + 2 * index)[0]
        return table + offset if offset else None

    def deref(self, at: int) -> int:
        return at + self.u32(at)


def _declared_bytes(message: Any) -> int:
    """The bytes record batch ``message`` inflates to: each compressed buffer's declared length (the
    body's own size for an uncompressed batch)."""
    body = message.body
    body_bytes = body.size if body is not None else 0
    flat = _Flat(message.metadata.to_pybytes())
    root = flat.u32(0)
    header = flat.field(root, 2)  # Message.header (a RecordBatch for this message type)
    if header is None:
        return body_bytes
    batch = flat.deref(header)
    if flat.field(batch, 3) is None:  # RecordBatch.compression absent: the body is what is read
        return body_bytes
    buffers = flat.field(batch, 2)  # RecordBatch.buffers: [Buffer {offset: long, length: long}]
    if buffers is None:
        return body_bytes
    vector = flat.deref(buffers)
    total, raw = 0, body.to_pybytes() if body is not None else b""
    for i in range(flat.u32(vector)):
        offset, length = struct.unpack_from("<qq", flat.data, vector + 4 + 16 * i)
        if length <= 0:
            continue
        declared = struct.unpack_from("<q", raw, offset)[0]  # -1: stored uncompressed
        total += length - 8 if declared < 0 else declared
    return total


def read_bounded_stream(source: Any, size: int, where: str) -> pa.Table:
    """The Arrow IPC stream in ``source`` (a file of ``size`` bytes, ``where`` names it) as a table,
    each record batch's inflated size counted before it is decoded.

    Raises:
        InputError: the stream would inflate past ``inflate_limit(size)``, or holds other messages.
        pa.ArrowException: the stream is damaged (the caller says so in one line).
    """
    limit = inflate_limit(size)
    reader = pa.ipc.MessageReader.open_stream(source)
    schema, batches, total = None, [], 0
    for message in reader:
        if message.type == "schema" and schema is None:
            schema = pa.ipc.read_schema(message)
            continue
        if message.type != "record batch" or schema is None:
            raise InputError(f"{where} holds an Arrow {message.type} message where record batches belong")
        try:
            total += _declared_bytes(message)
        except struct.error:
            raise InputError(f"{where}: a record batch's metadata is damaged") from None
        if total > limit:
            raise InputError(
                f"{where} inflates to more than {limit >> 20} MiB ({INFLATE_RATIO}x its {size} bytes): a "
                "decompression bomb, or not a speculators data file; rerun speculators' prepare_data.py"
            )
        batches.append(pa.ipc.read_record_batch(message, schema))
    if schema is None:
        raise InputError(f"{where} is an empty Arrow stream (no schema)")
    return pa.Table.from_batches(batches, schema)
