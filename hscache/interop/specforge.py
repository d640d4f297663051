"""SpecForge's offline DFlash features: ``rows_{g}-{g+2000}/data_{i}.ckpt``.

As SpecForge defines them (sgl-project/SpecForge a6b6b02: ``scripts/prepare_hidden_states.py``
``_get_file_path`` and the dflash capture layout; ``specforge/runtime/data_plane/feature_store.py``
``load_feature_file``; ``specforge/algorithms/common/dflash_family_data.py``
``normalize_offline_sample``):

- one ``torch.save`` dict per sample: ``input_ids`` [T] int64, ``loss_mask`` [T] int64 (1 on
  supervised tokens), ``hidden_states`` [1, T, K*H] in the target dtype: the K captured layers
  concatenated on the last dim in ascending layer order;
- file ``{out}/rows_{g}-{g + 2000}/data_{i}.ckpt`` with g = 2000 * (i // 2000), i the global sample
  index (``.ckpt.gz`` when captured with ``--compress``);
- layers = the draft config's ``dflash_config.target_layer_ids`` with NO shift: SGLang captures
  "before layer k + 1" = the output of decoder layer k, before the final norm, which is hscache's
  layer k. The last layer (L - 1) cannot be captured that way (there is no layer L).

Refused by name: EAGLE3 captures (``aux_hidden_state``/``hidden_state`` keys), a cache holding
the last layer, layers not in ascending order. Export writes the loss mask as hscache's
generated positions (t >= prompt_len); SpecForge trains position t iff loss_mask[t].
"""

from __future__ import annotations

import gzip
import io
import os
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from hscache.data import SequenceDataset
from hscache.errors import InputError
from hscache.interop.common import (
    INFLATE_RATIO,
    ImportedSequence,
    ImportSource,
    begin_export,
    check_export_complete,
    export_errors,
    finish_export,
    import_record,
    importer,
    inflate_limit,
    num_target_layers,
    publish_file,
    read_sidecar,
    select_layers,
    source_layer_ids,
)
from hscache.progress import NO_PROGRESS
from hscache.store.fsio import open_regular
from hscache.store.open import open_cache
from hscache.store.paths import check_source_dir

__all__ = ["FILE_GROUP_SIZE", "export_specforge", "feature_path", "import_specforge"]

FILE_GROUP_SIZE = 2000  # prepare_hidden_states.py's file_group_size
_FILE = re.compile(r"^data_(\d+)\.ckpt(\.gz)?$")
_SUFFIXES = (".ckpt", ".ckpt.gz")  # SpecForge's offline_reader._FEATURE_SUFFIXES
LAYER_CONVENTION = (
    "dflash_config.target_layer_ids, no shift: SGLang captures before layer k + 1 = output of "
    "decoder layer k, before the final norm; concatenated on the last dim in ascending order"
)


def feature_path(out: Path, index: int, extension: str = ".ckpt") -> Path:
    """SpecForge's ``_get_file_path``: ``out/rows_{g}-{g+2000}/data_{index}{extension}``."""
    group = index // FILE_GROUP_SIZE * FILE_GROUP_SIZE
    return Path(out) / f"rows_{group}-{group + FILE_GROUP_SIZE}" / f"data_{index}{extension}"


def _check_layers(cache: Any, layer_ids: list[int] | None) -> list[int]:
    ids = select_layers(cache, layer_ids)
    if ids != sorted(ids):
        raise InputError(
            f"cache layers {ids} are not in ascending order; SpecForge concatenates captured layers in "
            "ascending order, so exporting another order is not implemented: re-extract with ascending --layers"
        )
    total = num_target_layers(cache)
    if total is not None and total - 1 in ids:
        raise InputError(
            f"cache layers {ids} include the target's last layer {total - 1}; SpecForge's SGLang capture "
            f"cannot take it (it captures before layer k + 1), so exporting it is not implemented: "
            f"export without it (--layers) or re-extract without layer {total - 1}"
        )
    return ids


def export_specforge(
    cache_path: str | Path, out: str | Path, layer_ids: list[int] | None = None, progress: Any = NO_PROGRESS
) -> int:
    """Write the cache at ``cache_path`` as SpecForge offline DFlash files under ``out``; return the count.

    Raises:
        InputError: ``out`` is not new/empty, or the cache is a variant SpecForge cannot hold.
    """
    cache = open_cache(cache_path)
    ids = _check_layers(cache, layer_ids)
    data = SequenceDataset(cache_path, layer_ids=ids)
    out = begin_export(Path(out), len(data))
    groups = {feature_path(Path(), i).parts[0] for i in range(len(data))}  # rows_<g>-<g+2000>/
    with export_errors(out, f"hscache export {cache_path} --format specforge --out {out}", groups):
        return _export(cache, data, out, ids, progress)


def expected_files(sequences: int) -> list[str]:
    """The files an export of ``sequences`` sequences writes (what a killed one may lack)."""
    return [feature_path(Path(), i).as_posix() for i in range(sequences)]


def _export(cache: Any, data: Any, out: Path, ids: list[int], progress: Any) -> int:
    record_ids = []
    progress.start(len(data), label="export", unit="sequences")
    for i in range(len(data)):
        item = data[i]
        hidden = item["hidden_states"]
        T = hidden.shape[0]
        record = {
            "input_ids": item["token_ids"].clone(),
            "loss_mask": item["loss_mask"].to(torch.int64),
            "hidden_states": hidden.reshape(T, -1).unsqueeze(0).clone(),
        }
        publish_file(feature_path(out, i), lambda tmp, r=record: torch.save(r, tmp))
        record_ids.append(item["record_id"])
        progress.advance(1)
    finish_export(
        out,
        {
            "format": "specforge",
            "layer_ids": ids,
            "target_layer_ids": ids,
            "num_target_layers": num_target_layers(cache),
            "hidden_size": int(cache.specs["hidden_states"].row_shape[1]),
            "record_ids": record_ids,
            "exported_from": str(getattr(cache, "url", cache.path)),
            "note": "draft config: dflash_config.target_layer_ids = target_layer_ids (no shift)",
        },
    )
    return len(record_ids)


def _feature_files(directory: Path) -> list[tuple[int, Path, str | None]]:
    """(index, path, sample id) of every feature file under ``directory``.

    ``prepare_hidden_states.py`` writes ``data_{i}.ckpt[.gz]`` (index i, ordered by it; no sample
    id). SpecForge's in-memory feature store dumps ``{sample_id}.ckpt`` (``feature_store.py``
    ``_dump``), which its ``OfflineManifestReader`` reads like any ``*.ckpt``/``*.ckpt.gz``: when a
    folder holds such files, every file is taken in that reader's order (absolute paths sorted)
    and a dump's record id is its sample id.
    """
    numbered, dumped = [], []
    for root, _dirs, files in os.walk(directory):
        for name in files:
            match = _FILE.match(name)
            if match:
                numbered.append((int(match.group(1)), Path(root) / name, None))
            elif name.endswith(_SUFFIXES):
                dumped.append(Path(root) / name)
    if not dumped:
        return sorted(numbered)
    ordered = sorted([path for _, path, _ in numbered] + dumped, key=lambda p: str(p.resolve()))
    return [
        (k, path, None if _FILE.match(path.name) else _sample_id(path.name)) for k, path in enumerate(ordered)
    ]


def _sample_id(name: str) -> str:
    return name[: -len(".ckpt.gz")] if name.endswith(".ckpt.gz") else name[: -len(".ckpt")]


# A feature file may inflate to at most ``inflate_limit`` of its size (interop/common.py): a file
# that inflates further is a decompression bomb, refused before the inflated bytes are allocated.
_PIECE = 1 << 20


def _inflate_limit(path: Path, size: int) -> int:
    return inflate_limit(size)


def _inflated_at_most(path: Path) -> int:
    """The most bytes ``path`` is read as: its size (torch.save stores entries uncompressed), a .gz
    its inflate limit (whatever inflates further is refused)."""
    size = path.stat().st_size
    return _inflate_limit(path, size) if path.suffix == ".gz" else size


def _bomb(path: Path, size: int, limit: int) -> InputError:
    return InputError(
        f"{path} inflates to more than {limit >> 20} MiB ({INFLATE_RATIO}x its {size} bytes; real hidden states "
        "compress about 1.2x): a decompression bomb, or not a SpecForge feature file; remove it from the folder"
    )


def _gunzip(path: Path, size: int, limit: int) -> bytes:
    """The inflated content of ``path``, read piece by piece and refused past ``limit`` bytes."""
    out, total = io.BytesIO(), 0
    with open_regular(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
        while piece := f.read(_PIECE):
            total += len(piece)
            if total > limit:
                raise _bomb(path, size, limit)
            out.write(piece)
    return out.getvalue()


def _check_archive(path: Path, source: Any, size: int, limit: int) -> None:
    """Refuse a torch.save zip whose entries declare more than ``limit`` inflated bytes (torch
    allocates each record at its declared size); a file that is no zip is left to torch.load."""
    try:
        with zipfile.ZipFile(source) as archive:
            declared = sum(info.file_size for info in archive.infolist())
    except (zipfile.BadZipFile, ValueError, OSError, EOFError):
        return
    if declared > limit:
        raise _bomb(path, size, limit)


def _load(path: Path) -> dict[str, Any]:
    """A feature file, with tensors only (weights_only: the files are data, never code), its
    inflated size bounded before anything is allocated (``INFLATE_RATIO``)."""
    try:
        size = os.stat(path).st_size
        limit = _inflate_limit(path, size)
        if path.suffix == ".gz":
            data = _gunzip(path, size, limit)
            _check_archive(path, io.BytesIO(data), size, limit)
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        with open_regular(path) as f:
            _check_archive(path, f, size, limit)
            f.seek(0)
            return torch.load(f, map_location="cpu", weights_only=True)
    except InputError:
        raise
    except Exception as exc:  # torch raises many types for damaged or non-tensor pickles
        detail = " ".join(str(exc).split())[:300]
        raise InputError(f"{path} is not a SpecForge feature file of tensors ({detail})") from exc


def _sequences(
    files: list[tuple[int, Path, str | None]], layers: int, record_ids: list[str] | None
) -> Iterator[ImportedSequence]:
    for index, path, sample_id in files:
        raw = _load(path)
        if not isinstance(raw, dict):
            raise InputError(f"{path} holds a {type(raw).__name__}, not a SpecForge feature dict")
        if "aux_hidden_state" in raw or "hidden_state" in raw:
            raise InputError(
                f"{path} is a SpecForge EAGLE3 capture (aux_hidden_state/hidden_state); only DFlash "
                "captures (prepare_hidden_states.py --strategy dflash) are implemented"
            )
        missing = {"input_ids", "loss_mask", "hidden_states"} - set(raw)
        if missing:
            raise InputError(f"{path} lacks {sorted(missing)}; not a SpecForge DFlash feature file")
        hidden = raw["hidden_states"]
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2 or hidden.shape[1] % layers:
            raise InputError(
                f"{path}: hidden_states {tuple(raw['hidden_states'].shape)} is not [1, T, K*H] with K = "
                f"{layers} layers; check --layer-ids"
            )
        T = hidden.shape[0]
        if sample_id is not None:
            name = sample_id
        else:
            name = record_ids[index] if record_ids and index < len(record_ids) else f"data_{index}"
        ids, mask = raw["input_ids"], raw["loss_mask"]
        # The store's dumps keep whatever was put: [1, T] rows as well as [T].
        ids = ids[0] if ids.dim() == 2 and ids.shape[0] == 1 else ids
        mask = mask[0] if mask.dim() == 2 and mask.shape[0] == 1 else mask
        yield ImportedSequence(name, hidden.reshape(T, layers, -1), ids, mask)


def _read_specforge(directory: str | Path, layer_ids: list[int] | None, target: str | None) -> ImportSource:
    """Turn SpecForge DFlash feature files under ``directory`` into a cache at ``out``.

    ``layer_ids``: the draft config's ``dflash_config.target_layer_ids`` (needed unless the folder
    is an hscache export). Returns (sequences, tokens).

    Raises:
        InputError: no feature files, no layer ids, or files that are not DFlash captures.
    """
    directory = check_source_dir(directory, "specforge")
    check_export_complete(directory, expected_files)
    files = _feature_files(directory)
    if not files:
        raise InputError(
            f"{directory} holds no SpecForge feature files (rows_*/data_<i>.ckpt, or the feature store's "
            "<sample_id>.ckpt dumps)"
        )
    sidecar = read_sidecar(directory, "specforge")
    hint = "the draft config's dflash_config.target_layer_ids"
    ids, given = source_layer_ids(directory, layer_ids, sidecar, "target_layer_ids", hint)
    imported = import_record("specforge", directory, len(files), ids, ids, LAYER_CONVENTION, given, sidecar)
    total = (sidecar or {}).get("num_target_layers")
    if total is not None and any(not 0 <= i < total for i in ids):
        raise InputError(
            f"--layer-ids {','.join(map(str, ids))}: {max(ids)} is not a layer of the {total}-layer target the "
            "sidecar records; pass the layers the files hold"
        )
    record_ids = (sidecar or {}).get("record_ids")
    return ImportSource(  # a target adds target/ only: SpecForge's files never hold the last layer
        _sequences(files, len(ids), record_ids),
        layer_ids=list(ids),
        imported=imported,
        source_bytes=sum(_inflated_at_most(path) for _, path, _ in files),
    )


import_specforge = importer("import_specforge", _read_specforge)
