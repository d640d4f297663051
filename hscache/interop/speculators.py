"""speculators' offline training data: a preprocessed dataset and ``hidden_states/hs_{i}.safetensors``.

As speculators defines it (vllm-project/speculators c05b95b: ``src/speculators/train/data.py``
``ArrowDataset``, ``hs_connectors/.../transfer.py`` ``FileTransfer``,
``scripts/data_generation_offline.py``, ``src/speculators/data_generation/preprocessing.py``):

- ``DIR`` is a Hugging Face dataset (``save_to_disk``: ``data-00000-of-00001.arrow``,
  ``dataset_info.json``, ``state.json``, torch format) with columns ``input_ids`` (int64 list),
  ``loss_mask`` (int64 list, 1 = supervised) and ``seq_len`` (int64), row i = sample i;
- ``DIR/hidden_states/hs_{i}.safetensors`` holds ``hidden_states`` [T, num_layers, H] and
  ``token_ids`` [T] (must equal row i's ``input_ids``);
- the layers are vLLM aux ids (``launch_vllm.py --target-layer-ids``, + the last layer L appended
  by ``--include-last-layer``), aux id a = "after decoder layer a - 1", before the final norm:
  hscache layer i is aux id i + 1 (the +1 shift). Training reads slots ``[:, :-1]`` as the
  drafter's context features and the last slot as ``verifier_last_hidden_states``, so the last
  slot must be layer L - 1 (aux L); the speculator config's ``aux_hidden_state_layer_ids`` are
  the other slots' aux ids.

Refused by name: a cache without the target's last layer (or with it elsewhere than last),
``.safetensors.zst`` files (vLLM's compressed connector output).
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from hscache.data import SequenceDataset
from hscache.engines.vllm.files import SCALES_KEY
from hscache.errors import CacheFormatError, InputError
from hscache.interop.arrow_stream import read_bounded_stream
from hscache.interop.common import (
    ImportedSequence,
    ImportSource,
    begin_export,
    check_export_complete,
    export_errors,
    finish_export,
    import_record,
    importer,
    num_target_layers,
    publish_file,
    read_sidecar,
    select_layers,
    source_layer_ids,
)
from hscache.progress import NO_PROGRESS
from hscache.store import jsonio
from hscache.store.compact import quantise_per_token
from hscache.store.fsio import open_regular, read_regular
from hscache.store.open import open_cache
from hscache.store.paths import check_source_dir
from hscache.store.target_files import check_safetensors_bytes

__all__ = ["export_speculators", "import_speculators"]

HIDDEN_DIR = "hidden_states"
ARROW_FILE = "data-00000-of-00001.arrow"
DATASET_INFO = "dataset_info.json"
STATE_FILE = "state.json"
LAYER_CONVENTION = (
    "vLLM aux ids: aux id a = output of decoder layer a - 1 before the final norm (hscache layer a - 1); "
    "the last slot is aux id L = the target's last layer"
)
_HS_FILE = re.compile(r"^hs_(\d+)\.safetensors$")
_FEATURES = {
    "input_ids": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "loss_mask": {"feature": {"dtype": "int64", "_type": "Value"}, "_type": "List"},
    "seq_len": {"dtype": "int64", "_type": "Value"},
}


def _check_layers(cache: Any, layer_ids: list[int] | None) -> tuple[list[int], int]:
    total = num_target_layers(cache)
    ids = select_layers(cache, layer_ids)
    if total is None:
        raise InputError(
            f"{cache.path} does not record its target's layer count (no target/config.json); speculators "
            "needs it to place the last layer"
        )
    if ids[-1] != total - 1:
        raise InputError(
            f"cache layers {ids} do not end with the target's last layer {total - 1}; speculators' training "
            f"reads the last slot as verifier_last_hidden_states (vLLM aux id {total}), so exporting without "
            f"it is not implemented: re-extract with --layers {','.join(map(str, [*ids, total - 1]))}"
        )
    return ids, total


def _write_dataset(out: Path, rows: dict[str, list]) -> None:
    """``rows`` as a Hugging Face ``save_to_disk`` folder (one arrow shard, torch format)."""
    schema = pa.schema(
        [("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64())), ("seq_len", pa.int64())],
        metadata={"huggingface": json.dumps({"info": {"features": _FEATURES}})},
    )
    table = pa.table(rows, schema=schema)
    with pa.OSFile(str(out / ARROW_FILE), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        writer.write_table(table)
    info = {"citation": "", "description": "", "features": _FEATURES, "homepage": "", "license": ""}
    (out / DATASET_INFO).write_text(json.dumps(info, indent=2))
    state = {
        "_data_files": [{"filename": ARROW_FILE}],
        "_fingerprint": uuid.uuid4().hex[:16],
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": "torch",
        "_output_all_columns": False,
        "_split": None,
    }
    (out / STATE_FILE).write_text(json.dumps(state, indent=2))


def export_speculators(
    cache_path: str | Path,
    out: str | Path,
    layer_ids: list[int] | None = None,
    progress: Any = NO_PROGRESS,
    states: str = "source",
) -> int:
    """Write the cache at ``cache_path`` as speculators offline data under ``out``; return the count.

    ``states="fp8"``: each ``hs_{i}.safetensors`` as hs-connectors' fp8 backend writes it (float8_e4m3fn
    ``hidden_states`` and ``hidden_states_scales`` [T, 1, 1], store/compact.py ``quantise_per_token``),
    read by speculators with ``--hidden-states-backend fp8``.

    Raises:
        InputError: ``out`` is not new/empty, the cache lacks the target's last layer, or an unknown ``states``.
    """
    from safetensors.torch import save_file

    if states not in ("source", "fp8"):
        raise InputError(f"--states {states!r}: choose source or fp8")
    cache = open_cache(cache_path)
    ids, total = _check_layers(cache, layer_ids)
    data = SequenceDataset(cache_path, layer_ids=ids)
    out = begin_export(Path(out), len(data))
    command = f"hscache export {cache_path} --format speculators --out {out}"
    with export_errors(out, command, (HIDDEN_DIR, ARROW_FILE, DATASET_INFO, STATE_FILE)):
        return _export(cache, data, out, ids, total, save_file, progress, states)


def _export(
    cache: Any,
    data: Any,
    out: Path,
    ids: list[int],
    total: int,
    save_file: Any,
    progress: Any,
    states: str = "source",
) -> int:
    (out / HIDDEN_DIR).mkdir()
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    record_ids = []
    progress.start(len(data), label="export", unit="sequences")
    for i in range(len(data)):
        item = data[i]
        ids_i = item["token_ids"]
        tensors = {"hidden_states": item["hidden_states"].contiguous(), "token_ids": ids_i.contiguous()}
        if states == "fp8":
            tensors["hidden_states"], tensors[SCALES_KEY] = quantise_per_token(tensors["hidden_states"])
        publish_file(
            out / HIDDEN_DIR / f"hs_{i}.safetensors", lambda tmp, t=tensors: _save(save_file, t, tmp)
        )
        rows["input_ids"].append(ids_i.tolist())
        rows["loss_mask"].append(item["loss_mask"].to(torch.int64).tolist())
        rows["seq_len"].append(len(ids_i))
        record_ids.append(item["record_id"])
        progress.advance(1)
    _write_dataset(out, rows)
    aux = [i + 1 for i in ids]
    finish_export(
        out,
        {
            "format": "speculators",
            "layer_ids": ids,
            "vllm_layer_ids": aux,
            "aux_hidden_state_layer_ids": aux[:-1],
            "num_target_layers": total,
            "hidden_size": int(cache.specs["hidden_states"].row_shape[1]),
            "record_ids": record_ids,
            "exported_from": str(getattr(cache, "url", cache.path)),
            **(
                {
                    "states": "fp8",
                    "hidden_states_backend": "fp8 (hs-connectors FP8Transfer: hidden_states_scales)",
                }
                if states == "fp8"
                else {}
            ),
            "note": (
                "launch_vllm.py --target-layer-ids aux_hidden_state_layer_ids (--include-last-layer adds "
                "the last); speculator config aux_hidden_state_layer_ids = aux_hidden_state_layer_ids"
            ),
        },
    )
    return len(record_ids)


def _save(save_file: Any, tensors: dict[str, torch.Tensor], path: str) -> None:
    from safetensors import SafetensorError

    try:
        save_file(tensors, path)
    except SafetensorError as exc:  # safetensors reports I/O errors (disk full) as its own type
        raise OSError(f"cannot write {path}: {exc}") from exc


def expected_files(sequences: int) -> list[str]:
    """The files an export of ``sequences`` sequences writes (what a killed one may lack)."""
    return [*(f"{HIDDEN_DIR}/hs_{i}.safetensors" for i in range(sequences)), ARROW_FILE, STATE_FILE]


def _read_dataset(directory: Path) -> pa.Table:
    """The preprocessed dataset's rows (every shard listed in ``state.json``)."""
    state_path = directory / "state.json"
    if not state_path.is_file():
        raise InputError(
            f"{directory} has no state.json: not a speculators preprocessed dataset (prepare_data.py output, "
            "which holds the loss_mask); pass the dataset folder whose hidden_states/ holds hs_<i>.safetensors"
        )
    try:
        state = jsonio.loads(state_path.read_bytes())
    except (ValueError, UnicodeDecodeError) as exc:
        raise InputError(
            f"{state_path} is not valid JSON ({exc}); rerun speculators' prepare_data.py"
        ) from None
    files = state.get("_data_files") if isinstance(state, dict) else None
    if not (
        isinstance(files, list)
        and all(isinstance(e, dict) and isinstance(e.get("filename"), str) for e in files)
    ):
        raise InputError(
            f'{state_path} is not a datasets state file (no "_data_files": [{{"filename": ...}}]); rerun '
            "speculators' prepare_data.py"
        )
    tables = []
    for entry in files:
        path = directory / Path(entry["filename"]).name  # never outside the folder
        try:
            with open_regular(path) as raw, pa.PythonFile(raw, mode="r") as source:
                # Each batch's inflated size bounded before it is decoded (a zstd bomb, issue 52).
                tables.append(read_bounded_stream(source, os.fstat(raw.fileno()).st_size, str(path)))
        except (OSError, pa.ArrowException) as exc:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise InputError(
                f"{path} (listed in {state_path.name}) cannot be read as an Arrow stream ({detail}); "
                "rerun speculators' prepare_data.py"
            ) from None
    if not tables:
        raise InputError(f"{state_path} lists no data files")
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowException as exc:
        raise InputError(f"{directory}: its data files do not share one schema ({exc})") from None
    missing = {"input_ids", "loss_mask"} - set(table.column_names)
    if missing:
        raise InputError(f"{directory} has no column {sorted(missing)}; rerun speculators' prepare_data.py")
    for name in ("input_ids", "loss_mask"):
        kind = table.schema.field(name).type
        if not (pa.types.is_list(kind) or pa.types.is_large_list(kind)) or not pa.types.is_integer(
            kind.value_type
        ):
            raise InputError(
                f"{directory}: column {name} is {kind}, not a list of integers; rerun prepare_data.py"
            )
    return table


def _sequences(
    directory: Path, table: pa.Table, layers: int, record_ids: list[str] | None
) -> Iterator[ImportedSequence]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    input_ids, loss_mask = table.column("input_ids"), table.column("loss_mask")
    for i in range(table.num_rows):
        path = directory / HIDDEN_DIR / f"hs_{i}.safetensors"
        if not path.is_file():
            zst = path.with_name(path.name + ".zst")
            what = "is zstd-compressed (.zst), which is not implemented" if zst.is_file() else "is missing"
            raise InputError(f"{path} {what}; every dataset row needs its hidden-state file")
        try:
            # One read, regular files only: the header checked (before safetensors allocates) is the
            # header of the bytes that are loaded.
            data = read_regular(path)
            check_safetensors_bytes(data, str(path))
            loaded = load(bytes(data))
        except (CacheFormatError, SafetensorError, OSError) as exc:
            raise InputError(
                f"{path} is not a safetensors file of tensors ({' '.join(str(exc).split())[:200]}); every dataset "
                "row needs its hidden-state file"
            ) from None
        hidden, tokens = loaded.get("hidden_states"), loaded.get("token_ids")
        if hidden is None or tokens is None:
            raise InputError(f"{path} lacks hidden_states/token_ids; not a speculators hidden-state file")
        scales = loaded.get(SCALES_KEY)
        if scales is not None:  # hs-connectors' fp8 backend: fp8 x the token's scale, in float32
            if hidden.dtype != torch.float8_e4m3fn or tuple(scales.shape) != (len(hidden), 1, 1):
                raise InputError(
                    f"{path}: {SCALES_KEY} {tuple(scales.shape)} with hidden_states {hidden.dtype}; hs-connectors' "
                    "fp8 files hold float8_e4m3fn [T, layers, H] and float32 [T, 1, 1]"
                )
            hidden = hidden.float().mul_(scales.float())
        expected = torch.tensor(input_ids[i].as_py(), dtype=torch.int64)
        if not torch.equal(tokens.to(torch.int64), expected):
            raise InputError(
                f"{path}: token_ids differ from row {i}'s input_ids; the data set is inconsistent"
            )
        if hidden.dim() != 3 or hidden.shape[1] != layers:
            raise InputError(
                f"{path}: hidden_states {tuple(hidden.shape)} is not [T, {layers}, H] for the {layers} layer ids; "
                "check --layer-ids"
            )
        name = record_ids[i] if record_ids and i < len(record_ids) else f"hs_{i}"
        yield ImportedSequence(name, hidden, tokens, torch.tensor(loss_mask[i].as_py()))


def _read_speculators(directory: str | Path, layer_ids: list[int] | None, target: str | None) -> ImportSource:
    """Turn speculators offline data at ``directory`` into a cache at ``out``.

    ``layer_ids``: the vLLM aux ids of the file's slots, last layer included (e.g. ``2,14,25,28``
    for a 28-layer target); needed unless the folder is an hscache export. ``target``: the model
    that produced the files: adds ``target/`` and computes the target arrays from the last slot
    (interop/target.py). Returns (sequences, tokens).

    Raises:
        InputError: no dataset, a missing or inconsistent hidden-state file, no layer ids.
    """
    directory = check_source_dir(directory, "speculators")
    check_export_complete(directory, expected_files)
    table = _read_dataset(directory)
    sidecar = read_sidecar(directory, "speculators")
    hint = "the vLLM aux ids (launch_vllm.py --target-layer-ids plus the last layer), e.g. 2,14,25,28"
    aux, given = source_layer_ids(directory, layer_ids, sidecar, "vllm_layer_ids", hint)
    if 0 in aux:
        raise InputError(f"--layer-ids {aux}: vLLM aux id 0 (the embeddings) has no hscache layer")
    total = (sidecar or {}).get("num_target_layers")
    if total is not None and any(a > total for a in aux):
        raise InputError(
            f"--layer-ids {','.join(map(str, aux))}: aux id {max(aux)} is past the {total}-layer target the sidecar "
            f"records (aux ids run 1..{total}); pass the layers the files hold"
        )
    hidden_files = [p for p in (directory / HIDDEN_DIR).glob("hs_*.safetensors") if _HS_FILE.match(p.name)]
    files = len(hidden_files)
    ids = [a - 1 for a in aux]
    imported = import_record(
        "speculators", directory, max(1, files), ids, aux, LAYER_CONVENTION, given, sidecar
    )
    record_ids = (sidecar or {}).get("record_ids")
    return ImportSource(
        _sequences(directory, table, len(aux), record_ids),
        layer_ids=ids,
        imported=imported,
        source_bytes=sum(p.stat().st_size for p in hidden_files),
        last_layer_slot=len(aux) - 1,  # by the format, the last slot is the target's last layer
    )


import_speculators = importer("import_speculators", _read_speculators)
