"""A valid cache whose index lists N sequences: the source's own, then one-token copies (index-scale tests).

    python bench/synthetic_index.py SRC_CACHE OUT N

Used by bench/real_dims.py (opening a 1,000,000-sequence index) and by the index tests. The result is a
cache by the documented format (``hscache verify`` passes it): every index row has its own tokens,
offsets contiguous and the lengths summing to the committed tokens. The source's sequences keep their
rows and data; each added row is one prompt token, a copy of the source's last token (its hidden
states, token id and target outputs), appended to every array, with chunk hashes and the seal redone.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from hscache.store import integrity


def _extend_arrays(out: Path, manifest: dict, tokens: int, added: int) -> None:
    """Append ``added`` copies of token ``tokens - 1`` to every array and re-record its chunk hashes."""
    for name, entry in manifest["arrays"].items():
        array = zarr.open_array(str(out / "arrays" / name), mode="a")
        array = array.with_config({"write_empty_chunks": True})  # a chunk of zeros is data, not absent
        last = np.asarray(array[tokens - 1 : tokens])
        array.resize((tokens + added, *array.shape[1:]))
        ct = int(entry["chunk_tokens"])
        step = max(ct, (1 << 26) // max(1, last.nbytes))  # whole chunks, about 64 MB at a time
        step -= step % ct
        a = tokens
        while a < tokens + added:
            b = min(tokens + added, (a // ct) * ct + step)  # up to a chunk boundary
            array[a:b] = np.broadcast_to(last, (b - a, *last.shape[1:]))
            a = b
        total = tokens + added
        hashes = []
        for first in range(0, total, ct):
            hashes.append(integrity.rows_sha256(np.asarray(array[first : min(total, first + ct)])))
        entry["chunk_sha256"] = hashes
        meta = json.loads((out / "arrays" / name / "zarr.json").read_text())
        entry["zarr_json_sha256"] = integrity.zarr_json_sha256(meta)


def synthetic_index(src: Path, out: Path, n: int) -> Path:
    """Copy ``src`` to ``out`` and make its index ``n`` rows: the source's rows, then one-token
    rows (copies of row 0's fields, seq_id and record_id unique, a handful of categories)."""
    shutil.copytree(src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    kept = int(manifest["committed"]["sequences"])
    tokens = int(manifest["committed"]["tokens"])
    if n < kept:
        raise ValueError(f"n={n} is fewer than the source's {kept} sequences")
    source = pa.concat_tables([pq.read_table(out / p) for p in manifest["index_parts"]]).slice(0, kept)
    added = n - kept
    _extend_arrays(out, manifest, tokens, added)
    token = np.asarray(zarr.open_array(str(out / "arrays" / "token_ids"), mode="r")[tokens - 1 : tokens])
    copies = source.slice(0, 1).take(pa.array(np.zeros(added, dtype=np.int64)))
    columns = {
        "offset": pa.array(np.arange(tokens, tokens + added, dtype=np.int64)),
        "length": pa.array(np.ones(added, dtype=np.int64)),
        "prompt_len": pa.array(np.ones(added, dtype=np.int64)),
        "token_sha256": pa.array([integrity.rows_sha256(token)] * added),
    }
    for name, values in columns.items():
        i = copies.schema.get_field_index(name)
        copies = copies.set_column(i, copies.schema.field(name), values.cast(copies.schema.field(name).type))
    table = pa.concat_tables([source, copies])
    table = table.set_column(0, table.schema.field(0), pa.array(np.arange(n), table.schema.field(0).type))
    ids = pa.array([f"r{i}" for i in range(n)])
    table = table.set_column(table.schema.get_field_index("record_id"), "record_id", ids)
    categories = pa.array(['{"category": "code"}', '{"category": "math"}', '{"category": "chat"}'])
    meta = categories.take(pa.array(np.arange(n) % 3))
    table = table.set_column(table.schema.get_field_index("metadata_json"), "metadata_json", meta)
    for part in manifest["index_parts"]:
        (out / part).unlink()
    pq.write_table(table, out / "index" / "part-000000.parquet")
    manifest["index_parts"] = ["index/part-000000.parquet"]
    manifest["committed"] = {**manifest["committed"], "sequences": n, "tokens": tokens + added}
    # The synthetic index is a new commit: record its checksums and re-seal the manifest.
    checksums = manifest.get("checksums", {})
    for part in list(checksums):
        if part.startswith("index/"):
            del checksums[part]
    for rel in ("index/part-000000.parquet", "arrays/zarr.json"):
        if rel in checksums or rel.startswith("index/"):
            checksums[rel] = integrity.digest_file(out / rel)
    integrity.seal(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


if __name__ == "__main__":
    synthetic_index(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
