"""Checksums of every file of a cache that is not a zarr chunk, recorded in ``manifest.json``.

The arrays' chunks carry their own crc32c (store/layout.py). Everything else that changes a score
(index parts: prompt_len, record ids, offsets; provenance.json; target/: config, tokenizer, the
embedding and output head) is listed in the manifest's ``checksums`` as ``{path: {"sha256", "bytes"}}``,
recorded by the writer when it publishes the file. The manifest covers itself with
``content_sha256``: the SHA-256 of its canonical JSON without that field, so an edited layer id
or committed count is caught too.

Two depths: ``check_cache(root, manifest, digests="small")`` (what ``open_cache`` runs: the
manifest's own digest, every file's size, and the digests of files up to ``SMALL_FILE_BYTES``) and
``digests="all"`` (``hscache verify``). A cache without a seal (no ``checksums``: written before
checksums existed, or its seal was stripped) is refused unless the caller allows it explicitly
(``--allow-unsealed``): stripping the seal must not turn every check off.

The arrays are covered too. Each array's entry in the manifest's ``arrays`` records
``zarr_json_sha256`` (its ``zarr.json`` in canonical form with the growing row count left out:
dtype, endianness, chunk grid, codecs, fill value, attributes) and ``chunk_sha256``, one SHA-256
per chunk of the committed rows' stored bytes (little endian), computed by the writer from the
rows it writes (no read-back). ``arrays/zarr.json`` (the group) is in ``checksums``. Readers
check each chunk's hash the first time they decode it, so a chunk rewritten with another content
and a valid crc32c is refused, and ``cache_digest`` (one SHA-256 over the manifest, which holds
every file's and chunk's hash) changes with any change to what the cache holds: pin it
(``--expect-digest``).

One file is sealed but not pinned: ``runs.json`` (store/run_log.py), what each run did (times, host,
versions). The manifest records it under ``run_log``, which ``content_sha256`` covers and
``manifest_digest`` leaves out: an unsealed edit is refused like any other, and a re-run that adds
nothing, or a second extraction of the same rows, keeps the digest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from hscache.errors import InputError
from hscache.store import fsio, jsonio
from hscache.store.layout import ARRAYS_GROUP, INDEX_DIR, PROVENANCE, RUN_LOG, TARGET_DIR, ArraySpec

__all__ = [
    "ARRAY_GROUP_META",
    "SMALL_FILE_BYTES",
    "UNSEALED_MESSAGE",
    "Mismatch",
    "cache_digest",
    "check_array_metadata",
    "check_cache",
    "check_expected_digest",
    "combined_digest",
    "chunk_sha256_of",
    "content_sha256",
    "digest_bytes",
    "digest_file",
    "files_under",
    "manifest_digest",
    "rows_sha256",
    "seal",
    "zarr_json_sha256",
]

# Files up to this size are hashed when a cache is opened (index parts, provenance, config,
# tokenizer files of most models); bigger ones (the head) only by verify and when they are read.
SMALL_FILE_BYTES = 16 << 20
_BLOCK = 1 << 22
ARRAY_GROUP_META = f"{ARRAYS_GROUP}/zarr.json"
# An array's zarr.json is a few hundred bytes; a bigger one is damage, not metadata to parse.
_MAX_ZARR_JSON_BYTES = 1 << 20
UNSEALED_MESSAGE = (
    "records no checksums (no seal): either it was written by hscache before checksums existed, or "
    "its seal was removed; edits to any of its files cannot be detected. Re-extract it, or read it "
    "unchecked with --allow-unsealed (hscache info / verify, scorer eval) or open_cache(..., allow_unsealed=True)"
)


@dataclass(frozen=True)
class Mismatch:
    """One file (or the manifest) that disagrees with what its commit recorded."""

    path: str  # relative to the cache root
    message: str  # one line: what differs
    warning: bool = False  # True only for "no checksums recorded" (an older cache)


def digest_bytes(data: bytes) -> dict[str, Any]:
    """The checksum entry of ``data``."""
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


def digest_file(path: Path) -> dict[str, Any]:
    """The checksum entry of the file at ``path``, read in blocks."""
    digest, size = hashlib.sha256(), 0
    with fsio.open_regular(path) as f:
        while block := f.read(_BLOCK):
            digest.update(block)
            size += len(block)
    return {"sha256": digest.hexdigest(), "bytes": size}


def files_under(root: Path, relpaths: Iterable[str]) -> list[str]:
    """Each of ``relpaths`` that is a file, and every file below those that are directories."""
    out = []
    for rel in relpaths:
        path = Path(root) / rel
        if path.is_dir():
            out += sorted(p.relative_to(root).as_posix() for p in path.rglob("*") if p.is_file())
        elif path.is_file():
            out.append(Path(rel).as_posix())
    return out


def content_sha256(manifest: dict[str, Any]) -> str:
    """SHA-256 of the manifest's canonical JSON (sorted keys, no spaces) without ``content_sha256``."""
    body = {k: v for k, v in manifest.items() if k != "content_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# Manifest keys the digest leaves out: its own seal, when it was written, and the run log's checksum
# (what runs did, not what the cache holds: store/run_log.py).
_NOT_DIGESTED = ("content_sha256", "updated_at", "run_log")


def manifest_digest(manifest: dict[str, Any]) -> str:
    """The cache's root digest: SHA-256 over the manifest's canonical JSON without its own
    ``content_sha256``, ``updated_at`` and ``run_log`` (a re-commit of the same content, or another
    run writing the same content, keeps the digest).

    The manifest holds the SHA-256 of every other file (``checksums``), every array's metadata and
    every chunk's committed rows, so any change to what the cache holds changes this. Caches written
    before the run log have no ``run_log`` key: their digest is what it was.
    """
    body = {k: v for k, v in manifest.items() if k not in _NOT_DIGESTED}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def cache_digest(cache: Any) -> str:
    """The root digest of an open cache (any ``CacheView``): pin it, compare it with
    ``--expect-digest``. A directory of shards: the SHA-256 of its shards' digests, in order."""
    shards = getattr(cache, "shards", None)
    if shards:
        return combined_digest([manifest_digest(s.manifest) for s in shards])
    return manifest_digest(cache.manifest)


def combined_digest(shard_digests: list[str]) -> str:
    """The digest of a directory of shards from its shards' digests, in shard order."""
    return hashlib.sha256(",".join(shard_digests).encode()).hexdigest()


def check_expected_digest(cache: Any, expected: str | None, where: str) -> None:
    """Refuse ``cache`` when ``expected`` (``--expect-digest``) is given and differs from its digest.

    Raises:
        InputError: the digests differ (one line naming both).
    """
    if expected is None:
        return
    actual = cache_digest(cache)
    if actual != expected.strip().lower():
        raise InputError(
            f"{where} has digest {actual}, not the expected {expected.strip()}: the cache changed since that "
            "digest was recorded (or it is another cache); run `hscache verify` on it and re-check the pin"
        )


def rows_sha256(rows: np.ndarray) -> str:
    """SHA-256 of ``rows``' bytes in little-endian order (the chunk hashes of ``arrays``)."""
    rows = np.ascontiguousarray(rows)
    if rows.dtype.byteorder == ">":
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    return hashlib.sha256(memoryview(rows).cast("B")).hexdigest()


def chunk_sha256_of(manifest: dict[str, Any], name: str) -> list[str] | None:
    """The recorded per-chunk hashes of array ``name`` (None: a cache from before them)."""
    entry = manifest.get("arrays", {}).get(name)
    hashes = entry.get("chunk_sha256") if isinstance(entry, dict) else None
    return hashes if isinstance(hashes, list) else None


def zarr_json_sha256(meta: dict[str, Any]) -> str:
    """SHA-256 of an array's zarr.json in canonical form, its row count (``shape[0]``, which grows
    while a cache is written) left out: every other field changes how the rows read back."""
    body = dict(meta)
    shape = body.get("shape")
    if isinstance(shape, list) and shape:
        body["shape"] = [None, *shape[1:]]
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _inside(resolved_root: Path, path: Path) -> bool:
    """``path`` resolves (symlinks followed) to the cache root or below it. The caller resolves the
    root once per check: resolving it again for every file was half of what opening a cache cost."""
    resolved = path.resolve()
    return resolved == resolved_root or resolved_root in resolved.parents


def _expected_codecs(compression: str) -> list[str] | None:
    """The codec names ``layout.codecs_for`` writes for ``compression`` (None: unknown)."""
    blosc = ["bytes", "blosc", "crc32c"]
    return {"none": ["bytes", "crc32c"], "fast": blosc, "balanced": blosc}.get(compression)


def _array_problems(
    root: Path,
    resolved_root: Path,
    name: str,
    spec: ArraySpec,
    entry: dict[str, Any],
    manifest: dict[str, Any],
) -> str | None:
    """What is wrong with array ``name``'s directory and zarr.json, or None (one line)."""
    array_dir = Path(root) / ARRAYS_GROUP / name
    for path in (Path(root) / ARRAYS_GROUP, array_dir, array_dir / "c", array_dir / "zarr.json"):
        if (path.exists() or path.is_symlink()) and not _inside(resolved_root, path):
            return f"{path.relative_to(root).as_posix()} leads outside the cache directory (a symlink)"
    meta_path = array_dir / "zarr.json"
    rel = meta_path.relative_to(root).as_posix()
    if not meta_path.is_file():
        return f"{rel} is missing"
    if meta_path.stat().st_size > _MAX_ZARR_JSON_BYTES:
        return f"{rel} holds {meta_path.stat().st_size} bytes, far more than array metadata"
    try:
        meta = jsonio.loads(meta_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return f"{rel} is not valid JSON ({exc})"
    if not isinstance(meta, dict):
        return f"{rel} is not a JSON object"
    committed = int(manifest["committed"]["tokens"])
    shape = meta.get("shape")
    grid = _obj(meta.get("chunk_grid"))
    chunk_shape = _obj(grid.get("configuration")).get("chunk_shape")
    codecs = meta.get("codecs") if isinstance(meta.get("codecs"), list) else []
    names = [_obj(c).get("name") for c in codecs]
    endian = _obj(_obj(codecs[0] if codecs else None).get("configuration")).get("endian", "little")
    keys = _obj(meta.get("chunk_key_encoding"))
    try:
        itemsize = np.dtype(spec.stored_dtype).itemsize
    except TypeError:
        return f"{rel}: the manifest's stored_dtype {spec.stored_dtype!r} is not a data type"
    bad = []
    if meta.get("zarr_format") != 3 or meta.get("node_type") != "array":
        bad.append(f"zarr_format {meta.get('zarr_format')!r}/node_type {meta.get('node_type')!r}")
    if meta.get("data_type") != spec.stored_dtype:
        bad.append(f"data_type {meta.get('data_type')!r} (manifest: {spec.stored_dtype})")
    if not (isinstance(shape, list) and all(isinstance(n, int) for n in shape)):
        bad.append(f"shape {shape!r}")
    elif tuple(shape[1:]) != spec.row_shape or len(shape) != 1 + len(spec.row_shape):
        bad.append(f"row shape {shape[1:]} (manifest: {list(spec.row_shape)})")
    elif shape[0] < committed:
        bad.append(f"{shape[0]} rows, fewer than the {committed} committed tokens")
    elif manifest.get("complete") and shape[0] != committed:
        bad.append(f"{shape[0]} rows in a complete cache of {committed} committed tokens")
    if grid.get("name") != "regular" or chunk_shape != [spec.chunk_tokens, *spec.row_shape]:
        bad.append(f"chunk grid {grid!r} (manifest: {[spec.chunk_tokens, *spec.row_shape]})")
    if keys.get("name") != "default" or _obj(keys.get("configuration")).get("separator", "/") != "/":
        bad.append(f"chunk key encoding {keys!r}")
    if endian != "little" and itemsize > 1:
        bad.append(f"endian {endian!r} (hscache writes little)")
    # What the array may be: as recorded, or (while `hscache recompress` swaps it) as announced. An
    # array's own compression is set while a recompress converts the cache array by array.
    states = [(entry.get("compression", manifest.get("compression")), entry.get("zarr_json_sha256"))]
    converting = _obj(entry.get("converting"))
    if converting:
        states.append((converting.get("compression"), converting.get("zarr_json_sha256")))
    matching = [state for state in states if names == _expected_codecs(str(state[0]))]
    if not matching:
        wanted = " or ".join(f"{c!r}: {_expected_codecs(str(c))}" for c, _ in states)
        bad.append(f"codecs {names} (compression {wanted})")
    if meta.get("storage_transformers"):
        bad.append("storage transformers")
    recorded = [digest for _, digest in matching]
    if not bad and None not in recorded and zarr_json_sha256(meta) not in recorded:
        bad.append("content differs from the zarr_json_sha256 recorded at commit")
    return f"{rel}: {'; '.join(b if len(b) <= 200 else b[:200] + '...' for b in bad)}" if bad else None


def _obj(value: Any) -> dict[str, Any]:
    """``value`` when it is a JSON object, else an empty one (damaged metadata reads as absent)."""
    return value if isinstance(value, dict) else {}


def check_array_metadata(root: Path, manifest: dict[str, Any]) -> list[Mismatch]:
    """Each array's directory stays inside the cache and its zarr.json agrees with the manifest's
    ``arrays`` (dtype, endianness, row shape, chunk grid, codecs, a row count no smaller than the
    committed tokens) and with its recorded ``zarr_json_sha256``; the per-chunk hash list has one
    entry per committed chunk. Parsed by hand before zarr sees it: damage is a ``Mismatch``, never
    an exception, and a claimed shape of 10^12 rows costs nothing."""
    problems = []
    committed = int(manifest["committed"]["tokens"])
    resolved_root = Path(root).resolve()
    for name, entry in manifest["arrays"].items():
        try:
            spec = ArraySpec.from_dict(name, entry)
            if spec.chunk_tokens < 1 or not all(isinstance(d, int) and d >= 1 for d in spec.row_shape):
                raise ValueError(f"chunk_tokens {spec.chunk_tokens}, row_shape {list(spec.row_shape)}")
            if not isinstance(spec.logical_dtype, str) or entry.get("stored_dtype") != spec.stored_dtype:
                raise ValueError(
                    f"logical_dtype {entry.get('logical_dtype')!r}, stored_dtype {entry.get('stored_dtype')!r}"
                )
        except (KeyError, TypeError, ValueError) as exc:
            problems.append(Mismatch("manifest.json", f"manifest.json array {name} is malformed ({exc})"))
            continue
        message = _array_problems(Path(root), resolved_root, name, spec, entry, manifest)
        if message:
            problems.append(Mismatch(f"{ARRAYS_GROUP}/{name}/zarr.json", message))
        hashes = chunk_sha256_of(manifest, name)
        chunks = -(-committed // spec.chunk_tokens)
        if hashes is None:
            problems.append(
                Mismatch(
                    "manifest.json",
                    f"array {name} records no chunk hashes (written before them): a chunk rewritten with "
                    "a valid crc32c cannot be detected; re-extract to get them",
                    warning=True,
                )
            )
        elif len(hashes) != chunks:
            problems.append(
                Mismatch(
                    "manifest.json",
                    f"manifest.json records {len(hashes)} chunk hashes for {name}, which holds {chunks} "
                    "committed chunks",
                )
            )
    return problems


def seal(manifest: dict[str, Any]) -> None:
    """Set ``content_sha256`` (the last change before the manifest is written)."""
    if "checksums" in manifest:
        manifest["content_sha256"] = content_sha256(manifest)


def check_cache(
    root: Path,
    manifest: dict[str, Any],
    digests: Literal["small", "all"] = "small",
    allow_unsealed: bool = False,
    keep: dict[str, bytes] | None = None,
) -> list[Mismatch]:
    """What in the cache at ``root`` disagrees with ``manifest``'s recorded checksums and arrays.

    Returns an empty list when everything matches. A cache without a seal is one problem, or
    with ``allow_unsealed`` one warning (its arrays' metadata is still cross-checked).

    ``keep``: a dict that receives the bytes of every file that was hashed and matched (up to
    ``SMALL_FILE_BYTES``, or every file with ``digests="all"``): what a reader then uses, so that a
    file replaced after this check is never read in place of the one that was checked (issue 36).
    """
    if "checksums" not in manifest or "content_sha256" not in manifest:
        return [
            Mismatch("manifest.json", f"the cache {UNSEALED_MESSAGE}", warning=allow_unsealed),
            *check_array_metadata(root, manifest),
        ]
    recorded = manifest.get("content_sha256")
    if recorded != content_sha256(manifest):
        return [
            Mismatch(
                "manifest.json",
                "manifest.json was edited after its last commit (its content_sha256 does not match)",
            )
        ]
    problems = check_array_metadata(root, manifest)
    checksums = manifest["checksums"]
    if not isinstance(checksums, dict):
        return [Mismatch("manifest.json", "manifest.json checksums is not an object")]
    covered = [
        *(str(p) for p in manifest["index_parts"] if str(p).startswith(f"{INDEX_DIR}/")),
        TARGET_DIR,
        PROVENANCE,
    ]
    if manifest.get("complete"):  # no writer left anything under index/ (a running one may have a temp part)
        covered.append(INDEX_DIR)
    if any(rel == ARRAY_GROUP_META for rel in checksums):  # caches from before it was recorded: not
        covered.append(ARRAY_GROUP_META)
    for rel in files_under(Path(root), covered):
        if rel not in checksums:
            problems.append(Mismatch(rel, f"{rel} is not covered by a checksum recorded at commit"))
    entries = sorted(checksums.items())
    if "run_log" in manifest:  # sealed, not digested (store/run_log.py)
        entries.append((RUN_LOG, manifest["run_log"]))
    elif (Path(root) / RUN_LOG).is_file():
        problems.append(Mismatch(RUN_LOG, f"{RUN_LOG} is not covered by a checksum recorded at commit"))
    resolved_root = Path(root).resolve()
    for rel, entry in entries:
        problem = _file_problem(Path(root), resolved_root, rel, entry, digests, keep)
        if problem is not None:
            problems.append(problem)
    return problems


def _file_problem(
    root: Path, resolved_root: Path, rel: str, entry: Any, digests: str, keep: dict[str, bytes] | None = None
) -> Mismatch | None:
    """How the file ``rel`` disagrees with its recorded checksum ``entry``, or None; the bytes that
    were hashed and matched go into ``keep`` (when given)."""
    path = root / rel
    if not isinstance(entry, dict) or not isinstance(entry.get("bytes"), int):
        return Mismatch("manifest.json", f"manifest.json's checksum entry of {rel} is malformed")
    if not _inside(resolved_root, path):
        return Mismatch(rel, f"{rel} leads outside the cache directory")
    if not path.is_file():
        return Mismatch(rel, f"{rel} is missing (recorded at commit)")
    size = path.stat().st_size
    if size != entry["bytes"]:
        return Mismatch(rel, f"{rel} has {size} bytes, {entry['bytes']} when committed")
    if not (digests == "all" or size <= SMALL_FILE_BYTES):
        return None
    try:
        if keep is not None and size <= SMALL_FILE_BYTES:
            data = fsio.read_regular(path)
            found = digest_bytes(bytes(data))
        else:
            data, found = None, digest_file(path)
    except OSError as exc:
        return Mismatch(rel, f"{rel} cannot be read ({exc.strerror or exc})")
    if found != {"sha256": entry.get("sha256"), "bytes": entry["bytes"]}:
        return Mismatch(rel, f"{rel} does not match its sha256 recorded at commit")
    if data is not None and keep is not None:
        keep[rel] = bytes(data)
    return None
