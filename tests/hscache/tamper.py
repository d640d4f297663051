"""Reseal a cache after an edit, as anyone can: recompute every hash the manifest records.

The checksums catch accidents and inconsistent edits; a resealed edit passes them by design,
and only the cache's digest (``hscache.cache_digest``), pinned before the edit, tells (issue 18).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import zarr

from hscache.store import integrity
from hscache.store.layout import ARRAYS_GROUP, INDEX_DIR, PROVENANCE, TARGET_DIR


def reseal(root: Path) -> None:
    """Recompute the manifest's checksums, array metadata and chunk hashes, and its seal."""
    manifest = json.loads((root / "manifest.json").read_text())
    covered = [*manifest["index_parts"], TARGET_DIR, PROVENANCE, f"{ARRAYS_GROUP}/zarr.json"]
    manifest["checksums"] = {
        rel: integrity.digest_file(root / rel) for rel in integrity.files_under(root, covered)
    }
    tokens = int(manifest["committed"]["tokens"])
    for name, entry in manifest["arrays"].items():
        meta = json.loads((root / ARRAYS_GROUP / name / "zarr.json").read_text())
        entry["zarr_json_sha256"] = integrity.zarr_json_sha256(meta)
        array, step = zarr.open_array(str(root / ARRAYS_GROUP / name), mode="r"), entry["chunk_tokens"]
        entry["chunk_sha256"] = [
            integrity.rows_sha256(np.asarray(array[a : min(tokens, a + step)]))
            for a in range(0, tokens, step)
        ]
    assert all(p.startswith(f"{INDEX_DIR}/") for p in manifest["index_parts"])
    integrity.seal(manifest)
    (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
