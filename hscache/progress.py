"""Progress of a long step on stderr: a live bar on a terminal, a plain line every few seconds otherwise.

One reporter for every long step (extract, eval, train, verify, diff, export, import): the work
done out of the total, the rate, the time left, and a free-text status (e.g. rounds replayed).
Rich draws nothing until the end when stderr is not a terminal (a log file, a batch job, CI), so
there the reporter prints a line every ``every_s`` seconds instead, and one at the end of a step
that printed any (a step shorter than ``every_s`` stays silent unless ``eager``).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

DEFAULT_EVERY_S = 5.0  # seconds between plain lines when stderr is not a terminal

__all__ = ["DEFAULT_EVERY_S", "NO_PROGRESS", "NullProgress", "ProgressLine", "StepProgress", "format_eta"]


def format_eta(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``: what a person reads at a glance."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class ProgressLine:
    """The counters and the text of one step; pure bookkeeping, the clock is passed in."""

    def __init__(self, label: str, unit: str, *, secondary_unit: str | None = None) -> None:
        self.label, self.unit, self.secondary_unit = label, unit, secondary_unit
        self.total: int | None = None
        self.done = self.resumed = self.secondary = 0
        self.status = ""
        self.t0 = 0.0

    def start(self, now: float, total: int | None, done: int = 0) -> None:
        self.t0, self.total, self.done, self.resumed = now, total, done, done

    def advance(self, n: int, secondary: int, status: str) -> None:
        self.done += n
        self.secondary += secondary
        if status:
            self.status = status

    def text(self, now: float) -> str:
        """``eval: 12/20 sequences, 3.1 sequences/s, ETA 3 s, 140 rounds``."""
        elapsed = max(1e-9, now - self.t0)
        ran = self.done - self.resumed
        of = f"/{self.total}" if self.total is not None else ""
        parts = [f"{self.label}: {self.done}{of} {self.unit}"]
        if ran:
            parts.append(f"{ran / elapsed:,.2f} {self.unit}/s")
        if self.secondary_unit and self.secondary:
            parts.append(f"{self.secondary / elapsed:,.0f} {self.secondary_unit}/s")
        left = None if self.total is None else self.total - self.done
        if ran and left:
            parts.append(f"ETA {format_eta(elapsed / ran * left)}")
        if self.status:
            parts.append(self.status)
        return ", ".join(parts)


class NullProgress:
    """The API default: a long step called without a reporter reports nothing."""

    def start(self, total: int | None, done: int = 0, note: str | None = None, **_names: str) -> None:
        pass

    def note(self, text: str) -> None:
        pass

    def advance(self, n: int = 1, secondary: int = 0, status: str = "") -> None:
        pass

    def finish(self) -> None:
        pass


NO_PROGRESS = NullProgress()


class StepProgress:
    """Report one long step on ``stream`` (stderr): ``start`` once, ``advance`` per unit, ``finish``.

    On a terminal a rich bar (done/total, rate, ETA, status); otherwise a line every ``every_s``
    seconds (default ``DEFAULT_EVERY_S``) and one at the end; ``eager`` also prints a line at the
    start and ends with one however short the step. ``quiet`` reports nothing. A context manager.
    """

    def __init__(
        self,
        label: str,
        unit: str,
        *,
        secondary_unit: str | None = None,
        every_s: float | None = None,
        eager: bool = False,
        quiet: bool = False,
        stream: TextIO | None = None,
        terminal: bool | None = None,
    ) -> None:
        self.line = ProgressLine(label, unit, secondary_unit=secondary_unit)
        self.every_s = DEFAULT_EVERY_S if every_s is None else every_s
        self.eager, self.quiet = eager, quiet
        self._printed = False
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty() if terminal is None else terminal
        self._bar: Any = None
        self._task: Any = None
        self._last = 0.0
        self._started = False
        self._due = False  # a line was due at the last unit: finish says it

    def __enter__(self) -> StepProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def start(
        self,
        total: int | None,
        done: int = 0,
        note: str | None = None,
        *,
        label: str | None = None,
        unit: str | None = None,
    ) -> None:
        """Begin (or begin again, e.g. per cache or per stage): ``done`` units were finished by an
        earlier run; ``label`` / ``unit`` rename the step from here on (e.g. "verify --deep", "chunks")."""
        if self.quiet:
            return
        if self._started:
            self.finish()
        self.line.label = label or self.line.label
        self.line.unit = unit or self.line.unit
        self.line.secondary = 0
        self.line.status = ""
        now = time.perf_counter()
        self.line.start(now, total, done)
        self._last, self._started, self._printed, self._due = now, True, False, False
        if self.terminal:
            self._start_bar(total, done, note)
        elif self.eager or note:
            extra = f" ({note})" if note else ""
            of = f"{total} {self.line.unit}" if total is not None else self.line.unit
            self._echo(f"{self.line.label}: {of}{extra}")

    def note(self, text: str) -> None:
        """One line for a step without a count (loading a model, checking a file), on a terminal and
        in logs alike, so that a long step before the bar (or between its updates) is never silent."""
        if self.quiet:
            return
        line = f"{self.line.label}: {text}"
        if self._bar is not None:
            self._bar.console.print(line, markup=False, highlight=False)
        else:
            print(line, file=self.stream, flush=True)

    def advance(self, n: int = 1, secondary: int = 0, status: str = "") -> None:
        if self.quiet or not self._started:
            return
        self.line.advance(n, secondary, status)
        now = time.perf_counter()
        if self._bar is not None:
            self._bar.update(self._task, advance=n, status=self._bar_status(now))
        elif now - self._last >= self.every_s:
            self._last = now
            if self._at_end():  # the last unit is said once, by finish (with the whole step's rates)
                self._due = True
            else:
                self._echo(self.line.text(now))

    def set_status(self, text: str) -> None:
        """Replace the status text (``""`` clears it, e.g. before the final line of a step)."""
        if self.quiet or not self._started:
            return
        self.line.status = text
        if self._bar is not None:
            self._bar.update(self._task, status=self._bar_status(time.perf_counter()))

    def _at_end(self) -> bool:
        return self.line.total is not None and self.line.done >= self.line.total

    def finish(self) -> None:
        if self.quiet or not self._started:
            return
        self._started = False
        if self._bar is not None:
            self._bar.stop()
            self._bar = None
        elif self._printed or self.eager or self._due:
            self._echo(self.line.text(time.perf_counter()))
        self._due = False

    def _bar_status(self, now: float) -> str:
        elapsed = max(1e-9, now - self.line.t0)
        parts = []
        if self.line.secondary_unit and self.line.secondary:
            parts.append(f"{self.line.secondary / elapsed:,.0f} {self.line.secondary_unit}/s")
        if self.line.status:
            parts.append(self.line.status)
        return ", ".join(parts)

    def _start_bar(self, total: int | None, done: int, note: str | None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TaskProgressColumn,
            TextColumn,
            TimeRemainingColumn,
        )

        console = Console(file=self.stream)
        self._bar = Progress(
            TextColumn(f"[bold]{self.line.label}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn(self.line.unit),
            TaskProgressColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task(self.line.label, total=total, completed=done, status="")
        if note:
            console.print(note)

    def _echo(self, text: str) -> None:
        self._printed = True
        print(text, file=self.stream, flush=True)
