"""``scorer sweep``: score every checkpoint of a training run against one cache.

Named steps: find checkpoints and their training steps (``find_checkpoints``) -> hash each
checkpoint's content -> skip those whose report is already stored under the same key -> score
the rest (in this process, or all submitted at once to a dask cluster) -> write the table and
the plot (scorer/report/sweep.py).

Stored reports live in ``OUT/results/<key>.json``; the key hashes the checkpoint's content,
the cache's identity (its digest among it) and the eval settings, so a renamed checkpoint is still
skipped and a changed setting or any other cache (re-extracted, or resealed with other rows) is
scored again.

    >>> result = sweep("runs/exp1", "cache/", "runs/exp1/sweep")        # doctest: +SKIP
    >>> [(row["step"], row["tau_per_request"]) for row in result["rows"]]  # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hscache
from hscache.errors import HscacheError
from hscache.store import fsio
from hscache.store.view import CacheView
from scorer.documents import run_stamp
from scorer.errors import ScorerError
from scorer.report.sweep import report_row, write_outputs
from scorer.studies.evaluate import EvalConfig, evaluate

__all__ = [
    "SWEEP_SCHEMA_VERSION",
    "FoundCheckpoint",
    "cache_identity",
    "checkpoint_sha256",
    "find_checkpoints",
    "parse_step",
    "sweep",
]

SWEEP_SCHEMA_VERSION = 1
RESULTS_DIR = "results"
# step_020000, checkpoint-20000, checkpoint_step20k, global_step1000, iter_0001000, ckpt-5k ...
_STEP = re.compile(
    r"(?<![a-z])(?:global[_-]?)?(?:checkpoint|ckpt|step|steps|iter|iteration)[_-]?(?:step[_-]?)?"
    r"(\d+(?:\.\d+)?)([km]?)(?![a-z0-9])",
    re.IGNORECASE,
)
_WEIGHT_SUFFIXES = (".pt", ".pth", ".safetensors")
# Files a trainer saves next to the weights: never checkpoints of the drafter.
_AUX_STEMS = re.compile(r"^(optimizer|scheduler|scaler|rng_state.*|training_args|trainer_state)$")


def parse_step(name: str) -> int | None:
    """The training step a checkpoint's file or directory name encodes, or None.

    ``checkpoint-20000`` -> 20000, ``checkpoint_step20k.pt`` -> 20000, ``step_020000`` -> 20000,
    ``global_step1.5k`` -> 1500; ``epoch_3``, ``best.pt`` and ``final`` -> None (epochs are not steps).
    """
    stem = (
        name[: -len(ending)]
        if (ending := next((s for s in _WEIGHT_SUFFIXES if name.endswith(s)), ""))
        else name
    )
    matches = list(_STEP.finditer(stem))
    if not matches:
        return None
    number, unit = matches[-1].group(1), matches[-1].group(2).lower()
    value = float(number) * {"": 1, "k": 1_000, "m": 1_000_000}[unit]
    return round(value) if unit or "." not in number else None


@dataclass(frozen=True)
class FoundCheckpoint:
    step: int | None  # None: no step in its name (reported as skipped)
    path: Path


def _is_hf_dir(path: Path) -> bool:
    return (path / "config.json").is_file() and (
        any(path.glob("*.safetensors")) or (path / "pytorch_model.bin").is_file()
    )


def _candidates(run_dir: Path, exclude: Path | None) -> list[Path]:
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(run_dir):
        here = Path(dirpath)
        if exclude is not None and (here == exclude or exclude in here.parents):
            dirnames.clear()
            continue
        if _is_hf_dir(here) and here != run_dir:
            found.append(here)
            dirnames.clear()  # its files are parts of this checkpoint
            continue
        dirnames.sort()
        found += [
            here / f
            for f in sorted(filenames)
            if f.endswith(_WEIGHT_SUFFIXES) and not _AUX_STEMS.match(f.rsplit(".", 1)[0])
        ]
    return found


def find_checkpoints(run_dir: str | Path, exclude: str | Path | None = None) -> list[FoundCheckpoint]:
    """Every checkpoint under ``run_dir``: HF directories (config.json + weights) and .pt/.pth/
    .safetensors files, each with the step from its name or, failing that, its directory's.

    Returns:
        Sorted by step; checkpoints without a step come last with ``step=None``.

    Raises:
        ScorerError: ``run_dir`` does not exist, or two checkpoints claim one step.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ScorerError(f"run directory {run_dir} does not exist; pass the training output directory")
    found = []
    for path in _candidates(run_dir, Path(exclude) if exclude else None):
        step = parse_step(path.name)
        if step is None and path.is_file() and path.parent != run_dir:
            step = parse_step(path.parent.name)  # step_020000/model.pt
        found.append(FoundCheckpoint(step, path))
    by_step: dict[int, Path] = {}
    for ck in found:
        if ck.step is not None and ck.step in by_step:
            raise ScorerError(
                f"two checkpoints for step {ck.step}: {by_step[ck.step]} and {ck.path}; "
                "move one away or point sweep at a narrower directory"
            )
        if ck.step is not None:
            by_step[ck.step] = ck.path
    return sorted(found, key=lambda c: (c.step is None, c.step or 0, str(c.path)))


def checkpoint_sha256(path: str | Path) -> str:
    """sha256 of a checkpoint's content: the file, or a directory's sorted "name digest" lines."""
    path = Path(path)
    if path.is_file():
        return fsio.file_sha256(path)
    lines = [f"{p.relative_to(path)} {fsio.file_sha256(p)}" for p in sorted(path.rglob("*")) if p.is_file()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def cache_identity(cache: CacheView) -> str:
    """sha256 of what a cache holds for scoring: its digest (every array's chunk hashes, the index,
    the target files), settings, committed size and per-sequence token hashes. Without the digest a
    resealed cache of the same tokens reused another cache's stored tau (issue 52)."""
    document = {
        "digest": hscache.cache_digest(cache),
        "settings": cache.settings,
        "sequences": len(cache),
        "tokens": cache.num_tokens,
        "token_sha256": cache.index.column("token_sha256").to_pylist(),
    }
    return hashlib.sha256(json.dumps(document, sort_keys=True, default=str).encode()).hexdigest()


def _result_key(checkpoint_sha: str, cache_id: str, config: EvalConfig) -> str:
    inputs = {"checkpoint_sha256": checkpoint_sha, "cache_identity": cache_id, "eval": config.to_dict()}
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:32]


def _refused(ck: FoundCheckpoint, exc: Exception) -> dict[str, Any]:
    return {"path": str(ck.path), "step": ck.step, "reason": str(exc)}


def _score(
    todo: list[tuple[FoundCheckpoint, Path]],
    cache_path: str,
    config: EvalConfig,
    client: Any,
    tokens_per_task: int | None,
    on_done: Callable[[FoundCheckpoint, dict], None],
    on_refused: Callable[[FoundCheckpoint, Exception], None],
) -> None:
    """Score ``todo`` and hand each report to ``on_done`` as soon as it exists (so a killed sweep
    keeps what it finished), and each checkpoint that cannot be scored to ``on_refused`` with
    its error. On a cluster every checkpoint's tasks are submitted up front."""
    if client is None:
        for ck, _ in todo:
            try:
                report = evaluate(ck.path, cache_path, config)
            except (ScorerError, HscacheError) as exc:
                on_refused(ck, exc)
                continue
            on_done(ck, report)
        return
    from scorer.studies.distributed import DEFAULT_TASK_TOKENS, submit_scoring

    jobs = [
        (ck, submit_scoring(client, ck.path, cache_path, config, tokens_per_task or DEFAULT_TASK_TOKENS))
        for ck, _ in todo
    ]
    for ck, job in jobs:
        try:
            report = job.collect()
        except (ScorerError, HscacheError) as exc:
            on_refused(ck, exc)
            continue
        on_done(ck, report)


def sweep(
    run_dir: str | Path,
    cache_path: str | Path,
    out: str | Path,
    config: EvalConfig = EvalConfig(),
    *,
    client: Any = None,
    tokens_per_task: int | None = None,
    on_checkpoint: Callable[[FoundCheckpoint, bool], None] | None = None,
    keep_going: bool = False,
) -> dict[str, Any]:
    """Score every checkpoint under ``run_dir`` on ``cache_path``; write sweep.json/.csv/.html to ``out``.

    Args:
        client: a ``distributed.Client`` to score on a cluster (None: this process).
        on_checkpoint: called with (checkpoint, reused) as each row becomes available.
        keep_going: a checkpoint that cannot be scored (unloadable, another target, layers the
            cache lacks) is listed under ``refused`` with its reason and the others are scored;
            without it the sweep stops at the first, naming it (the reports already written stay).

    Returns:
        The sweep document (what sweep.json holds), with ``outputs`` naming the files written.

    Raises:
        ScorerError: no run directory, no checkpoint with a step, or two checkpoints for one step;
            without ``keep_going``, a checkpoint that cannot be scored (the message names it).
    """
    t0 = time.perf_counter()
    out = Path(out)
    found = find_checkpoints(run_dir, exclude=out)
    stepped = [ck for ck in found if ck.step is not None]
    if not stepped:
        raise ScorerError(
            f"no checkpoint with a step in its name under {run_dir} (found {len(found)} without one); "
            "name them like checkpoint-20000, step_020000/ or checkpoint_step20k.pt"
        )
    cache = hscache.open_cache(cache_path)
    cache_id = cache_identity(cache)
    results = out / RESULTS_DIR
    keyed = [
        (ck, results / f"{_result_key(checkpoint_sha256(ck.path), cache_id, config)}.json") for ck in stepped
    ]
    reports: dict[Path, tuple[dict, bool]] = {}
    for ck, path in keyed:
        if path.is_file():
            reports[ck.path] = (json.loads(path.read_text())["report"], True)
            if on_checkpoint:
                on_checkpoint(ck, True)

    result_files = {ck.path: path for ck, path in keyed}

    def done(ck: FoundCheckpoint, report: dict) -> None:
        path = result_files[ck.path]
        fsio.atomic_write_json(path, {"step": ck.step, "checkpoint": str(ck.path), "report": report})
        reports[ck.path] = (report, False)
        if on_checkpoint:
            on_checkpoint(ck, False)

    refused: list[dict[str, Any]] = []

    def cannot(ck: FoundCheckpoint, exc: Exception) -> None:
        if not keep_going:
            raise ScorerError(
                f"checkpoint {ck.path} (step {ck.step}) cannot be scored: {exc}; pass --keep-going to "
                "score the other checkpoints and list the refused ones"
            ) from exc
        refused.append(_refused(ck, exc))

    _score(
        [(ck, p) for ck, p in keyed if ck.path not in reports],
        str(cache_path),
        config,
        client,
        tokens_per_task,
        done,
        cannot,
    )
    if not reports:
        raise ScorerError(
            f"none of the {len(keyed)} checkpoints under {run_dir} could be scored; the first: "
            f"{refused[0]['path']}: {refused[0]['reason']}"
        )
    document = {
        "schema_version": SWEEP_SCHEMA_VERSION,
        "run_dir": str(run_dir),
        "cache": {"path": str(cache_path), "identity": cache_id, "sequences": len(cache)},
        "config": config.to_dict(),
        "rows": [
            report_row(ck.step, ck.path, path, *reports[ck.path]) for ck, path in keyed if ck.path in reports
        ],
        "refused": refused,
        "skipped": [
            {"path": str(ck.path), "reason": "no training step in its name"}
            for ck in found
            if ck.step is None
        ],
        **run_stamp(time.perf_counter() - t0),
    }
    document["outputs"] = write_outputs(document, out)
    return document
