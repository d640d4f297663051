"""``hscache verify``: check that a cache tells the truth, and name every bad sequence.

    >>> from hscache.verify import VerifyConfig, verify_cache
    >>> report = verify_cache("cache/", VerifyConfig(deep=True))      # doctest: +SKIP
    >>> report.ok, report.bad_sequences                                # doctest: +SKIP

Steps (each a module): structure (manifest, index, files; no data decoded) -> scan (token
hashes, NaN/Inf, zeros, norm statistics, streamed chunk by chunk) -> crc (every other chunk
file's crc32c, undecoded) or, with --deep, deep (decode every chunk of every array and check its
rows' sha256) -> recompute (re-run sampled sequences through the target). The verdict says OK only
when nothing was left unchecked; otherwise it names what was not checked and the flag that checks it. A damaged
cache is a finding, not an error: only "not a cache at all" and bad arguments raise.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hscache.errors import InputError
from hscache.progress import NO_PROGRESS
from hscache.store.layout import MANIFEST, PROVENANCE, SAMPLED_ARRAYS
from hscache.store.urls import is_url
from hscache.verify.crc import check_chunk_crcs
from hscache.verify.report import CHECKS, LayerStats, Problem, RecomputeResult, VerifyReport, format_report
from hscache.verify.sampled import check_sampling
from hscache.verify.scan import deep_decode, hashed_by_scan, scan_sequences
from hscache.verify.structure import check_structure

__all__ = [
    "CHECKS",
    "LayerStats",
    "Problem",
    "RecomputeResult",
    "VerifyConfig",
    "VerifyReport",
    "format_report",
    "verify_cache",
]


@dataclass(frozen=True)
class VerifyConfig:
    """What ``hscache verify`` checks; CLI flags mirror these names."""

    deep: bool = False  # decode every stored chunk of every array
    recompute: int = 0  # re-run this many sampled sequences through the target
    model: str | None = None  # target for recompute (default: the cache's --model)
    device: str | None = None  # default: the cache's device
    backend: str | None = None  # default: the cache's backend
    tolerance: float | None = None  # max relative error; default 0 when a re-run must be exact, else 0.02
    seed: int = 0  # which sequences recompute samples
    allow_unsealed: bool = False  # a cache without checksums: a warning instead of a problem
    expect_digest: str | None = None  # the pinned root digest: any other is a problem


_ATTEMPTS = 5


def _provenance(root: Path) -> dict[str, Any] | None:
    """provenance.json as parsed, None when it is absent or unreadable (the files check names it)."""
    from hscache.store import jsonio
    from hscache.store.fsio import read_regular

    try:
        value = jsonio.loads(bytes(read_regular(root / PROVENANCE)))
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _writer(root: Path, url: str | None) -> dict[str, Any] | None:
    """The live writer of a local cache (``None``: nobody holds its lock; remote caches: not known)."""
    if url is not None:
        return None
    from hscache.store.lock import current_writer

    return current_writer(root)


def _recompressing(writer: dict[str, Any] | None) -> bool:
    return bool(writer) and str(writer.get("command", "")).startswith("hscache recompress")


def _codec_state(root: Path) -> Any:
    """How each array is stored, as the manifest says now (codecs, zarr.json digest, a conversion
    under way): what `hscache recompress` changes and an extraction does not."""
    from hscache.store import jsonio

    data = _manifest_bytes(root)
    try:
        arrays = jsonio.loads(data).get("arrays") if data else None
    except (ValueError, AttributeError):
        return data
    if not isinstance(arrays, dict):
        return data
    keys = ("compression", "zarr_json_sha256", "converting")
    return {n: [e.get(k) for k in keys] if isinstance(e, dict) else e for n, e in arrays.items()}


def _who(writer: dict[str, Any]) -> str:
    return (
        f"pid {writer.get('pid')} on {writer.get('host')}: {writer.get('command')}" if writer else "a process"
    )


def _checked_once(
    root: Path, path: Any, url: str | None, config: VerifyConfig, progress: Any
) -> tuple[VerifyReport, Any]:
    """One pass of every check but --recompute: structure (retried while an extraction compacts its
    index), the pinned digest, then the data."""
    for _attempt in range(_ATTEMPTS):
        manifest_before = _manifest_bytes(root)
        report = VerifyReport(path=str(path), deep=config.deep)
        layout = check_structure(root, report, config.allow_unsealed, url)
        # A running extraction may compact the index (deleting listed parts) while we read it, or
        # be between publishing a file (provenance.json) and the manifest recording its checksum.
        if not any(report.checks[c] == "failed" for c in ("manifest", "index", "files")):
            break
        if url is not None or _manifest_bytes(root) == manifest_before:
            if layout is None or layout.manifest.get("complete"):
                break
            time.sleep(0.05 * (_attempt + 1))
    if config.expect_digest is not None and report.digest != config.expect_digest.strip().lower():
        report.add(
            Problem(
                "manifest",
                f"the cache's digest is {report.digest}, not the expected {config.expect_digest.strip()}: it "
                "changed since that digest was recorded (or it is another cache)",
            )
        )
    if layout is not None:
        tried = scan_sequences(layout, report, progress)
        if config.deep:
            deep_decode(layout, report, tried, progress)
            check_sampling(layout, report, _provenance(layout.root))
        else:
            check_chunk_crcs(layout, report, tried, progress)
            unhashed = [name for name in layout.arrays if name not in hashed_by_scan(layout.manifest)]
            if unhashed:
                report.not_checked.append(f"the sha256 of the rows of {', '.join(unhashed)} (--deep)")
            if set(SAMPLED_ARRAYS) <= set(layout.arrays):
                report.not_checked.append("the sampled distributions against the drawn tokens (--deep)")
    return report, layout


def _manifest_bytes(root: Path) -> bytes | None:
    from hscache.store.fsio import read_regular

    try:
        return bytes(read_regular(root / MANIFEST))  # a FIFO is refused, never waited on
    except OSError:
        return None


def verify_cache(
    path: str | os.PathLike, config: VerifyConfig | None = None, progress: Any = NO_PROGRESS
) -> VerifyReport:
    """Check the cache at ``path`` and return a report; ``report.ok`` is False when anything is wrong.

    Works on a cache that is still being written (it checks the committed prefix). ``progress``
    (hscache.progress.StepProgress) hears of the scan (tokens) and the deep decode (chunks).

    Raises:
        CacheNotFoundError: ``path`` holds no cache (no manifest.json).
        InputError: contradictory options (e.g. --model without --recompute).
        ModelNotFoundError / BackendUnavailableError: --recompute cannot load the target as asked.
    """
    config = config or VerifyConfig()
    if config.recompute < 0:
        raise InputError(f"--recompute {config.recompute} must be 0 or more sequences")
    if config.recompute == 0 and (config.model or config.device or config.backend):
        raise InputError("--model/--device/--backend only apply to --recompute N; add --recompute N (e.g. 4)")
    t0 = time.perf_counter()
    url = str(path).rstrip("/") if is_url(path) else None
    root = Path(path)
    if url is not None:
        from hscache.store.remote import mirror_remote  # lazy: fsspec backends are optional

        root = mirror_remote(url)
    for attempt in range(_ATTEMPTS):
        codecs_before, writer_before = _codec_state(root), _writer(root, url)
        report, layout = _checked_once(root, path, url, config, progress)
        # A writer changed how the arrays are stored while they were read (`hscache recompress` swaps
        # an array's chunk files and codecs): what was found may be a mix of two states, not damage.
        # Check again until one state was read whole (issue 36). An extraction only appends past the
        # committed rows verify reads: it changes no array's codecs and causes no retry.
        moved = (
            _codec_state(root) != codecs_before
            or _recompressing(writer_before)
            or _recompressing(_writer(root, url))
        )
        if report.ok or not moved or url is not None:
            break
        if attempt + 1 == _ATTEMPTS:
            writer = _writer(root, url) or writer_before
            if writer is not None:
                report = VerifyReport(path=str(path), deep=config.deep)
                report.add(
                    Problem(
                        "manifest",
                        f"a writer is running ({_who(writer)}) and changed the cache while verify read it: "
                        "no consistent state could be checked; re-run verify when it has finished",
                    )
                )
                layout = None
            break
        time.sleep(0.05 * (attempt + 1))
    if layout is not None:
        if not config.recompute:
            report.not_checked.append("a re-run of sampled sequences through the target (--recompute N)")
        if config.recompute:
            from hscache.verify.recompute import recompute_sequences  # loads the target: torch

            recompute_sequences(
                layout,
                report,
                config.recompute,
                config.model,
                config.device,
                config.backend,
                config.tolerance,
                config.seed,
            )
    report.seconds = time.perf_counter() - t0
    return report
