"""A background thread that turns captured tensors into stored rows and commits them.

The main thread keeps the device busy with the next forward while this thread copies,
compresses and writes; the bounded queue makes the main thread wait (rather than use
unbounded memory) when the disk is the bottleneck. Errors surface on the main thread at
the next ``submit`` or at exit.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from types import TracebackType

from hscache.store.writer import SequenceRows, StoreWriter

__all__ = ["WriterThread"]

_STOP = object()


def _lower_priority() -> None:
    """Nice this thread (Linux threads have their own nice value): on a CPU extraction the forward
    owns the cores and the writer fills the gaps; on CUDA it changes nothing that matters."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
    except (AttributeError, OSError):
        pass


class WriterThread:
    def __init__(self, writer: StoreWriter, commit_every_s: float, queue_depth: int = 4):
        self.writer = writer
        self.commit_every_s = commit_every_s
        self.queue: queue.Queue = queue.Queue(maxsize=queue_depth)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="hscache-writer", daemon=True)
        self.last_commit = time.monotonic()

    def __enter__(self) -> WriterThread:
        self.thread.start()
        return self

    def submit(self, make_rows: Callable[[], list[SequenceRows]]) -> None:
        """Queue a batch; ``make_rows`` runs on the writer thread (device-to-host copy included)."""
        self._raise_if_failed()
        while True:
            try:
                self.queue.put(make_rows, timeout=0.5)
                return
            except queue.Full:
                self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self.error is not None:
            raise self.error

    def _run(self) -> None:
        _lower_priority()
        while (item := self.queue.get()) is not _STOP:
            if self.error is not None:
                continue  # drain: nothing more is written after a failure
            try:
                for rows in item():
                    self.writer.append(rows)
                if time.monotonic() - self.last_commit >= self.commit_every_s:
                    self.writer.commit()
                    self.last_commit = time.monotonic()
            except BaseException as exc:  # handed to the main thread, never swallowed
                self.error = exc

    def __exit__(self, exc_type: type | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.queue.put(_STOP)
        self.thread.join()
        if exc is None:
            self._raise_if_failed()
        elif self.error is None:
            # The main thread failed or was interrupted (Ctrl-C): keep the batches already
            # captured by committing them before the exception propagates.
            self.writer.commit()
