"""The drift study: one target, several (backend, dtype, device) settings, one report.

Named steps: build the reference cache -> build every other cache on the reference's exact token
ids -> diff each against the reference -> get checkpoints (given, or a tiny one trained on the
reference) -> score each checkpoint on every cache -> write ``drift_study.json`` and
``drift_study.html`` (pipelines/drift_report.py).

Why the other caches replay the reference's tokens instead of generating their own: a bf16 or
fla run can pick a different greedy token, after which the two texts differ and nothing is
comparable position by position (``diff --intersect`` would drop the whole sequence, and the
drafter's rounds would sit at different anchors). Replaying the reference text isolates the
numerical drift of the cached features and target predictions, which is what the study measures.
The price: where a setting's own argmax leaves the reference text, its replay is off its greedy
path, so its tau is a lower bound there; each eval report counts those rounds (``off_greedy``).

    >>> settings = parse_settings("torch:fp32,torch:bf16")
    >>> document = run_drift_study(DriftStudyConfig(out="study/", settings=settings))  # doctest: +SKIP
    >>> document["scores"][0]["comparisons"][0]["delta"]["pooled"]                     # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass, replace
from itertools import pairwise
from pathlib import Path
from typing import Any

import click

import hscache
from hscache.capture import BACKENDS
from hscache.cli_options import (
    decode_length_options,
    layers_option,
    model_option,
    prompt_limit_option,
    prompts_option,
)
from hscache.diff.compare import DEFAULT_POSITION_BUCKETS, diff_caches
from hscache.diff.report import DiffReport, save_json
from hscache.store.dtypes import DTYPES
from hscache.store.fsio import atomic_write_bytes, atomic_write_json
from scorer.cli.shared import (
    ddtree_option,
    drafter_dtype_option,
    int_list,
    seed_option,
    train_steps_option,
    written_block_size_option,
)
from scorer.studies.evaluate import EvalConfig, evaluate_many

__all__ = ["DriftStudyConfig", "DriftStudyError", "Setting", "parse_settings", "run_drift_study"]

# Defaults come from the stages' own configs: the study extracts and scores like `hscache extract`
# and `scorer eval` do unless told otherwise.
_EXTRACT = hscache.ExtractConfig(out="")
_EVAL = EvalConfig()


class DriftStudyError(ValueError):
    """The study's configuration is invalid; the message names the value and the fix."""


@dataclass(frozen=True)
class Setting:
    """One way of running the target: linear-attention backend, dtype, device."""

    backend: str
    dtype: str
    device: str = "cpu"

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise DriftStudyError(
                f"backend {self.backend!r} in setting {self.spec}; choose one of {', '.join(BACKENDS)}"
            )
        if self.dtype not in DTYPES:
            raise DriftStudyError(
                f"dtype {self.dtype!r} in setting {self.spec}; choose one of {', '.join(DTYPES)}"
            )

    @property
    def spec(self) -> str:
        """The text form, ``backend:dtype[:device]``."""
        return f"{self.backend}:{self.dtype}" + (f":{self.device}" if self.device != "cpu" else "")

    @property
    def name(self) -> str:
        """The cache directory name under OUT/caches, e.g. ``torch-bf16`` or ``fla-bf16-cuda``."""
        device = "" if self.device == "cpu" else "-" + self.device.replace(":", "")
        return f"{self.backend}-{self.dtype}{device}"


def parse_settings(text: str) -> tuple[Setting, ...]:
    """``"torch:fp32,torch:bf16,fla:bf16:cuda"`` -> settings, in order.

    Raises:
        DriftStudyError: an item is not ``backend:dtype[:device]``, or names a bad backend or dtype.
    """
    settings = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        parts = item.split(":", 2)
        if len(parts) < 2:
            raise DriftStudyError(
                f"setting {item!r} is not backend:dtype[:device]; e.g. torch:fp32 or fla:bf16:cuda"
            )
        settings.append(Setting(*parts))
    return tuple(settings)


@dataclass(frozen=True)
class DriftStudyConfig:
    """Everything ``hscache-drift`` takes; its flags mirror these names.

    ``checkpoints`` empty: a drafter is trained on the reference cache for ``train_steps`` steps
    (block size ``block_size``) so the study always shows a tau. ``eval_*``, ``ddtree``, ``n_boot``
    and ``seed`` configure scoring (``scorer.studies.evaluate.EvalConfig``).
    """

    out: str
    settings: tuple[Setting, ...]
    reference: int = 0
    model: str = _EXTRACT.model
    prompts: str = _EXTRACT.prompts
    layers: str = _EXTRACT.layers
    max_new_tokens: int = _EXTRACT.max_new_tokens
    max_length: int = _EXTRACT.max_length
    limit: int | None = _EXTRACT.limit
    checkpoints: tuple[str, ...] = ()
    train_steps: int = 300
    block_size: int = 8
    eval_device: str = _EVAL.device
    eval_dtype: str = _EVAL.dtype
    ddtree: tuple[int, ...] = ()
    n_boot: int = _EVAL.n_boot
    seed: int = _EVAL.seed
    position_buckets: tuple[int, ...] = DEFAULT_POSITION_BUCKETS
    overwrite: bool = False

    def __post_init__(self) -> None:
        if len(self.settings) < 2:
            raise DriftStudyError(
                f"a drift study needs at least 2 settings, got {len(self.settings)}; "
                "e.g. --settings torch:fp32,torch:bf16"
            )
        names = [s.name for s in self.settings]
        if len(set(names)) != len(names):
            specs = ", ".join(s.spec for s in self.settings)
            raise DriftStudyError(f"settings repeat: {specs}; list each once")
        if not 0 <= self.reference < len(self.settings):
            n = len(self.settings)
            raise DriftStudyError(
                f"reference {self.reference} out of range for {n} settings; choose 0-{n - 1}"
            )
        if not self.checkpoints and self.train_steps < 1:
            raise DriftStudyError(
                "no checkpoint to score: pass --checkpoint PATH or --train-steps N (N >= 1)"
            )
        # Checked here, not left to diff_caches: there it would fail only after every cache was built.
        starts = list(self.position_buckets)
        if not starts or starts[0] != 0 or any(b <= a for a, b in pairwise(starts)):
            text = ",".join(map(str, starts))
            raise DriftStudyError(
                f"--position-buckets {text!r} must start at 0 and increase strictly; "
                f"e.g. {','.join(map(str, DEFAULT_POSITION_BUCKETS))}"
            )

    @property
    def reference_setting(self) -> Setting:
        return self.settings[self.reference]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["settings"] = [s.spec for s in self.settings]
        return json.loads(json.dumps(d))  # tuples -> lists


# ---------------------------------------------------------------- step 1: caches


def _extract(
    config: DriftStudyConfig, setting: Setting, prompts: str, max_new_tokens: int, limit: int | None
) -> Path:
    """Build, resume, or reuse (when complete) one cache; rebuild it only if its settings differ.

    ``config.overwrite`` is not passed on to extract, where it would delete and rebuild every cache
    on every run: a cache is rebuilt only when extract refuses to resume it (ResumeMismatchError),
    and only with ``--overwrite``; without it that error propagates, naming the difference.
    """
    from hscache.errors import ResumeMismatchError

    out = Path(config.out) / "caches" / setting.name
    extract_config = hscache.ExtractConfig(
        out=str(out),
        model=config.model,
        prompts=prompts,
        layers=config.layers,
        max_new_tokens=max_new_tokens,
        dtype=setting.dtype,
        backend=setting.backend,
        device=setting.device,
        max_length=config.max_length,
        limit=limit,
        overwrite=False,
    )
    try:
        hscache.extract(extract_config)
    except ResumeMismatchError:
        if not config.overwrite:
            raise
        hscache.extract(replace(extract_config, overwrite=True))
    return out


def _write_replay_prompts(reference: Path, path: Path) -> Path:
    """The reference cache's sequences as ``input_ids`` records, with where each prompt ended.

    Written byte-identically on every run, so the replay caches' prompts hash (a resume key)
    changes only when the reference's tokens do.
    """
    cache = hscache.open_cache(reference)
    index = cache.index
    lines = []
    for row, (rid, plen, meta) in enumerate(
        zip(
            index.column("record_id").to_pylist(),
            index.column("prompt_len").to_pylist(),
            index.column("metadata_json").to_pylist(),
        )
    ):
        record = {
            **(json.loads(meta) if meta else {}),
            "id": rid,
            "input_ids": cache.token_ids(row).tolist(),
            "prompt_len": int(plen),
        }
        lines.append(json.dumps(record, sort_keys=True))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path


def build_caches(config: DriftStudyConfig) -> dict[str, Path]:
    """Every setting's cache, reference first; the others hold the reference's exact token ids."""
    ref = config.reference_setting
    caches = {ref.name: _extract(config, ref, config.prompts, config.max_new_tokens, config.limit)}
    replay_path = Path(config.out) / "prompts" / f"replay-{ref.name}.jsonl"
    replay = _write_replay_prompts(caches[ref.name], replay_path)
    for setting in config.settings:
        if setting != ref:
            # max_new_tokens 0: the target only runs the teacher-forced forward over the given tokens.
            caches[setting.name] = _extract(config, setting, str(replay), 0, None)
    return caches


# ---------------------------------------------------------------- steps 2-4: diff, checkpoints, scores


def diff_all(config: DriftStudyConfig, caches: dict[str, Path]) -> dict[str, DiffReport]:
    """Each non-reference cache against the reference; each diff also saved as OUT/diffs/<name>.json."""
    ref = config.reference_setting.name
    reports = {}
    for name, path in caches.items():
        if name != ref:
            reports[name] = diff_caches(caches[ref], path, position_buckets=config.position_buckets)
            save_json(reports[name], Path(config.out) / "diffs" / f"{name}.json")
    return reports


def _token_fingerprint(cache_path: Path) -> str:
    hashes = hscache.open_cache(cache_path).index.column("token_sha256").to_pylist()
    return hashlib.sha256("\n".join(hashes).encode()).hexdigest()


def ensure_checkpoints(config: DriftStudyConfig, reference: Path) -> list[dict[str, Any]]:
    """The checkpoints to score: the given ones, or one trained here (reused while its recipe holds).

    Returns:
        ``[{"path", "label", "trained_here"}]``.
    """
    if config.checkpoints:
        labels = [Path(p.rstrip("/")).name for p in config.checkpoints]
        labels = labels if len(set(labels)) == len(labels) else [f"{i}-{n}" for i, n in enumerate(labels)]
        return [{"path": p, "label": n, "trained_here": False} for p, n in zip(config.checkpoints, labels)]
    from scorer import train_drafter

    out = Path(config.out) / "drafter"
    recipe = {
        "cache": str(reference),
        "tokens": _token_fingerprint(reference),
        "steps": config.train_steps,
        "block_size": config.block_size,
        "seed": config.seed,
    }
    marker = out / "drift_study_training.json"
    if not (marker.is_file() and json.loads(marker.read_text()) == recipe):
        train_drafter(
            reference,
            out,
            steps=config.train_steps,
            block_size=config.block_size,
            seed=config.seed,
            log_every=0,
            overwrite=True,  # the study owns OUT/drafter: another recipe replaces it whole
        )
        atomic_write_json(marker, recipe)
    return [{"path": str(out), "label": "drafter", "trained_here": True}]


def score_all(
    config: DriftStudyConfig, caches: dict[str, Path], checkpoints: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """``evaluate_many`` per checkpoint over every cache, reference first; saved under OUT/scores/."""
    eval_config = EvalConfig(
        device=config.eval_device,
        dtype=config.eval_dtype,
        ddtree=config.ddtree,
        n_boot=config.n_boot,
        seed=config.seed,
    )
    ref = config.reference_setting.name
    order = [ref] + [name for name in caches if name != ref]
    results = []
    for checkpoint in checkpoints:
        result = evaluate_many(checkpoint["path"], [caches[name] for name in order], eval_config)
        atomic_write_json(Path(config.out) / "scores" / f"{checkpoint['label']}.json", result)
        results.append(result)
    return results


# ---------------------------------------------------------------- the coordinator


def run_drift_study(config: DriftStudyConfig) -> dict[str, Any]:
    """Run every step and write OUT/drift_study.json (schemas/drift_study.schema.json) and .html.

    Re-running with the same config reuses the caches (extract resumes) and the trained drafter.

    Returns:
        The JSON document written to OUT/drift_study.json.

    Raises:
        DriftStudyError: invalid settings or position buckets (at construction of the config).
        hscache errors (ResumeMismatchError: OUT/caches/<name> holds a cache of other settings; pass
        overwrite=True / --overwrite to rebuild that cache), scorer errors (an incompatible
        checkpoint), one line each.
    """
    from pipelines.drift_report import build_document, write_html

    t0 = time.perf_counter()
    caches = build_caches(config)
    diffs = diff_all(config, caches)
    checkpoints = ensure_checkpoints(config, caches[config.reference_setting.name])
    scores = score_all(config, caches, checkpoints)
    document = build_document(config, caches, diffs, checkpoints, scores, seconds=time.perf_counter() - t0)
    out = Path(config.out)
    atomic_write_json(out / "drift_study.json", document)
    write_html(document, diffs, scores, out / "drift_study.html")
    return document


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--out", required=True, help="Study directory: caches/, diffs/, scores/, drift_study.json and .html."
)
@click.option(
    "--settings",
    "settings_text",
    default="torch:fp32,torch:bf16",
    show_default=True,
    help="Comma-separated backend:dtype[:device] settings, e.g. torch:fp32,fla:bf16:cuda.",
)
@click.option(
    "--reference",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Index in --settings of the reference (its greedy text is the one every cache holds).",
)
@model_option
@prompts_option
@layers_option
@decode_length_options
@prompt_limit_option
@click.option(
    "--checkpoint", "checkpoints", multiple=True, help="Drafter checkpoint to score; repeat for several."
)
@train_steps_option(300, "Without --checkpoint: train a tiny drafter on the reference cache for N steps.")
@written_block_size_option
@click.option(
    "--eval-device", default=_EVAL.device, show_default=True, help="Device scoring runs on (cpu, cuda)."
)
@drafter_dtype_option(flag="--eval-dtype")
@ddtree_option("")
@click.option(
    "--n-boot",
    type=click.IntRange(min=10),
    default=_EVAL.n_boot,
    show_default=True,
    help="Bootstrap resamples for the 95% intervals.",
)
@seed_option("Seed of the bootstrap and the training.")
@click.option(
    "--position-buckets",
    default=",".join(map(str, DEFAULT_POSITION_BUCKETS)),
    show_default=True,
    help="Token positions where the drift-by-position buckets start.",
)
@click.option("--overwrite", is_flag=True, help="Rebuild caches whose settings differ instead of refusing.")
def main(settings_text: str, checkpoints: tuple[str, ...], position_buckets: str, **options: Any) -> None:
    """Build caches of one target under several settings, diff them, score drafters, write one report.

    \b
    Example:
      hscache-drift --out study/ --settings torch:fp32,torch:bf16 --limit 8 --train-steps 200
    """
    from hscache.errors import HscacheError
    from scorer.errors import ScorerError

    try:
        config = DriftStudyConfig(
            settings=parse_settings(settings_text),
            checkpoints=checkpoints,
            position_buckets=int_list(position_buckets),
            **options,
        )
        document = run_drift_study(config)
    except (DriftStudyError, HscacheError, ScorerError) as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(2)
    from pipelines.drift_report import format_summary

    click.echo(format_summary(document))


if __name__ == "__main__":
    main()
