"""The checkpoints a training run writes into its folder: where they are, their step, when complete.

Layouts (read from the trainers' own code):

- transformers' Trainer and the z-lab / HF drafter trainers built on it: ``checkpoint-S/`` with
  ``trainer_state.json`` (``global_step``) beside the weights (transformers/trainer.py,
  ``TRAINER_STATE_NAME``); ``save_total_limit`` deletes the oldest (trainer_utils.py
  ``rotate_checkpoints``).
- speculators 0.9: ``<save_path>/<epoch>/`` (``model.safetensors`` + ``config.json`` from
  ``save_pretrained``), ``training_state.json`` with ``global_step`` written after the weights; a
  mid-epoch save rewrites the same ``<epoch>/`` folder (speculators/train/trainer.py
  ``maybe_save_checkpoint``, checkpointer.py ``BaseCheckpointer``). Its ``epochE_stepS`` and
  ``checkpoint_best`` entries are symlinks to those folders and are never followed.
- NeMo Automodel 0.7: ``epoch_E_step_S/`` with the HF weights in ``model/consolidated/``, and a
  ``.incomplete`` marker in ``epoch_E_step_S/`` while it is written
  (nemo_automodel/recipes/base_recipe.py ``save_checkpoint``, components/checkpoint/utils.py
  ``mark_checkpoint_incomplete``).
- SpecForge: ``epoch_E_step_S/`` HF directories, or ``{run}-stepN/training_state.pt``.
- ``scorer init``: an HF directory (its step, when it has one, from its name).

The step comes from the training state file when there is one (exact), else from the folder's name
or the name of the folder that holds it; the record says which (``step_source``).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from hscache.store import fsio
from scorer.errors import ScorerError
from scorer.formats.files import check_headers, resolve_files
from scorer.studies.sweep import parse_step

__all__ = [
    "Checkpoint",
    "checkpoint_digest",
    "find_checkpoints",
    "incomplete_reason",
    "signature",
]

# Folders a watch never looks into: hidden ones, transformers' staging folders, the loggers' output.
_SKIP_DIR = re.compile(r"^(\.|tmp-|tmp_)")
_STATE_FILES = (
    ("trainer_state.json", "transformers"),  # transformers' Trainer
    ("training_state.json", "speculators"),  # speculators 0.9's Trainer
)
_NEMO_INCOMPLETE = ".incomplete"
_SPECFORGE_STATE = "training_state.pt"
_EPOCH_STEP = re.compile(r"^epoch_\d+_step_\d+$")


@dataclass(frozen=True)
class Checkpoint:
    """One checkpoint in a run folder.

    Attributes:
        path: what the loader reads (an HF directory, or SpecForge's folder of training_state.pt).
        top: the folder the trainer writes and deletes as one unit (``checkpoint-S/``,
            ``epoch_E_step_S/``, speculators' ``<epoch>/``): its files decide when it is complete.
        step: the training step, None when neither a state file nor a name gives one.
        step_source: where the step came from, e.g. "trainer_state.json global_step".
        layout: "transformers", "speculators", "nemo-automodel", "specforge" or "hf-dir".
    """

    path: Path
    top: Path
    step: int | None
    step_source: str
    layout: str


def _is_checkpoint_dir(path: Path, files: list[str]) -> bool:
    names = set(files)
    if _SPECFORGE_STATE in names:
        return True
    weights = "model.safetensors.index.json" in names or "pytorch_model.bin" in names
    weights = weights or any(n.endswith(".safetensors") for n in names)
    return "config.json" in names and weights


def _state_step(path: Path) -> tuple[int, str, str] | None:
    """(step, source, layout) from a trainer's state file in ``path``, if one is there and parses."""
    for name, layout in _STATE_FILES:
        state = path / name
        if not state.is_file():
            continue
        try:
            step = json.loads(state.read_text()).get("global_step")
        except (OSError, ValueError, AttributeError):
            return None  # being written: the next poll reads it
        if isinstance(step, int) and not isinstance(step, bool):
            return step, f"{name} global_step", layout
    return None


def _describe(run_dir: Path, path: Path) -> Checkpoint:
    """The checkpoint at ``path``: its step and where it came from, its layout and top folder."""
    layout = "hf-dir"
    if path.name == "consolidated" and path.parent.name == "model":
        layout = "nemo-automodel"
    elif _EPOCH_STEP.match(path.name) or (path / _SPECFORGE_STATE).is_file():
        layout = "specforge"
    found = _state_step(path)
    if found is not None:
        step, source, layout = found
        return Checkpoint(path, path, step, source, layout)
    # the nearest folder (itself, then its parents inside the run) whose name holds a step
    for folder in (path, *path.parents):
        if folder == run_dir or run_dir not in folder.parents:
            break
        step = parse_step(folder.name)
        if step is not None:
            return Checkpoint(path, folder, step, f"folder name {folder.name}", layout)
    return Checkpoint(path, path, None, "none", layout)


def find_checkpoints(run_dir: str | Path, exclude: str | Path | None = None) -> list[Checkpoint]:
    """Every checkpoint folder under ``run_dir`` (symlinks not followed, hidden and ``tmp-``
    staging folders and ``exclude`` skipped), in path order.

    Raises:
        ScorerError: ``run_dir`` is not a directory.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ScorerError(
            f"run folder {run_dir} does not exist; pass the folder the trainer writes checkpoints to"
        )
    skip = Path(exclude).resolve() if exclude is not None else None
    found = []
    for dirpath, dirnames, filenames in os.walk(run_dir):  # followlinks=False: symlinks never entered
        here = Path(dirpath)
        dirnames[:] = sorted(
            d for d in dirnames if not _SKIP_DIR.match(d) and (skip is None or (here / d).resolve() != skip)
        )
        if here != run_dir and _is_checkpoint_dir(here, filenames):
            found.append(_describe(run_dir, here))
            dirnames.clear()  # its sub-folders are parts of it
    return found


def signature(checkpoint: Checkpoint) -> tuple[tuple[str, int, int], ...]:
    """(relative path, size, mtime ns) of every file under the checkpoint's top folder: two polls
    that read the same signature saw no write in between. Missing files read as absent."""
    entries = []
    for dirpath, _, filenames in os.walk(checkpoint.top):
        for name in filenames:
            path = Path(dirpath) / name
            try:
                st = path.lstat()
            except FileNotFoundError:
                continue
            entries.append((str(path.relative_to(checkpoint.top)), st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def incomplete_reason(checkpoint: Checkpoint) -> str | None:
    """Why the checkpoint cannot be read whole yet (None: it can): NeMo's in-progress marker, a
    config that does not parse, a weights file missing or whose safetensors header does not cover
    its size (a file still being written)."""
    if (checkpoint.top / _NEMO_INCOMPLETE).exists():
        return f"{_NEMO_INCOMPLETE} marker present"
    try:
        check_headers(checkpoint.path)
    except (ScorerError, OSError) as exc:
        return str(exc).splitlines()[0]
    return None


def checkpoint_digest(checkpoint: Checkpoint) -> str:
    """sha256 of the files the loader reads (config and weights, not the optimizer's state): the
    same weights saved again hash the same; a folder rewritten in place (speculators' mid-epoch
    saves) hashes anew. Sorted "name sha256" lines, hashed."""
    files = resolve_files(checkpoint.path)[1]
    lines = [f"{p.relative_to(checkpoint.path)} {fsio.file_sha256(p)}" for p in sorted(files)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()
