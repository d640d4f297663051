"""``target/``: the target's config, tokenizer files and embedding/output head, written and read.

The scorer never needs the model itself: ``head.safetensors`` holds ``embed_tokens`` (and
``lm_head`` when the two are not tied, with metadata ``tied``), ``config.json`` the target's text
config, and the tokenizer files are what ``save_pretrained`` writes. ``mtp.safetensors`` holds the
target's own MTP head (``mtp.*`` tensors, checkpoint names) when the target has one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hscache.store import fsio
from hscache.store.layout import TARGET_DIR

if TYPE_CHECKING:  # torch only for hints: `hscache info` reads target/config.json without it
    import torch

__all__ = [
    "HEAD_FILE",
    "MTP_FILE",
    "load_tokenizer",
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


def read_target_config(root: Path) -> dict[str, Any]:
    """The target's text config as written at extraction."""
    return json.loads((Path(root) / TARGET_DIR / "config.json").read_text())


def read_target_head(root: Path) -> dict[str, torch.Tensor]:
    """``{"embed_tokens": [V, H], "lm_head": [V, H]}``; one shared tensor when tied."""
    from safetensors.torch import load_file

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

    with safe_open(str(Path(root) / TARGET_DIR / HEAD_FILE), framework="pt") as f:
        return int(f.get_slice("embed_tokens").get_shape()[0])


def load_tokenizer(root: Path) -> Any:
    """The target's tokenizer from ``target/``."""
    from transformers import AutoTokenizer

    # The cache is data, never code: no remote code from tokenizer_config.json's auto_map.
    return AutoTokenizer.from_pretrained(
        str(Path(root) / TARGET_DIR), local_files_only=True, trust_remote_code=False
    )
