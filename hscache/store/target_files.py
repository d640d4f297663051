"""``target/``: the target's config, tokenizer files and embedding/output head, written and read.

The scorer never needs the model itself: ``head.safetensors`` holds ``embed_tokens`` (and
``lm_head`` when the two are not tied, with metadata ``tied``), ``config.json`` the target's text
config, and the tokenizer files are what ``save_pretrained`` writes. ``mtp.safetensors`` holds the
target's own MTP head (``mtp.*`` tensors, checkpoint names) when the target has one.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hscache.errors import CacheFormatError
from hscache.store import fsio, jsonio
from hscache.store.layout import TARGET_DIR

if TYPE_CHECKING:  # torch only for hints: `hscache info` reads target/config.json without it
    import torch

__all__ = [
    "HEAD_FILE",
    "MTP_FILE",
    "check_safetensors",
    "check_safetensors_bytes",
    "load_tokenizer",
    "load_tokenizer_files",
    "tensors_from_safetensors",
    "read_target_config",
    "read_target_head",
    "read_target_mtp",
    "read_vocab_size",
    "write_target_dir",
]

HEAD_FILE = "head.safetensors"
MTP_FILE = "mtp.safetensors"


def write_target_dir(
    out: Path,
    config: dict[str, Any],
    tokenizer: Any,
    embed: torch.Tensor,
    head: torch.Tensor,
    extra: dict[str, torch.Tensor] | None = None,
    mtp: dict[str, torch.Tensor] | None = None,
) -> None:
    """Publish ``out/target/`` whole: staged under a temp name, fsynced, then renamed into place.

    ``head`` sharing ``embed``'s storage (tied weights) is written once. ``extra`` tensors (the
    target's final norm, see capture/final_norm.py) go into ``head.safetensors`` beside them; ``mtp`` tensors (the target's MTP head, capture/mtp.py)
    into ``mtp.safetensors``, a file of its own so that readers of the head never load them.

    Raises:
        OSError: a write failed (safetensors' own I/O errors included).
    """
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    staging = out / f"{TARGET_DIR}{fsio.TEMP_MARK}staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    (staging / "config.json").write_text(json.dumps(config, indent=2, default=str))
    tokenizer.save_pretrained(str(staging))
    tied = embed.data_ptr() == head.data_ptr()
    tensors = {"embed_tokens": embed.contiguous()}
    if not tied:
        tensors["lm_head"] = head.contiguous()
    tensors.update(extra or {})
    files = [(HEAD_FILE, tensors, {"tied": str(tied).lower()})]
    if mtp:
        files.append((MTP_FILE, {k: v.contiguous() for k, v in mtp.items()}, None))
    for name, content, metadata in files:
        try:
            save_file(content, str(staging / name), metadata=metadata)
        except SafetensorError as exc:  # safetensors reports I/O errors (disk full) as its own type
            raise OSError(f"cannot write {staging / name}: {exc}") from exc
        fsio.match_umask(staging / name)  # safetensors writes it 0600
    for path in staging.iterdir():
        fsio.fsync_file(path)
    shutil.rmtree(out / TARGET_DIR, ignore_errors=True)
    staging.rename(out / TARGET_DIR)
    fsio.fsync_dir(out)


# safetensors' own limit on the header (100 MB); a real head's header is a few hundred bytes.
_MAX_HEADER_BYTES = 100 << 20
_ITEM_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_safetensors(path: Path) -> dict[str, Any]:
    """The header of the safetensors file ``path``, checked to describe the file: every tensor's
    dtype known, its shape non-negative integers whose bytes equal its data range, ranges inside
    the data and not overlapping. Read before safetensors (or torch) allocates anything.

    Raises:
        CacheFormatError: the header is damaged or describes another file (one line naming it).
    """
    path = Path(path)
    where = f"{path.parent.name}/{path.name}"
    try:
        with fsio.open_regular(path) as f:
            size = os.fstat(f.fileno()).st_size
            n = int.from_bytes(f.read(8), "little")
            if size < 8 or n > min(_MAX_HEADER_BYTES, size - 8):
                raise CacheFormatError(
                    f"{where} claims a {n}-byte header in a {size}-byte file; it is damaged"
                )
            head = f.read(n)
    except OSError as exc:
        raise CacheFormatError(f"{where} cannot be read ({exc})") from exc
    return _checked_header(head, size, where)


def check_safetensors_bytes(data: bytes | bytearray, where: str) -> dict[str, Any]:
    """``check_safetensors`` of a file already read into ``data`` (``where`` names it)."""
    size = len(data)
    n = int.from_bytes(bytes(data[:8]), "little")
    if size < 8 or n > min(_MAX_HEADER_BYTES, size - 8):
        raise CacheFormatError(f"{where} claims a {n}-byte header in a {size}-byte file; it is damaged")
    return _checked_header(bytes(data[8 : 8 + n]), size, where)


def _checked_header(raw: bytes, size: int, where: str) -> dict[str, Any]:
    n = len(raw)
    try:
        header = jsonio.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CacheFormatError(f"{where} has a header that is not valid JSON ({exc}); it is damaged") from exc
    if not isinstance(header, dict):
        raise CacheFormatError(f"{where} has a header that is not a JSON object; it is damaged")
    data_bytes, ranges = size - 8 - n, []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        ok = isinstance(info, dict) and info.get("dtype") in _ITEM_BYTES
        shape, offsets = (info.get("shape"), info.get("data_offsets")) if ok else (None, None)
        ok = ok and isinstance(shape, list) and all(isinstance(d, int) and 0 <= d < 1 << 40 for d in shape)
        ok = (
            ok
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) for o in offsets)
        )
        if ok:
            count = 1
            for d in shape:
                count *= d
            ok = (
                0 <= offsets[0] <= offsets[1] <= data_bytes
                and offsets[1] - offsets[0] == count * _ITEM_BYTES[info["dtype"]]
            )
        if not ok:
            raise CacheFormatError(
                f"{where}: tensor {name!r} has a header entry that does not fit the file ({str(info)[:200]}); "
                "it is damaged"
            )
        ranges.append(tuple(offsets))
    ranges.sort()
    if any(a[1] > b[0] for a, b in zip(ranges, ranges[1:])):
        raise CacheFormatError(f"{where}: tensors' data ranges overlap; it is damaged")
    return header


_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I16": "int16",
    "U16": "uint16",
    "F16": "float16",
    "BF16": "bfloat16",
    "I32": "int32",
    "U32": "uint32",
    "F32": "float32",
    "I64": "int64",
    "U64": "uint64",
    "F64": "float64",
}


def tensors_from_safetensors(data: bytearray, where: str) -> dict[str, torch.Tensor]:
    """The tensors of the safetensors file read into ``data`` (header checked first): views of
    ``data`` itself, no copy (the caller hands over a buffer of its own)."""
    import torch

    header = check_safetensors_bytes(data, where)
    base = 8 + int.from_bytes(bytes(data[:8]), "little")
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype = getattr(torch, _TORCH_DTYPES[info["dtype"]])
        a, b = info["data_offsets"]
        if b == a:
            tensors[name] = torch.empty(info["shape"], dtype=dtype)
            continue
        flat = torch.frombuffer(data, dtype=torch.uint8, count=b - a, offset=base + a)
        try:
            tensors[name] = flat.view(dtype).view(info["shape"])
        except RuntimeError:  # a range not aligned to its item size: a copy of its own, aligned
            tensors[name] = flat.clone().view(dtype).view(info["shape"])
    return tensors


def load_tokenizer_files(files: dict[str, bytes]) -> Any:
    """The tokenizer saved in ``target/``, from the bytes of its files (``{name: bytes}``, read and
    checked once by the reader): written into a private temp directory that transformers reads."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory(prefix="hscache-tokenizer-") as tmp:
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
        return AutoTokenizer.from_pretrained(tmp, local_files_only=True, trust_remote_code=False)


def read_target_config(root: Path) -> dict[str, Any]:
    """The target's text config as written at extraction.

    Raises:
        CacheFormatError: not a JSON object (one line).
    """
    path = Path(root) / TARGET_DIR / "config.json"
    return jsonio.load_cache_object(path.read_bytes(), path)


def read_target_head(root: Path) -> dict[str, torch.Tensor]:
    """``{"embed_tokens": [V, H], "lm_head": [V, H]}``; one shared tensor when tied."""
    from safetensors.torch import load_file

    check_safetensors(Path(root) / TARGET_DIR / HEAD_FILE)
    tensors = load_file(str(Path(root) / TARGET_DIR / HEAD_FILE))
    if "lm_head" not in tensors:
        tensors["lm_head"] = tensors["embed_tokens"]
    return tensors


def read_target_mtp(root: Path) -> dict[str, torch.Tensor]:
    """The target's ``mtp.*`` tensors saved at extraction; {} when the cache has none."""
    from safetensors.torch import load_file

    path = Path(root) / TARGET_DIR / MTP_FILE
    return load_file(str(path)) if path.is_file() else {}


def read_vocab_size(root: Path) -> int:
    """Rows of the target's embedding, read from the safetensors header (no weights loaded)."""
    from safetensors import safe_open

    header = check_safetensors(Path(root) / TARGET_DIR / HEAD_FILE)
    embed = header.get("embed_tokens")
    if not isinstance(embed, dict) or len(embed.get("shape", [])) != 2:
        raise CacheFormatError(
            f"{TARGET_DIR}/{HEAD_FILE} holds no [vocab, hidden] embed_tokens; the cache is damaged"
        )
    with safe_open(str(Path(root) / TARGET_DIR / HEAD_FILE), framework="pt") as f:
        return int(f.get_slice("embed_tokens").get_shape()[0])


def load_tokenizer(root: Path) -> Any:
    """The target's tokenizer from ``target/``."""
    from transformers import AutoTokenizer

    # The cache is data, never code: no remote code from tokenizer_config.json's auto_map.
    return AutoTokenizer.from_pretrained(
        str(Path(root) / TARGET_DIR), local_files_only=True, trust_remote_code=False
    )
