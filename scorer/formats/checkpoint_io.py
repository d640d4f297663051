"""Checkpoint file I/O every family shares: what a load read (`LoadReport`), the digests that name
a checkpoint in reports (per file, combined, of the final state dict), and the check of a state
dict against the module its config describes."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from hscache.store.fsio import file_sha256
from scorer.errors import CheckpointError
from scorer.formats.files import few

__all__ = ["LoadReport", "check_state_dict", "combine_file_digests", "file_digests", "state_dict_sha256"]


@dataclass(frozen=True)
class LoadReport:
    """What `load_checkpoint` read, inferred and changed.

    `field_sources` maps each DFlashConfig field to "config" (config.json, or a trainer config
    saved in the pickle), "config_file" (--config), "checkpoint" (SpecForge's resume contract
    in training_state.pt), "shapes", "override",
    "derived" (target_layer_ids from num_target_layers), "cache" or "default". `warnings` are
    shown in the terminal, the JSON and the HTML report. `sha256` is the file's digest, or for
    several files the sha256 of their sorted "name digest" lines; `weights_sha256` hashes the
    final state_dict (names, dtypes, shapes, bytes), so it is the same across formats.
    `stripped_prefixes` also lists vLLM renames as "old -> new"; `dropped_keys` are original names.
    """

    path: str
    format: str
    file_sha256: dict[str, str]
    sha256: str
    weights_sha256: str
    field_sources: dict[str, str]
    stripped_prefixes: tuple[str, ...]
    dropped_keys: tuple[str, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    layout: str = "zlab"
    warnings: tuple[str, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (tuples become lists)."""
        return json.loads(json.dumps(asdict(self)))

    @classmethod
    def of_files(
        cls, root: Path, fmt: str, files: list[Path], state_dict: dict[str, torch.Tensor], **read: Any
    ) -> LoadReport:
        """The report of a checkpoint read from ``files`` under ``root``: their digests (each, and
        combined), the final ``state_dict``'s digest, and what the reader says (``read``: field
        sources, stripped prefixes, dropped keys, notes, layout, warnings)."""
        file_sha = file_digests(root, files)
        return cls(
            path=str(root),
            format=fmt,
            file_sha256=file_sha,
            sha256=combine_file_digests(file_sha),
            weights_sha256=state_dict_sha256(state_dict),
            **read,
        )


def file_digests(root: Path, files: list[Path]) -> dict[str, str]:
    """sha256 of each weight/config file, named relative to the checkpoint directory (a file: its name)."""
    return {
        str(f.relative_to(root) if root.is_dir() and f.is_relative_to(root) else f.name): file_sha256(f)
        for f in files
    }


def combine_file_digests(file_sha: dict[str, str]) -> str:
    if len(file_sha) == 1:
        return next(iter(file_sha.values()))
    lines = "".join(f"{name} {digest}\n" for name, digest in sorted(file_sha.items()))
    return hashlib.sha256(lines.encode()).hexdigest()


def state_dict_sha256(sd: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(sd):
        t = sd[key].detach().contiguous().cpu()
        h.update(f"{key} {t.dtype} {list(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def check_state_dict(
    sd: dict[str, torch.Tensor], build: Callable[[], torch.nn.Module], what: str, floats: bool = False
) -> None:
    """Exactly the keys and shapes of the module ``build`` makes (on the meta device: nothing is
    allocated), else one CheckpointError "``what`` matching its config: missing ...; unexpected ...".
    ``floats``: an integer tensor is refused too (a drafter's weights are all floating point)."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in build().state_dict().items()}
    missing = sorted(expected.keys() - sd.keys())
    unexpected = sorted(sd.keys() - expected.keys())
    wrong = [
        f"{k} {list(sd[k].shape)} (expected {list(expected[k])})"
        for k in sorted(expected.keys() & sd.keys())
        if tuple(sd[k].shape) != expected[k]
    ]
    if floats:
        wrong += [f"{k} dtype {v.dtype}" for k, v in sorted(sd.items()) if not v.is_floating_point()]
    label = "wrong shape/dtype" if floats else "wrong shape"
    problems = [
        f"{name} {few(keys)}"
        for name, keys in (("missing", missing), ("unexpected", unexpected), (label, wrong))
        if keys
    ]
    if problems:
        raise CheckpointError(f"{what} matching its config: {'; '.join(problems)}")
