"""What export and import share: the sidecar, output folders, and writing an imported cache.

An export writes the peer's files exactly as its sources define them and, beside them, one file
of ours, ``hscache_export.json`` (the peers' readers never look at it: SpecForge lists ``*.ckpt``,
speculators opens ``hs_{i}.safetensors`` by index). It records what their files do not: our
layer ids, record ids and the source cache, so ``import`` of an export gives the cache back.
Importing files another tool wrote needs ``--layer-ids`` instead, in that tool's convention.

An imported cache holds ``hidden_states``, ``token_ids`` and ``loss_mask`` (the peer's own
per-token mask; ``prompt_len`` is its first supervised position). The peers' files hold no
target logits, so ``target_argmax``, ``target_topk_*`` and ``target_logsumexp`` are absent
(provenance ``imported.absent`` says so, and ``scorer eval`` refuses such a cache by name).

Partial outputs never look complete. An export writes ``.hscache-export-incomplete`` first (with
the number of sequences it will write), each file under a temp name renamed into place, the
sidecar last with the list of every file (the completion record), and only then removes the
mark; import refuses a folder with the mark, or whose sidecar lists a missing file, naming them.
An import writes ``.hscache-importing`` into its --out first and removes it last: re-running the
same import over one that was killed starts it over. Disk full during either: one line, and the
partial output is deleted: the entries the run writes (store/marks.py remove_entries), not a file the
user put into --out meanwhile.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from hscache.errors import InputError, StoreWriteError
from hscache.progress import NO_PROGRESS
from hscache.store import fsio, jsonio
from hscache.store.cache_dir import write_provenance
from hscache.store.layout import DEFAULT_COMPRESSION, IMPORTING_MARK, WRITER_LOCK, ArraySpec, spec_for
from hscache.store.lock import writer_lock
from hscache.store.marks import CACHE_ENTRIES, clear_marked_dir, remove_entries, write_mark
from hscache.store.paths import check_empty_out
from hscache.store.run_log import encode_run_log
from hscache.store.writer import SequenceRows, StoreWriter

__all__ = [
    "ABSENT_TARGET_ARRAYS",
    "INFLATE_RATIO",
    "EXPORT_MARK",
    "IMPORTING_MARK",
    "SIDECAR",
    "begin_export",
    "check_export_complete",
    "export_errors",
    "finish_export",
    "publish_file",
    "ImportSource",
    "ImportedSequence",
    "importer",
    "check_fresh_dir",
    "check_layer_count",
    "inflate_limit",
    "num_target_layers",
    "parse_layer_ids",
    "read_sidecar",
    "select_layers",
    "write_imported_cache",
    "write_sidecar",
]

SIDECAR = "hscache_export.json"
EXPORT_MARK = ".hscache-export-incomplete"
ABSENT_TARGET_ARRAYS = ("target_argmax", "target_topk_values", "target_topk_ids", "target_logsumexp")
# An imported file may hold at most this many times its own size once inflated (and at least
# _INFLATE_FLOOR): hidden states compress about 1.2x (docs/storage.md), token ids and masks are
# small, torch.save stores its entries uncompressed. A file that inflates further is a
# decompression bomb (2 MB of gzip, deflated zip entries or zstd Arrow buffers inflating to
# gigabytes): SpecForge and speculators files are refused before the inflated bytes are allocated
# (issues 36, 52).
INFLATE_RATIO = 20
_INFLATE_FLOOR = 64 << 20


def inflate_limit(size: int) -> int:
    """The most bytes a ``size``-byte imported file may inflate to."""
    return max(_INFLATE_FLOOR, INFLATE_RATIO * size)


_CHUNK_BYTES = 8 << 20  # as hscache extract's default --chunk-mb 8
_COMMIT_EVERY = 256  # sequences per commit: a killed import keeps what it committed
_LOGICAL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}
_DTYPE_NAME = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


@dataclass
class ImportedSequence:
    """One sequence read from a peer's files."""

    record_id: str
    hidden_states: torch.Tensor  # [T, K, H], the file's dtype
    token_ids: torch.Tensor  # [T]
    loss_mask: torch.Tensor  # [T], nonzero = supervised


def parse_layer_ids(text: str | None, flag: str = "--layer-ids") -> list[int] | None:
    """``"2,14,25"`` -> ``[2, 14, 25]`` (None when not given).

    Raises:
        InputError: not a comma-separated list of non-negative integers.
    """
    if text is None:
        return None
    try:
        ids = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        ids = []
    if not ids or any(i < 0 for i in ids):
        raise InputError(f"{flag} {text!r}: need comma-separated non-negative integers, e.g. 2,14,25")
    return ids


def check_fresh_dir(out: Path, flag: str = "--out") -> Path:
    """``out`` as a new or empty directory (created).

    Raises:
        InputError: ``out`` exists and is not an empty directory.
    """
    out = Path(out)
    check_empty_out(out, flag)
    out.mkdir(parents=True, exist_ok=True)
    return out


def num_target_layers(cache: Any) -> int | None:
    """The target's decoder layer count, from ``target/config.json`` or the provenance."""
    try:
        layers = cache.target_config.get("num_hidden_layers")
    except (OSError, ValueError):
        layers = None
    if layers is None:
        layers = (cache.provenance.get("model") or {}).get("num_layers")
    return None if layers is None else int(layers)


def select_layers(cache: Any, layer_ids: list[int] | None) -> list[int]:
    """``layer_ids`` (default: every cached layer), each checked to be in the cache.

    Raises:
        InputError: a layer the cache does not hold.
    """
    if layer_ids is None:
        return list(cache.layer_ids)
    missing = [i for i in layer_ids if i not in cache.layer_ids]
    if missing or len(set(layer_ids)) != len(layer_ids):
        raise InputError(
            f"--layers {','.join(map(str, layer_ids))}: the cache holds layers {cache.layer_ids}; "
            "pass distinct layers among those"
        )
    return list(layer_ids)


def write_sidecar(out: Path, document: dict[str, Any]) -> None:
    fsio.atomic_write_json(Path(out) / SIDECAR, document)


def begin_export(out: Path, sequences: int) -> Path:
    """``out`` as a new or empty directory holding the export's incomplete mark (written first).

    Raises:
        InputError: ``out`` exists and is not an empty directory.
    """
    out = check_fresh_dir(Path(out))
    fsio.atomic_write_json(out / EXPORT_MARK, {"sequences": sequences})
    fsio.fsync_dir(out)
    return out


def publish_file(path: Path, write: Callable[[str], None]) -> None:
    """Write ``path`` through ``write(temp_path)`` and rename it into place: never a torn file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}{fsio.TEMP_MARK}{uuid.uuid4().hex}")
    try:
        write(str(tmp))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def finish_export(out: Path, document: dict[str, Any]) -> None:
    """Write the sidecar (with ``files``: every file written, the completion record), then remove the mark."""
    files = sorted(
        p.relative_to(out).as_posix()
        for p in out.rglob("*")
        if p.is_file() and p.name not in (EXPORT_MARK, SIDECAR, WRITER_LOCK) and fsio.TEMP_MARK not in p.name
    )
    for path in out.rglob("*"):
        if path.is_file():
            fsio.fsync_file(path)
    write_sidecar(out, {**document, "files": files})
    (out / EXPORT_MARK).unlink()
    fsio.fsync_dir(out)


@contextlib.contextmanager
def export_errors(out: Path, command: str, creates: Iterable[str]) -> Iterator[None]:
    """Turn an ``OSError`` while exporting (disk full) into one line, deleting the partial export:
    the top-level entries ``creates`` the export writes, its sidecar and mark, and nothing else (a
    file the user put in ``out`` meanwhile stays)."""
    try:
        yield
    except OSError as exc:
        remove_entries(out, (*creates, SIDECAR, EXPORT_MARK))
        raise StoreWriteError(
            f"writing the export to {out} failed{fsio.failure(exc)}; the partial "
            f"export was deleted: free space and re-run `{command}`"
        ) from exc


def check_export_complete(directory: Path, expected_files: Callable[[int], list[str]]) -> None:
    """Refuse an hscache export that did not finish: its incomplete mark is there, or its sidecar
    lists files that are missing. ``expected_files(n)``: the files an export of n sequences writes.

    Raises:
        InputError: naming the missing files (up to 5) and the command that makes a whole export.
    """
    directory = Path(directory)
    mark, sidecar = directory / EXPORT_MARK, directory / SIDECAR
    missing: list[str] = []
    if mark.is_file():
        try:
            n = int(jsonio.loads(mark.read_bytes())["sequences"])
        except (ValueError, KeyError, TypeError):
            n = 0
        missing = [f for f in expected_files(n) if not (directory / f).is_file()] or [SIDECAR]
    elif sidecar.is_file():
        try:
            document = jsonio.loads(sidecar.read_bytes())
        except (ValueError, UnicodeDecodeError):
            document = {}  # read_sidecar names it
        listed = document.get("files") if isinstance(document, dict) else None
        listed = [_inside_folder(sidecar, directory, f) for f in listed] if isinstance(listed, list) else []
        missing = [f for f in listed if not (directory / f).is_file()]
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise InputError(
            f"{directory} is an hscache export that did not finish ({len(missing)} files missing: {shown}); "
            "re-run `hscache export` into an empty directory and import that"
        )


def read_sidecar(directory: Path, fmt: str) -> dict[str, Any] | None:
    """Our sidecar in ``directory`` when it is there and names ``fmt`` (else None).

    Raises:
        InputError: it is there but names another format or is not JSON.
    """
    path = Path(directory) / SIDECAR
    if not path.is_file():
        return None
    try:
        document = jsonio.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path} is not valid JSON ({exc}); delete it and pass --layer-ids") from exc
    if not isinstance(document, dict):
        raise InputError(f"{path} is not a JSON object; delete it and pass --layer-ids")
    if document.get("format") != fmt:
        raise InputError(
            f"{path} says the folder holds {str(document.get('format'))[:40]!r} files, not {fmt!r}; "
            f"pass --format {str(document.get('format'))[:40]}"
        )
    _check_sidecar(path, directory, document)
    return document


_LAYER_LISTS = ("layer_ids", "vllm_layer_ids", "aux_hidden_state_layer_ids", "target_layer_ids")


def _check_sidecar(path: Path, directory: Path, document: dict[str, Any]) -> None:
    """The sidecar's fields that an import reads, each of its type, else one line naming it: a hostile
    sidecar is refused here, not as a TypeError deep in the writer (issue 36)."""

    def bad(key: str, what: str) -> InputError:
        return InputError(
            f"{path}: {key} is {str(document.get(key))[:60]!r}, not {what}; delete the sidecar and pass --layer-ids"
        )

    for key in _LAYER_LISTS:
        value = document.get(key)
        if value is not None and not (
            isinstance(value, list) and value and all(type(v) is int and 0 <= v < 1 << 20 for v in value)
        ):
            raise bad(key, "a non-empty list of layer numbers")
    total = document.get("num_target_layers")
    if total is not None and not (type(total) is int and total > 0):
        raise bad("num_target_layers", "a positive integer")
    ids = document.get("record_ids")
    if ids is not None and not (
        isinstance(ids, list)
        and all(isinstance(r, str) and r for r in ids)
        and jsonio.first_surrogate(ids) is None
    ):
        raise bad("record_ids", "a list of non-empty record id strings")
    files = document.get("files")
    if files is not None:
        if not isinstance(files, list):
            raise bad("files", "a list of file names")
        for name in files:
            _inside_folder(path, directory, name)


def _inside_folder(sidecar: Path, directory: Path, name: Any) -> str:
    """``name``, a file the sidecar lists, checked to be a relative path inside ``directory`` (never a
    path that probes the disk outside the folder being imported)."""
    parts = Path(name).parts if isinstance(name, str) else ()
    if not parts or Path(name).is_absolute() or ".." in parts or "\x00" in name:
        raise InputError(
            f"{sidecar} lists the file {str(name)[:80]!r}, which is not a path inside {directory}: the sidecar is "
            "not an hscache export's; delete it and pass --layer-ids"
        )
    return name


def source_layer_ids(
    directory: Path, layer_ids: list[int] | None, sidecar: dict[str, Any] | None, key: str | None, hint: str
) -> tuple[list[int], str]:
    """The layer ids a peer's files hold, as its format numbers them: ``--layer-ids``, else an hscache
    export's sidecar's ``key`` (None: the format has no sidecar); and which of the two said so.

    Raises:
        InputError: neither says (one line: pass --layer-ids with ``hint``).
    """
    ids = layer_ids or ((sidecar or {}).get(key) if key else None)
    if not ids:
        raise InputError(
            f"{directory} does not say which layers its files hold; pass --layer-ids with {hint}"
        )
    return list(ids), "--layer-ids" if layer_ids else "sidecar"


def import_record(
    fmt: str,
    directory: Path,
    files: int,
    layer_ids: list[int],
    source_layer_ids: list[int],
    convention: str,
    layer_ids_from: str,
    sidecar: dict[str, Any] | None,
) -> dict[str, Any]:
    """Provenance's ``imported`` block of an import (``write_imported_cache``'s ``imported``): the format,
    the folder, its file count, the layer ids in hscache's convention and in the format's own, and whether
    ``--layer-ids`` or an hscache export's sidecar gave them."""
    return {
        "format": fmt,
        "source": str(directory.resolve()),
        "files": files,
        "layer_ids": list(layer_ids),
        "source_layer_ids": list(source_layer_ids),
        "source_layer_convention": convention,
        "layer_ids_from": layer_ids_from,
        "exported_from": (sidecar or {}).get("exported_from"),
    }


def check_layer_count(layer_ids: list[int], total: int | None, flag: str, where: Any) -> None:
    """Refuse layer ids at or past ``total`` layers (the target's count, when known): a cache whose
    layer ids name no layer of its target cannot be read (issue 36).

    Raises:
        InputError: naming the ids and the count.
    """
    if total is None:
        return
    beyond = [i for i in layer_ids if not 0 <= i < total]
    if beyond:
        raise InputError(
            f"{flag} {','.join(map(str, layer_ids))}: {beyond[0]} is not a layer of the {total}-layer target "
            f"{where} records; pass the layers the files hold"
        )


_COMPUTED = (
    "target_argmax, target_topk_values/ids, target_logsumexp = the --target's final norm and output head "
    "applied to the files' last-layer states (the forward's own next-token logits)"
)


def _attach_target(
    out: Path,
    name: str,
    first: ImportedSequence,
    layer_ids: list[int],
    last_slot: int | None,
    top_k: int,
    specs: dict[str, ArraySpec],
    settings: dict[str, Any],
    max_tokens: int | None,
) -> Any:
    """Write ``target/`` for ``name`` once it is checked against the ``first`` sequence (it must
    re-compute its states: interop/target.py); return a TargetHead (and add its arrays to ``specs``)
    when slot ``last_slot`` holds the target's last layer, else None."""
    hidden, token_ids, where = first.hidden_states, first.token_ids, first.record_id
    from hscache.capture.extract import write_target_of  # the same target/ as hscache extract
    from hscache.interop.target import TargetHead, check_target_produced, load_import_target

    target = load_import_target(name, hidden.dtype, int(hidden.shape[2]), layer_ids)
    check_target_produced(target, hidden, token_ids, layer_ids, where)
    write_target_of(out, target)
    settings.update({"model": name, "mask_token_id": target.mask_token_id})
    if last_slot is None or layer_ids[last_slot] != target.num_layers - 1:
        return None
    settings["top_k"] = top_k
    specs.update(
        {
            "target_argmax": _spec_for("target_argmax", (), "int32", max_tokens),
            "target_topk_values": _spec_for("target_topk_values", (top_k,), "float32", max_tokens),
            "target_topk_ids": _spec_for("target_topk_ids", (top_k,), "int32", max_tokens),
            "target_logsumexp": _spec_for("target_logsumexp", (), "float32", max_tokens),
        }
    )
    return TargetHead(target, top_k)


def _spec_for(name: str, row_shape: tuple[int, ...], logical: str, max_tokens: int | None) -> ArraySpec:
    return spec_for(name, row_shape, logical, _CHUNK_BYTES, max_tokens)


def _max_tokens(source_bytes: int | None, hidden: torch.Tensor) -> int | None:
    """At least the tokens of the import: the source's files hold every token's states, uncompressed
    (safetensors, torch.save), so no more tokens than their bytes over one token's ``[K, H]`` states."""
    if source_bytes is None:
        return None
    return source_bytes // max(1, hidden[0].numel() * hidden.element_size())


def _stored(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)  # raw bits, as hscache extract stores them
    return t.numpy()


@dataclass(frozen=True)
class ImportSource:
    """What a peer's reader found in a source folder: all ``write_imported_cache`` needs but the output."""

    sequences: Iterable[ImportedSequence]
    layer_ids: list[int]
    imported: dict[str, Any]
    source_bytes: int | None
    last_layer_slot: int | None = None


def importer(
    name: str, read: Callable[[str | Path, list[int] | None, str | None], ImportSource]
) -> Callable[..., tuple[int, int]]:
    """The public ``import_<format>`` function of a peer format whose reader is ``read(directory,
    layer_ids, target)``: every format's import takes the same arguments and writes the same way;
    its docstring is the reader's."""

    def load(
        directory: str | Path,
        out: str | Path,
        layer_ids: list[int] | None = None,
        compression: str = DEFAULT_COMPRESSION,
        target: str | None = None,
        progress: Any = NO_PROGRESS,
    ) -> tuple[int, int]:
        source = read(directory, layer_ids, target)
        return write_imported_cache(
            Path(out),
            source.sequences,
            layer_ids=source.layer_ids,
            imported=source.imported,
            compression=compression,
            progress=progress,
            target=target,
            last_layer_slot=source.last_layer_slot,
            source_bytes=source.source_bytes,
        )

    load.__name__ = load.__qualname__ = name
    load.__doc__ = read.__doc__
    load.__module__ = read.__module__
    return load


def write_imported_cache(
    out: Path,
    sequences: Iterable[ImportedSequence],
    *,
    layer_ids: list[int],
    imported: dict[str, Any],
    compression: str = DEFAULT_COMPRESSION,
    target: str | None = None,
    last_layer_slot: int | None = None,
    top_k: int = 64,
    progress: Any = NO_PROGRESS,
    source_bytes: int | None = None,
) -> tuple[int, int]:
    """Write ``sequences`` as a cache at ``out`` (new or empty); return (sequences, tokens).

    ``progress`` (hscache.progress.StepProgress) hears of each sequence written, out of
    ``imported["files"]`` when that counts them.

    ``imported`` goes to provenance.json under ``imported`` (format, source, layer convention...).
    ``target`` (a model for ``load_target``) adds ``target/``; when slot ``last_layer_slot`` of the
    files holds the target's last layer, the target arrays are computed from it (interop/target.py).
    ``source_bytes``: the size of the files holding the sequences' states; it bounds the chunk length,
    so a small import is not stored as megabytes of padded chunks (store/layout.py).

    Raises:
        InputError: no sequences, or shapes/dtypes that differ between sequences or from ``layer_ids``.
    """
    command = "the same `hscache import` command"
    with writer_lock(out, "hscache import"):  # one writer per cache, from before the emptiness check
        if (Path(out) / IMPORTING_MARK).exists() or (Path(out) / IMPORTING_MARK).is_symlink():
            # our own import, killed: what its mark records is deleted, anything else refused
            clear_marked_dir(Path(out), IMPORTING_MARK)
        out = check_fresh_dir(out)
        write_mark(out, IMPORTING_MARK)
        try:
            result = _write_imported(
                out,
                _counted(sequences, progress, imported.get("files")),
                layer_ids=layer_ids,
                imported=imported,
                compression=compression,
                target=target,
                last_layer_slot=last_layer_slot,
                top_k=top_k,
                source_bytes=source_bytes,
            )
        except OSError as exc:  # StoreWriteError included: disk full, permissions
            remove_entries(out, (*CACHE_ENTRIES, IMPORTING_MARK))  # what write_mark records creating
            # a StoreWriteError already says where and why: its first clause, not its advice
            failed = f" ({str(exc).split(';')[0]})" if isinstance(exc, StoreWriteError) else fsio.failure(exc)
            raise StoreWriteError(
                f"importing into {out} failed{failed}; the partial cache was deleted: free space "
                f"and re-run {command}"
            ) from exc
        (out / IMPORTING_MARK).unlink()
        fsio.fsync_dir(out)
        return result


def _counted(sequences: Iterable[ImportedSequence], progress: Any, total: int | None) -> Iterator:
    """``sequences``, telling ``progress`` of each one once the writer asks for the next."""
    progress.start(total, label="import", unit="sequences")
    for seq in sequences:
        yield seq
        progress.advance(1, secondary=len(seq.token_ids))


def _write_imported(
    out: Path,
    sequences: Iterable[ImportedSequence],
    *,
    layer_ids: list[int],
    imported: dict[str, Any],
    compression: str,
    target: str | None,
    last_layer_slot: int | None,
    top_k: int,
    source_bytes: int | None,
) -> tuple[int, int]:
    from hscache.capture.provenance import SCHEMA_VERSION, run_record, utc_now

    run = run_record(
        command="hscache import",
        device="cpu",
        sequences_at_start=0,
        inputs={"source": str(imported.get("source")), "model": target},
    )
    writer: StoreWriter | None = None
    first: tuple[torch.dtype, int] | None = None  # the first file's dtype and width
    head: Any = None  # interop.target.TargetHead when the target arrays are computed
    count = tokens = 0
    for seq in sequences:
        hidden = seq.hidden_states
        if hidden.ndim != 3 or hidden.shape[1] != len(layer_ids) or hidden.dtype not in _LOGICAL:
            raise InputError(
                f"{seq.record_id}: hidden_states {tuple(hidden.shape)} {hidden.dtype} do not match "
                f"{len(layer_ids)} layers {layer_ids} in bfloat16/float16/float32; check --layer-ids"
            )
        T = hidden.shape[0]
        if len(seq.token_ids) != T or len(seq.loss_mask) != T:
            raise InputError(
                f"{seq.record_id}: {T} hidden-state rows but {len(seq.token_ids)} token ids and "
                f"{len(seq.loss_mask)} loss-mask entries; the files are damaged"
            )
        if writer is None:
            logical, bound = _LOGICAL[hidden.dtype], _max_tokens(source_bytes, hidden)
            specs = {
                "hidden_states": _spec_for("hidden_states", tuple(hidden.shape[1:]), logical, bound),
                "token_ids": _spec_for("token_ids", (), "int32", bound),
                "loss_mask": _spec_for("loss_mask", (), "int32", bound),
            }
            settings: dict[str, Any] = {"layer_ids": list(layer_ids), "dtype": _DTYPE_NAME[logical]}
            if target is not None:
                head = _attach_target(
                    out, target, seq, layer_ids, last_layer_slot, top_k, specs, settings, bound
                )
            writer = StoreWriter.create(out, specs, compression, settings)
            first = (hidden.dtype, int(hidden.shape[2]))
        elif (hidden.dtype, int(hidden.shape[2])) != first:
            raise InputError(
                f"{seq.record_id}: hidden_states {hidden.dtype} width {hidden.shape[2]} differ from the "
                f"first file's {first[0]} width {first[1]}; one import holds one capture"
            )
        ids = seq.token_ids.to(torch.int32).numpy()
        mask = (seq.loss_mask != 0).to(torch.int32).numpy()
        supervised = np.flatnonzero(mask)
        arrays = {"hidden_states": _stored(hidden), "token_ids": ids, "loss_mask": mask}
        if head is not None:
            arrays.update(head.rows(hidden[:, last_layer_slot]))
        writer.append(
            SequenceRows(
                arrays,
                seq.record_id,
                int(supervised[0]) if len(supervised) else T,
                "imported",
                hashlib.sha256(ids.astype("<i4").tobytes()).hexdigest(),
                "{}",
            )
        )
        count, tokens = count + 1, tokens + T
        if count % _COMMIT_EVERY == 0:
            writer.commit()
    if writer is None:
        raise InputError(f"found no sequences to import for {out}; check the source folder")
    # Every file before the completion mark (issue 36): provenance.json and the run log are published
    # first, then finish() marks the cache complete, so a complete cache never lacks one of them.
    provenance = {
        "schema_version": SCHEMA_VERSION,
        "imported": {
            **imported,
            "target": target,
            "absent": [] if head is not None else list(ABSENT_TARGET_ARRAYS),
            "computed": None if head is None else _COMPUTED,
            "sequences": count,
            "tokens": tokens,
        },
    }
    write_provenance(writer, provenance)  # recorded in the manifest's checksums like extract's
    # What this run did goes to the run log, outside the digest (store/run_log.py).
    run.update(finished_at=utc_now(), sequences_at_finish=count)
    writer.write_run_log(encode_run_log([run]))
    writer.finish()
    return count, tokens
