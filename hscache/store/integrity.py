"""Checksums of every file of a cache that is not a zarr chunk, recorded in ``manifest.json``.

The arrays' chunks carry their own crc32c (store/layout.py). Everything else that changes a score
(index parts: prompt_len, record ids, offsets; provenance.json; target/: config, tokenizer, the
embedding and output head) is listed in the manifest's ``checksums`` as ``{path: {"sha256", "bytes"}}``,
recorded by the writer when it publishes the file. The manifest covers itself with
``content_sha256``: the SHA-256 of its canonical JSON without that field, so an edited layer id
or committed count is caught too.

Two depths: ``check_cache(root, manifest, digests="small")`` (what ``open_cache`` runs: the
manifest's own digest, every file's size, and the digests of files up to ``SMALL_FILE_BYTES``) and
``digests="all"`` (``hscache verify``). A cache written before checksums existed has no
``checksums`` field: that is reported, not refused.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "SMALL_FILE_BYTES",
    "Mismatch",
    "check_cache",
    "content_sha256",
    "digest_bytes",
    "digest_file",
    "files_under",
    "seal",
]

# Files up to this size are hashed when a cache is opened (index parts, provenance, config,
# tokenizer files of most models); bigger ones (the head) only by verify and when they are read.
SMALL_FILE_BYTES = 16 << 20
_BLOCK = 1 << 22


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
    with Path(path).open("rb") as f:
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


def seal(manifest: dict[str, Any]) -> None:
    """Set ``content_sha256`` (the last change before the manifest is written)."""
    if "checksums" in manifest:
        manifest["content_sha256"] = content_sha256(manifest)


def check_cache(
    root: Path, manifest: dict[str, Any], digests: Literal["small", "all"] = "small"
) -> list[Mismatch]:
    """What in the cache at ``root`` disagrees with ``manifest``'s recorded checksums.

    Returns an empty list when everything matches; a single warning when the cache records no
    checksums (written by an older hscache).
    """
    if "checksums" not in manifest:
        return [
            Mismatch(
                "manifest.json",
                "no checksums recorded (written by an older version): edits to the index, provenance "
                "and target/ cannot be detected",
                warning=True,
            )
        ]
    recorded = manifest.get("content_sha256")
    if recorded != content_sha256(manifest):
        return [
            Mismatch(
                "manifest.json",
                "manifest.json was edited after its last commit (its content_sha256 does not match)",
            )
        ]
    problems = []
    for rel, entry in sorted(manifest["checksums"].items()):
        path = Path(root) / rel
        if not path.is_file():
            problems.append(Mismatch(rel, f"{rel} is missing (recorded at commit)"))
            continue
        size = path.stat().st_size
        if size != entry["bytes"]:
            problems.append(Mismatch(rel, f"{rel} has {size} bytes, {entry['bytes']} when committed"))
        elif (digests == "all" or size <= SMALL_FILE_BYTES) and digest_file(path)["sha256"] != entry[
            "sha256"
        ]:
            problems.append(Mismatch(rel, f"{rel} does not match its sha256 recorded at commit"))
    return problems
