"""vLLM's own hidden-state files (``extract_hidden_states`` + its connector) into a cache.

``DIR`` holds one safetensors file per request as the connector writes them
(``<n>-<hash>.safetensors``, each with an empty ``.lock``), or speculators' renamed copies of those
very files (``hs_<i>.safetensors``: its data generation moves the connector's file unchanged,
speculators 0.9.0 ``cli/generate_offline_data.py:139-160``); the layout and checks are in
hscache/engines/vllm/files.py. ``--layer-ids`` are vLLM's ids (the engine's
``eagle_aux_hidden_state_layer_ids``, k = the input of decoder layer k, k = L the last layer's output
before the final norm); hscache layer = k - 1.

The files hold no prompt boundary and no logits: every position is marked supervised (``loss_mask``
1, ``prompt_len`` 0). With ``--target`` the ids are checked against its vocabulary and depth, and
when the files hold vLLM id L (the last layer, before the final norm) the target's own norm and head
give ``target_argmax``/top-k/logsumexp (interop/target.py), as for speculators' files.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch

from hscache.capture.model_config import read_model_config, require_int
from hscache.engines.vllm.files import (
    check_connector_header,
    connector_files,
    hscache_ids,
    read_connector_file,
)
from hscache.errors import InputError
from hscache.interop.common import ImportedSequence, ImportSource, import_record, importer, source_layer_ids
from hscache.store.paths import check_source_dir

__all__ = ["LAYER_CONVENTION", "import_vllm"]

LAYER_CONVENTION = (
    "vLLM eagle_aux_hidden_state_layer_ids: id k = transformers hidden_states[k] = the input of decoder layer k "
    "(hscache layer k - 1); id L = the last layer's output before the final norm"
)


def _target_shape(name: str) -> tuple[int, int, int]:
    """(vocab size, decoder layers, hidden size) of ``name``, from its config (a built-in is built)."""
    if name.startswith("builtin:"):
        from hscache.capture.target import load_target

        target = load_target(name, "fp32", "cpu")
        return target.vocab_size, target.num_layers, int(target.text_config.hidden_size)
    path = Path(name) / "config.json"
    if not path.is_file():
        raise InputError(f"--target {name} is neither a built-in target nor a directory with config.json")
    config = read_model_config(name, "--target")
    where = f"--target {name}: {path}"
    return (
        require_int(config, "vocab_size", where),
        require_int(config, "num_hidden_layers", where),
        require_int(config, "hidden_size", where),
    )


def _sequences(
    files: list[Path], layers: int, vocab: int | None, width: int | None
) -> Iterator[ImportedSequence]:
    for path in files:
        read = read_connector_file(path, layers, vocab, width)
        T = len(read.token_ids)
        yield ImportedSequence(
            path.name.split(".")[0], read.hidden_states, read.token_ids, torch.ones(T, dtype=torch.int32)
        )


def _read_vllm(directory: str | Path, layer_ids: list[int] | None, target: str | None) -> ImportSource:
    """Turn the vLLM hidden-state files in ``directory`` into a cache at ``out``; return (sequences, tokens).

    ``layer_ids``: the engine's ``eagle_aux_hidden_state_layer_ids`` (required: the files do not say).
    ``target``: the model that produced them (ids checked against its vocabulary and depth; target/
    added; target arrays computed when id L is among the files' layers).

    Raises:
        InputError: no files, no or bad layer ids, a file that is truncated or hostile, whose layer count
        or width disagrees, that holds NaN/Inf or token ids outside the target's vocabulary. Every
        header is checked before anything is written.
    """
    directory = check_source_dir(directory, "vllm")
    files = connector_files(directory)
    hint = "the engine's eagle_aux_hidden_state_layer_ids (e.g. 2,4,8: hscache layers 1,3,7)"
    layer_ids, given = source_layer_ids(directory, layer_ids, None, None, hint)  # vLLM's files do not say
    vocab = depth = width = None
    if target is not None:
        vocab, depth, width = _target_shape(target)
    ids = hscache_ids(layer_ids, depth)
    for path in files:  # every header (shape, truncation) before anything is written
        check_connector_header(path, len(ids), width)
    last = ids.index(depth - 1) if depth is not None and depth - 1 in ids else None
    imported = import_record("vllm", directory, len(files), ids, layer_ids, LAYER_CONVENTION, given, None)
    return ImportSource(
        _sequences(files, len(ids), vocab, width),
        layer_ids=ids,
        imported=imported,
        source_bytes=sum(path.stat().st_size for path in files),
        last_layer_slot=last,
    )


import_vllm = importer("import_vllm", _read_vllm)
