"""``scorer watch``: follow a training run's folder and score every new checkpoint on a cache.

Named steps, every poll: find the checkpoints (checkpoints.py) -> wait for each to be complete and
unchanged across two polls -> skip what the log already holds (path + content digest) -> score it with
``scorer.studies.evaluate.evaluate`` (the values of ``scorer eval``) -> append its record to the log
(results.py), then to the sinks (sinks.py) and the page (scorer/report/watch.py).

    >>> summary = watch("runs/exp1", "eval-cache/", WatchConfig(until_idle_s=600))   # doctest: +SKIP
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hscache
from hscache.errors import HscacheError
from hscache.store import fsio
from hscache.store.integrity import cache_digest
from scorer.errors import ScorerError
from scorer.report.watch import render_watch_html
from scorer.studies.evaluate import EvalConfig, evaluate
from scorer.watch.checkpoints import (
    Checkpoint,
    checkpoint_digest,
    find_checkpoints,
    incomplete_reason,
    signature,
)
from scorer.watch.record import refused_record, scored_record
from scorer.watch.results import ResultsLog
from scorer.watch.sinks import Sinks, check_sinks

__all__ = ["HTML_NAME", "WatchConfig", "WatchSummary", "default_results", "publish", "watch"]

HTML_NAME = "watch.html"


@dataclass(frozen=True)
class WatchConfig:
    """The settings of ``scorer watch`` (flags mirror the names).

    Attributes:
        results: the results folder (None: ``default_results(run_dir)``).
        every: score a checkpoint only when its step is at least N past the last one scored (1: all).
        log_to: sinks besides the log (sinks.SINKS); () for the log and the page only.
        poll_s: seconds between two looks at the run folder (a checkpoint is scored once two looks
            in a row saw the same files).
        until_idle_s: stop when nothing in the run folder changed for this long (None: run until
            stopped).
        eval: the scoring settings, as ``scorer eval`` takes them.
    """

    results: str | Path | None = None
    every: int = 1
    log_to: tuple[str, ...] = ("tensorboard",)
    poll_s: float = 10.0
    until_idle_s: float | None = None
    eval: EvalConfig = field(default_factory=lambda: EvalConfig(ddtree=(8,)))


@dataclass
class WatchSummary:
    """What one watch did: records written (scored / refused), checkpoints skipped, why it stopped."""

    results: Path
    scored: list[int | None] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    stopped_by: str = ""


def default_results(run_dir: str | Path) -> Path:
    """``<run>-watch/`` beside the run folder: outside it (a trainer's rotation or cleanup never
    touches it), one per run (two runs under one parent get two folders)."""
    run_dir = Path(run_dir).resolve()
    return run_dir.parent / f"{run_dir.name}-watch"


def _check_same_inputs(
    records: list[dict[str, Any]], cache: dict[str, Any], eval_dict: dict, folder: Path
) -> None:
    for r in records:
        if r["cache"]["digest"] != cache["digest"] or r["eval"] != eval_dict:
            what = "another cache" if r["cache"]["digest"] != cache["digest"] else "other eval settings"
            raise ScorerError(
                f"{folder} holds scores on {what} ({r['cache']['path']}, step {r['step']}); pass --results "
                "another folder to score this run on this cache with these settings"
            )


class _Watcher:
    """The state of one watch between polls."""

    def __init__(
        self, run_dir: Path, cache_path: str, config: WatchConfig, log: ResultsLog, sinks: Sinks, say
    ):
        self.run_dir, self.cache_path, self.config = run_dir, cache_path, config
        self.log, self.sinks, self.say = log, sinks, say
        cache = hscache.open_cache(cache_path, allow_unsealed=config.eval.allow_unsealed)
        self.cache = {"path": str(cache_path), "digest": cache_digest(cache)}
        self.eval_dict = config.eval.to_dict()
        records = log.records()
        _check_same_inputs(records, self.cache, self.eval_dict, log.folder)
        self.done = {(r["checkpoint"], r["checkpoint_sha256"]) for r in records}
        steps = [r["step"] for r in records if r["status"] == "scored" and r["step"] is not None]
        self.last_step: int | None = max(steps, default=None)
        self.seen: dict[Path, tuple] = {}  # signature at the previous poll
        self.decided: dict[Path, tuple] = {}  # signature already handled (scored, skipped, in the log)
        self.said: set[tuple[Path, str]] = set()
        self.last_change = time.monotonic()

    def note_once(self, ck: Checkpoint, text: str) -> None:
        if (ck.path, text) not in self.said:
            self.said.add((ck.path, text))
            self.say(f"{ck.path}: {text}")

    def poll(self, summary: WatchSummary, stop: threading.Event) -> None:
        found = find_checkpoints(self.run_dir, exclude=self.log.folder)
        for ck in sorted(found, key=lambda c: (c.step is None, c.step or 0, str(c.path))):
            if stop.is_set():
                return
            self.consider(ck, summary)

    def consider(self, ck: Checkpoint, summary: WatchSummary) -> None:
        sig = signature(ck)
        if self.seen.get(ck.path) != sig:  # new or still being written: look again next poll
            self.seen[ck.path] = sig
            self.last_change = time.monotonic()
            return
        if self.decided.get(ck.path) == sig:
            return
        if ck.step is None:
            self.note_once(ck, "no training step in its name or a state file; not scored")
            return
        reason = incomplete_reason(ck)
        if reason is not None:
            self.note_once(ck, f"waiting for it to be complete ({reason})")
            return
        try:
            digest = checkpoint_digest(ck)
        except (OSError, ScorerError):
            return  # deleted or rewritten meanwhile: the next poll sees it anew
        self.decided[ck.path] = sig
        if (str(ck.path), digest) in self.done:
            return
        if (
            self.config.every > 1
            and self.last_step is not None
            and ck.step < self.last_step + self.config.every
        ):
            self.note_once(
                ck, f"step {ck.step}: fewer than --every {self.config.every} steps after {self.last_step}"
            )
            summary.skipped.append(str(ck.path))
            return
        self.score(ck, sig, digest, summary)

    def score(self, ck: Checkpoint, sig: tuple, digest: str, summary: WatchSummary) -> None:
        described = {
            "path": str(ck.path),
            "sha256": digest,
            "step": ck.step,
            "step_source": ck.step_source,
            "layout": ck.layout,
        }
        t0 = time.perf_counter()
        try:
            report = evaluate(ck.path, self.cache_path, self.config.eval)
        except (ScorerError, HscacheError, OSError, ValueError, RuntimeError) as exc:
            if not ck.path.exists() or signature(ck) != sig:
                self.say(f"{ck.path}: deleted or rewritten while it was scored (step {ck.step}); skipped")
                summary.skipped.append(str(ck.path))
                return
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            record = refused_record(described, self.cache, self.eval_dict, line, time.perf_counter() - t0)
            self.log.append(record)
            self.done.add((str(ck.path), digest))
            summary.refused.append(str(ck.path))
            self.say(f"{ck.path}: cannot be scored: {line}")
            return
        if not ck.path.exists() or signature(ck) != sig:
            self.say(f"{ck.path}: deleted or rewritten while it was scored (step {ck.step}); skipped")
            summary.skipped.append(str(ck.path))
            return
        record = scored_record(described, self.cache, self.eval_dict, report)
        publish(record, self.log, self.sinks, f"scorer watch: {self.run_dir}")
        self.done.add((str(ck.path), digest))
        self.last_step = ck.step if self.last_step is None else max(self.last_step, ck.step)
        self.last_change = time.monotonic()
        summary.scored.append(ck.step)
        tau = record["metrics"]["tau"]
        self.say(
            f"step {ck.step}: tau {_num(tau['per_request'])} per request, {_num(tau['pooled'])} pooled ({ck.path.name})"
        )


def publish(record: dict[str, Any], log: ResultsLog, sinks: Sinks | None, title: str) -> None:
    """A record into the log (first: it is what a restart trusts), then the sinks and the page."""
    log.append(record)
    if sinks is not None:
        sinks.log(record)
    page = render_watch_html(log.records(), title=title)
    fsio.atomic_write_bytes(log.folder / HTML_NAME, page.encode())


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def watch(
    run_dir: str | Path,
    cache_path: str | Path,
    config: WatchConfig = WatchConfig(),
    *,
    stop: threading.Event | None = None,
    say: Callable[[str], None] = lambda line: None,
) -> WatchSummary:
    """Follow ``run_dir`` and score each new complete checkpoint on ``cache_path`` once; return when
    ``stop`` is set (after the checkpoint being scored), or when the run folder was idle for
    ``config.until_idle_s``.

    Args:
        stop: set it (e.g. from a SIGINT handler) to end the watch cleanly.
        say: receives one line per event (a checkpoint scored, refused, skipped, waited for).

    Raises:
        ScorerError: a bad run folder or setting, a sink not installed, another live watch on the
            results folder, or a results folder holding scores of another cache or settings.
    """
    if (
        config.every < 1
        or config.poll_s <= 0
        or (config.until_idle_s is not None and config.until_idle_s < 0)
    ):
        raise ScorerError(
            f"--every {config.every}, --poll-s {config.poll_s}, --until-idle-s {config.until_idle_s}: "
            "pass --every >= 1, --poll-s > 0 and --until-idle-s >= 0"
        )
    check_sinks(config.log_to)
    run_dir = Path(run_dir)
    find_checkpoints(run_dir)  # refuses a missing run folder before anything is made
    folder = Path(config.results) if config.results is not None else default_results(run_dir)
    stop = stop or threading.Event()
    summary = WatchSummary(results=folder)
    with ResultsLog(folder) as log:
        sinks = Sinks(config.log_to, folder, run_dir.resolve().name)
        try:
            watcher = _Watcher(run_dir, str(cache_path), config, log, sinks, say)
            while True:
                watcher.poll(summary, stop)
                idle = time.monotonic() - watcher.last_change
                if stop.is_set():
                    summary.stopped_by = "stop"
                    break
                if config.until_idle_s is not None and idle >= config.until_idle_s:
                    summary.stopped_by = f"idle {config.until_idle_s:g} s"
                    break
                stop.wait(config.poll_s)
        finally:
            sinks.close()
    return summary
