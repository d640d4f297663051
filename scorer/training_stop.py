"""Ctrl-C while a drafter trains (``scorer init --train-steps N``): the steps done are kept.

The first Ctrl-C (SIGINT) asks the trainer to stop once the step in progress is complete, never in
the middle of an optimizer update (its weights would be half-updated); the trainer then saves the
drafter of its last completed step, whole (scorer/drafter_dir.py), with ``TRAINED_STEPS_KEY`` in its
config.json recording the steps done and requested, and raises ``TrainingInterrupted``, which the CLI
says in one line. A second Ctrl-C interrupts at once (KeyboardInterrupt: nothing is saved). Every
trained drafter records its steps, so ``scorer eval`` readers and people can tell a drafter cut short.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scorer.errors import ScorerError

__all__ = ["TRAINED_STEPS_KEY", "StopRequest", "TrainingInterrupted", "stop_on_interrupt", "trained_steps"]

# In a trained drafter's config.json: {"done": steps completed, "requested": --train-steps}.
TRAINED_STEPS_KEY = "hscache_trained_steps"


@dataclass
class StopRequest:
    """Set by the first Ctrl-C; the training loop reads it after each completed step."""

    requested: bool = False


class TrainingInterrupted(ScorerError):
    """Training was stopped by Ctrl-C after ``done`` of ``requested`` steps; the drafter of step
    ``done`` is saved at ``out``."""

    def __init__(self, done: int, requested: int, out: str | Path) -> None:
        self.done, self.requested, self.out = done, requested, Path(out)
        super().__init__(
            f"interrupted after step {done} of {requested}: the drafter trained so far is saved at {out} "
            f'(its config.json records "{TRAINED_STEPS_KEY}": {done} of {requested}); score it as it is, or '
            f"train all {requested} steps again with the same command and --overwrite"
        )


def trained_steps(done: int, requested: int) -> dict[str, dict[str, int]]:
    """The config.json entry of a drafter trained ``done`` of ``requested`` steps."""
    return {TRAINED_STEPS_KEY: {"done": done, "requested": requested}}


@contextlib.contextmanager
def stop_on_interrupt() -> Iterator[StopRequest]:
    """For the ``with`` block, the first SIGINT sets the yielded request (and says so on stderr);
    a second raises KeyboardInterrupt. Outside the main thread (no signal handler can be set there)
    the request is never set and Ctrl-C behaves as before."""
    stop = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield stop
        return

    def handler(_signum: int, _frame: object) -> None:
        if stop.requested:
            raise KeyboardInterrupt
        stop.requested = True
        sys.stderr.write(
            "\nCtrl-C: stopping after the step in progress and saving the drafter trained so far "
            "(Ctrl-C again to stop at once, saving nothing)\n"
        )

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield stop
    finally:
        signal.signal(signal.SIGINT, previous)
