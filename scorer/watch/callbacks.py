"""Tau inside a training loop: transformers' Trainer, speculators' Trainer, or a plain loop.

``TauScorer`` is the plain-loop helper; the two trainer callbacks are thin layers on it:

    scorer = TauScorer("eval-cache/", results="runs/exp1-watch")
    for step in range(1, steps + 1):
        ...                                   # one optimizer step
        if step % 500 == 0:
            scorer.score_module(step, drafter)  # scorer.evaluate_module: no file written
    scorer.close()

    trainer.add_callback(TauCallback("eval-cache/", every_steps=500))                 # transformers
    trainer.train_epoch(epoch, step_callback=speculators_step_callback(trainer, scorer, every_steps=500))

Records, sinks and the page are scorer watch's (results folder: watch.jsonl, tensorboard/, watch.html).
A module scored in memory gives the values ``scorer eval`` gives the checkpoint of the same weights
(tests/scorer/test_watch_callbacks.py). A scorer failure is said in one line and training goes on.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import hscache
from hscache.store.integrity import cache_digest
from scorer.families.base import Drafter
from scorer.studies.evaluate import EvalConfig, evaluate, evaluate_module
from scorer.watch.record import refused_record, scored_record
from scorer.watch.results import ResultsLog
from scorer.watch.run import WatchConfig, publish
from scorer.watch.sinks import Sinks, check_sinks

__all__ = ["TauCallback", "TauScorer", "speculators_step_callback"]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class TauScorer:
    """Scores a training run's drafter on an eval cache and logs it as ``scorer watch`` does.

    Args:
        cache: the eval cache (path or URL), opened once.
        results: the results folder (log, sinks, page); None: nothing written, ``history`` only.
        log_to: sinks besides the log (needs ``results``).
        eval_config: scoring settings (default: scorer watch's: DDTree-8, every anchor).
        say: receives one line per failure (default: stderr).

    Raises:
        ScorerError: a sink not installed, sinks without a results folder, another live writer on
            ``results``.
    """

    def __init__(
        self,
        cache: str | Path,
        *,
        results: str | Path | None = None,
        log_to: Sequence[str] = (),
        eval_config: EvalConfig | None = None,
        say: Callable[[str], None] = _stderr,
    ):
        from scorer.errors import ScorerError

        if log_to and results is None:
            raise ScorerError(f"log_to {list(log_to)} needs a results folder to write to; pass results=")
        check_sinks(log_to)
        self.cache_path = str(cache)
        self.view = hscache.open_cache(cache)
        self.cache = {"path": self.cache_path, "digest": cache_digest(self.view)}
        self.eval_config = eval_config or WatchConfig().eval
        self.say = say
        self.history: list[dict[str, Any]] = []  # every record, in order
        self.log = ResultsLog(results).__enter__() if results is not None else None
        self.sinks = Sinks(log_to, results, Path(results).name) if results is not None else None

    def score_module(
        self, step: int, module: Any, config: Any = None, family: str = "dflash"
    ) -> dict[str, Any] | None:
        """Score a module (or state_dict + ``config``) in memory (``scorer.evaluate_module``) as step
        ``step``; return its record, or None when scoring failed (said, training goes on)."""
        described = {
            "path": "module",
            "sha256": "",
            "step": step,
            "step_source": "trainer step",
            "layout": "module",
        }
        return self._score(
            described, lambda: evaluate_module(module, self.view, config, self.eval_config, family=family)
        )

    def score_checkpoint(
        self, step: int, path: str | Path, *, layout: str = "hf-dir", step_source: str = "trainer step"
    ) -> dict[str, Any] | None:
        """Score a checkpoint just saved, as ``scorer eval`` does; its record, or None on failure."""
        described = {
            "path": str(path),
            "sha256": "",
            "step": step,
            "step_source": step_source,
            "layout": layout,
        }
        return self._score(described, lambda: evaluate(path, self.cache_path, self.eval_config))

    def _score(self, described: dict[str, Any], run: Callable[[], dict]) -> dict[str, Any] | None:
        described = {**described, "source": "callback"}
        eval_dict = self.eval_config.to_dict()
        t0 = time.perf_counter()
        try:
            report = run()
            described["sha256"] = report["checkpoint"]["weights_sha256"] or report["checkpoint"]["sha256"]
            record = scored_record(described, self.cache, eval_dict, report)
        except Exception as exc:  # a scorer failure never stops the training run
            line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            self.say(
                f"scorer: step {described['step']} ({described['path']}) not scored, training goes on: {line}"
            )
            record = refused_record(described, self.cache, eval_dict, line, time.perf_counter() - t0)
        self.history.append(record)
        if self.log is not None:
            publish(record, self.log, self.sinks, f"scorer: {self.log.folder}")
        return record if record["status"] == "scored" else None

    def close(self) -> None:
        """Flush the sinks and release the results folder."""
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None
        if self.log is not None:
            self.log.__exit__(None, None, None)
            self.log = None

    def __enter__(self) -> TauScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _drafter_in(model: Any) -> Any:
    """The scorer drafter inside a trainer's model: the model, its ``.module`` (DDP, accelerate),
    or its first submodule that is a drafter."""
    model = getattr(model, "module", model)
    if isinstance(model, Drafter):
        return model
    return next((m for m in model.modules() if isinstance(m, Drafter)), model)


def speculators_step_callback(
    trainer: Any,
    scorer: TauScorer,
    *,
    every_steps: int,
    drafter_of: Callable[[Any], Any] = _drafter_in,
    config: Any = None,
    family: str = "dflash",
) -> Callable[[], None]:
    """The ``step_callback`` of speculators 0.9's ``Trainer.train_epoch`` (speculators/train/trainer.py:
    called with no argument after ``global_step += 1``): every ``every_steps`` steps it scores
    ``drafter_of(trainer.model)`` in memory at ``trainer.global_step``."""

    def step_callback() -> None:
        step = trainer.global_step
        if every_steps and step % every_steps == 0:
            scorer.score_module(step, drafter_of(trainer.model), config, family)

    return step_callback


def _trainer_callback_base() -> type:
    from transformers import TrainerCallback

    return TrainerCallback


class TauCallback(_trainer_callback_base()):
    """A ``transformers.TrainerCallback``: tau on the run's dashboard.

    Args:
        cache: the eval cache.
        every_steps: score the model in memory every N optimizer steps (0: never).
        on_save: score each checkpoint the Trainer saves (``output_dir/checkpoint-S``), as ``scorer
            eval`` would; for a model that is not a ``PreTrainedModel`` (the Trainer saves only its
            weights) pass ``eval_config=EvalConfig(config_path=...)`` naming the drafter's config.
        results: the results folder (default: ``<output_dir>-watch``); log_to: its sinks.
        drafter_of: the drafter (module or state_dict) inside the trainer's model; config / family:
            with a state_dict, its config and family (``scorer.evaluate_module``).
    """

    def __init__(
        self,
        cache: str | Path,
        *,
        every_steps: int = 0,
        on_save: bool = True,
        results: str | Path | None = None,
        log_to: Sequence[str] = ("tensorboard",),
        eval_config: EvalConfig | None = None,
        drafter_of: Callable[[Any], Any] = _drafter_in,
        config: Any = None,
        family: str = "dflash",
        say: Callable[[str], None] = _stderr,
    ):
        check_sinks(log_to)
        self.cache, self.every_steps, self.score_saves = cache, every_steps, on_save
        self.results, self.log_to, self.eval_config = results, tuple(log_to), eval_config
        self.drafter_of, self.config, self.family, self.say = drafter_of, config, family, say
        self.scorer: TauScorer | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.is_world_process_zero and self.scorer is None:
            results = (
                self.results if self.results is not None else f"{str(args.output_dir).rstrip('/')}-watch"
            )
            self.scorer = TauScorer(
                self.cache, results=results, log_to=self.log_to, eval_config=self.eval_config, say=self.say
            )

    def on_step_end(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        step = state.global_step
        if self.scorer is None or not self.every_steps or step % self.every_steps:
            return
        record = self.scorer.score_module(step, self.drafter_of(model), self.config, self.family)
        if record is not None:
            state.log_history.append({"step": step, "tau_pooled": record["metrics"]["tau"]["pooled"]})

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scorer is None or not self.score_saves:
            return
        path = (
            Path(args.output_dir) / f"checkpoint-{state.global_step}"
        )  # transformers' PREFIX_CHECKPOINT_DIR
        self.scorer.score_checkpoint(
            state.global_step, path, layout="transformers", step_source="trainer state global_step"
        )

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.scorer is not None:
            self.scorer.close()
            self.scorer = None
