"""A cache whose index lists N sequences, all pointing at the first real one (index-only scale test).

    python bench/synthetic_index.py SRC_CACHE OUT N

Used by bench/real_dims.py (opening a 1,000,000-sequence index) and by the index tests.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from hscache.store import integrity


def synthetic_index(src: Path, out: Path, n: int) -> Path:
    """Copy ``src`` to ``out`` and give it one index part of ``n`` rows, every row = row 0
    (seq_id and record_id made unique; a handful of categories)."""
    shutil.copytree(src, out)
    manifest = json.loads((out / "manifest.json").read_text())
    first = pq.read_table(out / manifest["index_parts"][0]).slice(0, 1)
    table = first.take(pa.array(np.zeros(n, dtype=np.int64)))
    table = table.set_column(0, "seq_id", pa.array(np.arange(n, dtype=np.int64)))
    ids = pa.array([f"r{i}" for i in range(n)])
    table = table.set_column(table.schema.get_field_index("record_id"), "record_id", ids)
    categories = pa.array(['{"category": "code"}', '{"category": "math"}', '{"category": "chat"}'])
    meta = categories.take(pa.array(np.arange(n) % 3))
    table = table.set_column(table.schema.get_field_index("metadata_json"), "metadata_json", meta)
    for part in manifest["index_parts"]:
        (out / part).unlink()
    pq.write_table(table, out / "index" / "part-000000.parquet")
    manifest["index_parts"] = ["index/part-000000.parquet"]
    manifest["committed"]["sequences"] = n
    # The synthetic index is a new commit: record its checksum and re-seal the manifest.
    checksums = manifest.get("checksums", {})
    for part in list(checksums):
        if part.startswith("index/"):
            del checksums[part]
    checksums["index/part-000000.parquet"] = integrity.digest_file(out / "index" / "part-000000.parquet")
    integrity.seal(manifest)
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


if __name__ == "__main__":
    synthetic_index(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
