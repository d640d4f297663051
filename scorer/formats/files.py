"""Reading a drafter checkpoint's files: which files, safetensors and pickles, safely.

Every malformed input (not a checkpoint, corrupt or truncated safetensors, a shard index naming
a path outside the directory, a pickle that needs code to load) is one CheckpointError line.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hscache.store import jsonio
from hscache.store.layout import MANIFEST
from hscache.store.paths import is_cache_dir
from scorer.errors import CheckpointError, CheckpointNotFoundError, UntrustedCheckpointError
from scorer.formats import specforge

__all__ = [
    "check_headers",
    "few",
    "read_json",
    "read_training_state_contract",
    "read_weights",
    "resolve_files",
]

FORMAT_HF_DIR, FORMAT_HF_SHARDED, FORMAT_SAFETENSORS, FORMAT_PICKLE, FORMAT_SPECFORGE = (
    "hf_dir",
    "hf_dir_sharded",
    "safetensors",
    "torch_pickle",
    "specforge_training_state",
)
_ACCEPTED = (
    "an HF directory (config.json + model.safetensors or shards + model.safetensors.index.json), "
    "a .safetensors file, a .pt/.pth/.bin training checkpoint, or a SpecForge {run}-stepN directory"
)
_PICKLE_SUFFIXES = (".pt", ".pth", ".bin")
_NESTING_KEYS = ("model", "state_dict", "model_state_dict", "module", specforge.WEIGHTS_KEY)
_CONFIG_KEYS = ("config", "args", "model_config")
# Keys that make a dict found in a training pickle a drafter config: the HF config fields of the
# families' drafters (DFlashConfig's fields) and the trainers' own names for them.
_CONFIG_HINTS = {
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "rope_scaling",
    "vocab_size",
    "attention_bias",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
    "num_target_layers",
    "layer_types",
    "sliding_window",
    "is_causal",
    "dflash_config",
    "aux",
    "aux_layer_ids",
}


def resolve_files(root: Path) -> tuple[str, list[Path], dict | None]:
    """Format, weight/config files to read and hash, and the parsed config.json (if any)."""
    if not root.exists():
        raise CheckpointNotFoundError(f"checkpoint {root} does not exist; expected {_ACCEPTED}")
    if root.is_file():
        if root.suffix == ".safetensors":
            return FORMAT_SAFETENSORS, [root], None
        if root.suffix in _PICKLE_SUFFIXES:
            return FORMAT_PICKLE, [root], None
        raise CheckpointError(f"{root}: unknown checkpoint suffix {root.suffix!r}; expected {_ACCEPTED}")
    cfg_path, index = root / "config.json", root / "model.safetensors.index.json"
    config = read_json(cfg_path) if cfg_path.is_file() else None
    head = [cfg_path] if config is not None else []
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map' object naming the shard of each tensor")
        names = sorted(set(weight_map.values()))
        if outside := [n for n in names if not _inside(root, n)]:
            raise CheckpointError(
                f"{index} names shard files outside the checkpoint directory ({few(outside, noun='path')}); "
                "refusing to open them: shard paths must be plain names within the directory"
            )
        shards = [root / s for s in names]
        if absent := [p.name for p in shards if not p.is_file()]:
            raise CheckpointNotFoundError(
                f"{root}: shards named in {index.name} are missing: {few(absent, noun='file')}"
            )
        return FORMAT_HF_SHARDED, head + [index] + shards, config
    for name, fmt in (
        ("model.safetensors", FORMAT_HF_DIR),
        ("pytorch_model.bin", FORMAT_PICKLE),
        (specforge.STATE_FILE, FORMAT_SPECFORGE),  # legacy epoch_E_step_S dirs have model.safetensors
    ):
        if (root / name).is_file():
            return fmt, head + [root / name], config
    if is_cache_dir(root):  # the drafter and the cache swapped on the command line
        raise CheckpointNotFoundError(
            f"{root} is a hidden-state cache (it holds {MANIFEST}), not a drafter; pass the drafter "
            f"first and the cache with --cache (e.g. scorer eval DRAFTER --cache {root})"
        )
    raise CheckpointNotFoundError(
        f"{root} holds no model.safetensors, model.safetensors.index.json, "
        f"pytorch_model.bin or training_state.pt; expected {_ACCEPTED}"
    )


def read_json(path: Path) -> dict:
    """The JSON object in ``path``, read from a regular file only, never waiting (a FIFO given as
    ``--config`` blocked ``scorer eval``, issue 52).

    Raises:
        CheckpointError: not readable, not a regular file, not JSON or not an object (one line).
    """
    try:
        data = jsonio.read_object(path)
    except jsonio.JsonObjectError as exc:
        raise CheckpointError(str(exc)) from None
    return data


def _inside(root: Path, name: str) -> bool:
    """A shard name from an index that stays inside ``root`` (no absolute path, no ``..``)."""
    path = Path(name)
    if path.is_absolute() or ".." in path.parts:
        return False
    return (root / path).resolve().is_relative_to(root.resolve())


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """load_file with every malformed-file error as one CheckpointError line."""
    from safetensors import SafetensorError

    if path.stat().st_size < 8:
        raise CheckpointError(f"{path} is not a safetensors file: {path.stat().st_size} bytes, no header")
    try:
        return load_file(path, device="cpu")
    except (SafetensorError, ValueError, RuntimeError, OverflowError, MemoryError) as e:
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise CheckpointError(
            f"{path} is not a valid safetensors file (corrupt or truncated): {reason}"
        ) from e


def check_headers(root: str | Path) -> None:
    """Resolve ``root``'s files and parse each safetensors header (no tensor is read): a missing,
    corrupt or truncated checkpoint is refused before a command prints progress or loads a model.

    Raises:
        CheckpointNotFoundError, CheckpointError: what ``resolve_files`` and ``read_weights`` refuse.
    """
    from safetensors import SafetensorError, safe_open

    for path in resolve_files(Path(root))[1]:
        if path.suffix != ".safetensors":
            continue
        if path.stat().st_size < 8:
            raise CheckpointError(f"{path} is not a safetensors file: {path.stat().st_size} bytes, no header")
        try:
            with safe_open(path, framework="pt", device="cpu"):
                pass
        except (SafetensorError, ValueError, RuntimeError, OverflowError, MemoryError) as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(
                f"{path} is not a valid safetensors file (corrupt or truncated): {reason}"
            ) from e


def read_weights(
    fmt: str, files: list[Path], root: Path, trust: bool
) -> tuple[dict, dict | None, dict | None]:
    """Raw (un-normalised) weights, a config dict found inside a pickle, and a SpecForge resume
    contract's fields (None unless the file is a SpecForge training_state.pt)."""
    weight_files = [f for f in files if f.suffix != ".json"]
    if fmt not in (FORMAT_PICKLE, FORMAT_SPECFORGE):
        raw: dict[str, torch.Tensor] = {}
        for f in weight_files:
            shard = _load_safetensors(f)
            if clash := raw.keys() & shard.keys():
                raise CheckpointError(f"{root}: keys appear in more than one shard: {few(clash)}")
            raw.update(shard)
        return raw, None, None
    obj = _torch_load(weight_files[0], trust)
    recorded = specforge.contract_fields(obj) if specforge.is_training_state(obj) else None
    trail = _find_weights(obj)
    if trail is None:
        top = list(obj)[:10] if isinstance(obj, Mapping) else type(obj).__name__
        raise CheckpointError(
            f"{root}: no weights dict found (top level: {top}); expected the drafter "
            f"state_dict at top level or under {'/'.join(_NESTING_KEYS)}"
        )
    weights = trail[-1]
    weights = weights.state_dict() if isinstance(weights, torch.nn.Module) else weights
    return dict(weights), _find_config(trail[:-1]), recorded


def read_training_state_contract(directory: Path, trust: bool) -> tuple[dict | None, str | None]:
    """The SpecForge resume contract of ``directory/training_state.pt`` beside an exported HF
    directory (SpecForge's legacy ``epoch_E_step_S/``): what the run trained with, e.g. the mask
    id its shipped config leaves null. Returns (fields or None, a note when the file was skipped)."""
    path = directory / specforge.STATE_FILE
    if not path.is_file():
        return None, None
    try:
        obj = _torch_load(path, trust)
    except UntrustedCheckpointError:
        return None, (
            f"{path.name} beside the weights was not read (it needs full unpickling); pass "
            "--trust-checkpoint to read the mask id and block size it records"
        )
    except CheckpointError as e:
        return None, f"{path.name} beside the weights was not read: {e}"
    if not isinstance(obj, Mapping):
        return None, None
    return specforge.contract_fields(obj) or None, None


def _torch_load(path: Path, trust: bool) -> Any:
    # mmap keeps optimizer state (often most of a training file) out of RAM; needs the zip format.
    mmap = zipfile.is_zipfile(path)
    with open(path, "rb") as f:
        first = f.read(2)
    if not mmap and not first.startswith(b"\x80"):  # torch.save writes a zip, or a pickle (PROTO)
        raise CheckpointError(
            f"{path} is not a checkpoint: neither a torch zip archive nor a pickle as torch.save writes them; expected {_ACCEPTED}"
        )
    try:
        return torch.load(path, map_location="cpu", weights_only=not trust, mmap=mmap)
    except pickle.UnpicklingError as e:
        if trust or not re.search(r"weights.only", str(e), re.IGNORECASE):  # corrupt, not refused
            raise CheckpointError(f"{path} is not a checkpoint: torch.load cannot read it ({e})") from e
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if not found and re.search(r"Unsupported operand", str(e)):  # bytes no pickler writes
            raise CheckpointError(
                f"{path} is not a checkpoint: its bytes are not a valid pickle; expected {_ACCEPTED}"
            ) from e
        what = f" (it references {found.group(1)})" if found else ""
        raise UntrustedCheckpointError(
            f"{path} cannot be loaded with weights_only=True{what}: it needs full unpickling, which runs "
            "arbitrary code from the file. Pass --trust-checkpoint only if you "
            "trust its source."
        ) from e
    except MemoryError:
        raise
    except Exception as e:  # corrupt or not a torch file: unpicklers raise many types (IndexError...)
        raise CheckpointError(
            f"{path} is not a checkpoint: torch.load cannot read it ({type(e).__name__}: {e})"
        ) from e


def _is_weights(obj: Any) -> bool:
    if isinstance(obj, torch.nn.Module):
        return True
    return (
        isinstance(obj, Mapping)
        and len(obj) > 0
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())
    )


def _find_weights(obj: Any) -> list[Any] | None:
    """Containers from `obj` down to the weights dict (last element), via the nesting keys."""
    if _is_weights(obj):
        return [obj]
    if isinstance(obj, Mapping):
        for key in _NESTING_KEYS:
            if key in obj and (below := _find_weights(obj[key])) is not None:
                return [obj, *below]
    return None


def _find_config(containers: list[Any]) -> dict | None:
    """A trainer config saved beside the weights (`config`/`args`/`model_config`), if any."""
    for container in containers:
        for key in _CONFIG_KEYS:
            cfg = container.get(key)
            cfg = vars(cfg) if hasattr(cfg, "__dict__") and not isinstance(cfg, Mapping) else cfg
            if isinstance(cfg, Mapping) and cfg.keys() & _CONFIG_HINTS:
                return dict(cfg)
    return None


def few(keys: Any, limit: int = 5, noun: str = "key") -> str:
    """'2 keys: a, b' -- the first few offending names and the count, for one-line errors."""
    keys = list(keys)
    shown = ", ".join(keys[:limit])
    return f"{len(keys)} {noun}{'s' if len(keys) != 1 else ''}: {shown}" + (
        f", ... (+{len(keys) - limit} more)" if len(keys) > limit else ""
    )
