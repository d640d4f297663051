"""Structural checks: manifest, index parts, arrays' metadata, chunk files, target/ and links.

Cheap (no array data is decoded) and run first: they decide whether the per-sequence scans
can map tokens to sequences at all. Nothing here trusts the index or manifest to name safe
paths: index parts go through ``index_part_path`` and symlinks leaving the cache are flagged.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from hscache import schemas
from hscache.errors import CacheFormatError
from hscache.store import jsonio
from hscache.store.compact import exact_problems
from hscache.store.fsio import read_regular
from hscache.store.index import INDEX_SCHEMA, expand_metadata, index_part_path
from hscache.store.integrity import ARRAY_GROUP_META, Mismatch, check_cache, manifest_digest
from hscache.store.layout import (
    ARRAYS_GROUP,
    INDEX_DIR,
    MANIFEST,
    PROVENANCE,
    TARGET_DIR,
    ArraySpec,
    chunk_key,
)
from hscache.store.reader import read_manifest
from hscache.store.run_log import read_run_log
from hscache.store.sampling import sampling_setting
from hscache.store.target_files import check_safetensors
from hscache.verify.report import Problem, VerifyReport

__all__ = ["CacheLayout", "check_structure", "sequences_in"]

_TARGET_FILES = ("config.json", "head.safetensors")


@dataclass
class CacheLayout:
    """What the data checks need: the committed extent, the index, and the open arrays."""

    root: Path
    manifest: dict[str, Any]
    specs: dict[str, ArraySpec]
    arrays: dict[str, zarr.Array]  # only those that opened with the expected shape and dtype
    committed_tokens: int
    index: pa.Table | None  # None when unusable: per-sequence checks are then skipped
    offsets: np.ndarray  # [S] int64 token offset of each sequence
    lengths: np.ndarray  # [S] int64
    url: str | None = None  # a remote cache: ``root`` is its local mirror, chunks live at the URL
    chunk_files: dict[str, set[int]] | None = None  # per array, the chunk indices stored (listed once)

    def stored_chunks(self, name: str) -> set[int]:
        """Indices of the chunk files array ``name`` holds (one directory listing, not one per chunk:
        a zarr.json claiming 10^12 rows costs nothing)."""
        if self.chunk_files is None:
            self.chunk_files = {}
        if name not in self.chunk_files:
            self.chunk_files[name] = _list_chunks(self, name)
        return self.chunk_files[name]

    def chunk_problem(self, name: str, chunk: int) -> str | None:
        """Why chunk ``chunk`` of array ``name`` must not be read through zarr, or None: a local chunk
        file that is not a regular file (a FIFO would block the read forever) or that is reached
        through a symlink (hscache never writes one; it may lead outside the cache)."""
        if self.url is not None:
            return None
        array_dir = self.root / ARRAYS_GROUP / name
        path = array_dir / chunk_key(self.specs[name], chunk)
        if not (path.exists() or path.is_symlink()):
            return None  # missing: named by the files check
        if os.path.realpath(path) != os.path.join(
            os.path.realpath(array_dir), chunk_key(self.specs[name], chunk)
        ):
            return f"chunk file {path.relative_to(self.root)} is reached through a symlink that leads outside the cache"
        if not stat.S_ISREG(os.stat(path).st_mode):
            return f"chunk file {path.relative_to(self.root)} is not a regular file (a FIFO, device or directory)"
        return None

    def record_id(self, seq: int) -> str | None:
        return None if self.index is None else self.index.column("record_id")[seq].as_py()

    def problem(self, check: str, message: str, seq: int, **where: Any) -> Problem:
        """A problem naming sequence row ``seq`` (message prefixed with its ids)."""
        rid = self.record_id(seq)
        return Problem(
            check, f"sequence {seq} (record {rid!r}): {message}", seq_id=seq, record_id=rid, **where
        )


def _list_chunks(layout: CacheLayout, name: str) -> set[int]:
    spec = layout.specs[name]
    depth = len(spec.row_shape)
    if layout.url is not None:
        from hscache.store.remote import list_files  # lazy: fsspec backends are optional

        prefix = f"{ARRAYS_GROUP}/{name}/c/"
        keys = [
            k[len(prefix) :]
            for k in list_files(layout.url, f"{ARRAYS_GROUP}/{name}/c")
            if k.startswith(prefix)
        ]
    else:
        base = layout.root / ARRAYS_GROUP / name / "c"
        keys = (
            [p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()] if base.is_dir() else []
        )
    found = set()
    for key in keys:
        parts = key.split("/")
        if len(parts) == 1 + depth and parts[0].isdigit() and all(x == "0" for x in parts[1:]):
            found.add(int(parts[0]))
    return found


def sequences_in(layout: CacheLayout, start: int, stop: int) -> range:
    """Rows of the sequences holding any token in ``[start, stop)``."""
    if layout.index is None or stop <= start:
        return range(0)
    first = int(np.searchsorted(layout.offsets + layout.lengths, start, side="right"))
    last = int(np.searchsorted(layout.offsets, stop, side="left"))
    return range(first, min(last, len(layout.offsets)))


def check_structure(
    root: Path, report: VerifyReport, allow_unsealed: bool = False, url: str | None = None
) -> CacheLayout | None:
    """Run the manifest, index and files checks; None when the manifest itself is unusable.

    ``url``: a remote cache whose small files ``root`` mirrors (store/remote.py).

    Raises:
        CacheNotFoundError: ``root`` holds no manifest.json (not a cache: bad input).
    """
    try:
        manifest = read_manifest(root)
        schemas.validate(manifest, "manifest")
    except (CacheFormatError, schemas.SchemaError) as exc:
        report.add(Problem("manifest", f"manifest.json is damaged: {exc}"))
        return None
    report.passed("manifest")
    report.digest = manifest_digest(manifest)
    report.sampling = sampling_setting(manifest["settings"]).describe()
    committed = manifest["committed"]
    report.sequences, report.tokens = int(committed["sequences"]), int(committed["tokens"])
    report.complete = bool(manifest["complete"])
    report.layer_ids = list(manifest["settings"]["layer_ids"])
    specs = {name: ArraySpec.from_dict(name, d) for name, d in manifest["arrays"].items()}
    # Before zarr parses anything: damaged metadata (or a seal stripped) is a finding, and an array
    # whose zarr.json disagrees with the manifest is never opened.
    mismatches = check_cache(root, manifest, digests="all", allow_unsealed=allow_unsealed)
    mismatches += exact_problems(root, manifest, "all")  # a compact cache's exact slice (store/compact.py)
    hidden = specs.get("hidden_states")
    if hidden is None or hidden.row_shape[:1] != (len(report.layer_ids),) or "token_ids" not in specs:
        report.add(
            Problem(
                "manifest",
                f"manifest.json arrays do not match its {len(report.layer_ids)} layer_ids "
                "(hidden_states [T, K, H] and token_ids are required)",
            )
        )
        return None
    index = _check_index(root, manifest, report)
    layout = CacheLayout(
        root, manifest, specs, {}, report.tokens, index, np.zeros(0, np.int64), np.zeros(0, np.int64), url
    )
    if index is not None:
        layout.offsets = index.column("offset").to_numpy().astype(np.int64)
        layout.lengths = index.column("length").to_numpy().astype(np.int64)
    report.passed("index")
    _report_mismatches(mismatches, report)
    unsafe = {m.path for m in mismatches if not m.warning}
    if ARRAY_GROUP_META not in unsafe and MANIFEST not in unsafe:
        layout.arrays = _check_arrays(layout, report, unsafe)
    _check_chunk_files(layout, report)
    _check_side_files(root, manifest, report)
    _check_headers(root, manifest, report)
    report.passed("files")
    return layout


def _check_index(root: Path, manifest: dict[str, Any], report: VerifyReport) -> pa.Table | None:
    tables = []
    for name in manifest["index_parts"]:
        try:
            data = read_regular(index_part_path(root, name))  # a FIFO is refused, never waited on
            tables.append(pq.read_table(pa.BufferReader(bytes(data))))
        except CacheFormatError as exc:
            report.add(Problem("index", str(exc)))
        except FileNotFoundError:
            report.add(
                Problem(
                    "index",
                    f"index part {name} listed in manifest.json is missing; "
                    "the sequences it held cannot be located",
                )
            )
        except (OSError, pa.ArrowException) as exc:
            report.add(Problem("index", f"index part {name} is unreadable ({exc})"))
    listed = {root / p for p in manifest["index_parts"]}
    # In a complete cache an unlisted file under index/ is no killed run's leftover: the files check
    # names it as a problem (store/integrity.py), as open_cache refuses it.
    leftovers = [] if manifest.get("complete") else sorted((root / INDEX_DIR).glob("*"))
    for path in leftovers if (root / INDEX_DIR).is_dir() else []:
        if path not in listed:
            report.add(
                Problem(
                    "index",
                    f"{path.relative_to(root)} is not listed in manifest.json (left by a "
                    "killed run; ignored by readers, removed on resume)",
                ),
                warning=True,
            )
    if len(tables) != len(manifest["index_parts"]):
        return None
    if any(t.schema.names != INDEX_SCHEMA.names for t in tables):
        report.add(Problem("index", f"index columns differ from {INDEX_SCHEMA.names}"))
        return None
    table = pa.concat_tables([t.cast(INDEX_SCHEMA) for t in tables]) if tables else INDEX_SCHEMA.empty_table()
    try:
        expand_metadata(table.slice(0, report.sequences))  # what every reader parses at open
    except CacheFormatError as exc:
        report.add(Problem("index", str(exc)))
        return None
    return _check_rows(table, report)


def _check_rows(table: pa.Table, report: VerifyReport) -> pa.Table | None:
    """Row count, seq ids, contiguous offsets and lengths against the manifest's committed extent."""
    if table.num_rows < report.sequences:
        report.add(
            Problem(
                "index",
                f"the index has {table.num_rows} rows but manifest.json commits {report.sequences} sequences",
            )
        )
        return None
    if table.num_rows > report.sequences:
        report.add(
            Problem(
                "index",
                f"the index has {table.num_rows} rows, more than the {report.sequences} committed sequences",
            )
        )
    table = table.slice(0, report.sequences)
    seq_ids = table.column("seq_id").to_numpy()
    offsets = table.column("offset").to_numpy().astype(np.int64)
    lengths = table.column("length").to_numpy().astype(np.int64)
    prompt_lens = table.column("prompt_len").to_numpy().astype(np.int64)
    record_ids = table.column("record_id")  # read per bad row: never the whole index as Python objects
    expected_offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    for i in np.flatnonzero(
        (seq_ids != np.arange(len(seq_ids)))
        | (offsets != expected_offsets)
        | (lengths < 1)
        | (prompt_lens < 0)
        | (prompt_lens > lengths)
    ):
        report.add(
            Problem(
                "index",
                f"sequence {i} (record {record_ids[i].as_py()!r}): index row is inconsistent "
                f"(seq_id {seq_ids[i]}, offset {offsets[i]} expected {expected_offsets[i]}, "
                f"length {lengths[i]}, prompt_len {prompt_lens[i]})",
                seq_id=int(i),
                record_id=record_ids[i].as_py(),
            )
        )
    if int(lengths.sum()) != report.tokens:
        report.add(
            Problem(
                "index",
                f"the index's lengths sum to {int(lengths.sum())} tokens but manifest.json "
                f"commits {report.tokens}",
            )
        )
    return table


def _check_arrays(layout: CacheLayout, report: VerifyReport, unsafe: set[str]) -> dict[str, zarr.Array]:
    """Open each array whose zarr.json passed ``check_array_metadata`` (``unsafe`` names those
    that did not) and check it against the manifest; return those usable."""
    arrays = {}
    try:
        if layout.url is not None:
            from zarr.storage import FsspecStore

            store = FsspecStore.from_url(f"{layout.url}/{ARRAYS_GROUP}", read_only=True)
            group = zarr.open_group(store, mode="r", zarr_format=3)  # no v2 metadata probes
        else:
            group = zarr.open_group(str(layout.root / ARRAYS_GROUP), mode="r", zarr_format=3)
    except (OSError, ValueError) as exc:
        report.add(Problem("files", f"{ARRAYS_GROUP}/ cannot be opened ({exc}); no array can be read"))
        return arrays
    for name, spec in layout.specs.items():
        if f"{ARRAYS_GROUP}/{name}/zarr.json" in unsafe:
            continue  # named by the checksums check; zarr must not parse it
        try:
            array = group[name]
        except (KeyError, OSError, ValueError) as exc:
            report.add(Problem("files", f"array {name} is missing or unreadable ({exc})", array=name))
            continue
        expected = {
            "row shape": (tuple(array.shape[1:]), spec.row_shape),
            "dtype": (str(array.dtype), spec.stored_dtype),
            "chunks": (tuple(array.chunks), (spec.chunk_tokens, *spec.row_shape)),
        }
        bad = [f"{k} {got} (manifest: {want})" for k, (got, want) in expected.items() if got != want]
        if array.shape[0] < layout.committed_tokens:
            bad.append(f"{array.shape[0]} rows, fewer than the {layout.committed_tokens} committed tokens")
        if bad:
            report.add(Problem("files", f"array {name}: {'; '.join(bad)}", array=name))
            continue
        codecs = [type(c).__name__ for c in array.metadata.codecs]
        if not codecs or codecs[-1] != "Crc32cCodec":
            report.add(
                Problem(
                    "files",
                    f"array {name} has no crc32c checksum as its last codec ({codecs}): "
                    "flipped bits cannot be detected",
                    array=name,
                ),
                warning=True,
            )
        arrays[name] = array
    return arrays


def _check_chunk_files(layout: CacheLayout, report: VerifyReport) -> None:
    """Every chunk that holds committed tokens must exist: zarr reads a missing one as zeros."""
    for name, spec in layout.specs.items():
        if name not in layout.arrays:
            continue
        stored = layout.stored_chunks(name)
        for chunk in range(-(-layout.committed_tokens // spec.chunk_tokens)):
            path = layout.root / ARRAYS_GROUP / name / chunk_key(spec, chunk)
            if chunk in stored:
                continue
            start = chunk * spec.chunk_tokens
            seqs = sequences_in(layout, start, start + spec.chunk_tokens)
            message = f"chunk file {path.relative_to(layout.root)} is missing (it would read as zeros)"
            if not seqs:
                report.add(Problem("files", message, array=name, chunk=chunk))
            for seq in seqs:
                report.add(layout.problem("files", message, seq, array=name, chunk=chunk))


def _report_mismatches(mismatches: list[Mismatch], report: VerifyReport) -> None:
    """Every non-chunk file (and the manifest itself) against the checksums recorded at commit."""
    for mismatch in mismatches:
        check = "manifest" if mismatch.path == "manifest.json" else "files"
        message = mismatch.message
        if not mismatch.warning:
            message += ": edited or damaged after it was written, so scores from this cache cannot be trusted"
        report.add(Problem(check, message), warning=mismatch.warning)


def _check_headers(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    """Parse the header of every safetensors file it checksums: a resealed head with an absurd
    header (offsets past the file, shapes that do not fit) is a finding, not a crash in eval."""
    for path in sorted((root / TARGET_DIR).glob("*.safetensors")) if (root / TARGET_DIR).is_dir() else []:
        try:
            check_safetensors(path)
        except CacheFormatError as exc:
            report.add(Problem("files", str(exc)))


def _check_side_files(root: Path, manifest: dict[str, Any], report: VerifyReport) -> None:
    """target/ complete, provenance.json valid, and no symlink that leads out of the cache."""
    provenance = root / PROVENANCE
    # A cache imported from a peer's files (hscache import) has no target/ by design: those files
    # hold no target head, and the scorer refuses such a cache by name.
    try:
        imported = provenance.is_file() and "imported" in jsonio.loads(provenance.read_bytes())
    except (ValueError, UnicodeDecodeError):
        imported = False  # reported below as an invalid provenance
    for name in _TARGET_FILES:
        if not (root / TARGET_DIR / name).is_file() and not (imported and not (root / TARGET_DIR).exists()):
            report.add(Problem("files", f"{TARGET_DIR}/{name} is missing: the scorer needs it"))
    if provenance.is_file():
        try:
            schemas.validate(jsonio.loads(provenance.read_bytes()), "provenance")
        except (ValueError, schemas.SchemaError) as exc:
            report.add(Problem("files", f"{PROVENANCE} is invalid: {exc}"))
    elif manifest["complete"] and PROVENANCE not in manifest.get("checksums", {}):
        report.add(Problem("files", f"{PROVENANCE} is missing from a complete cache"), warning=True)
    try:
        read_run_log(root)
    except CacheFormatError as exc:
        report.add(Problem("files", str(exc)))
    resolved_root = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        for entry in (*dirnames, *filenames):
            path = Path(dirpath) / entry
            if path.is_symlink() and resolved_root not in path.resolve().parents:
                message = f"{path.relative_to(root)} is a symlink that leads outside the cache"
                report.add(Problem("files", message))
