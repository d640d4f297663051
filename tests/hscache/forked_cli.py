"""``hscache`` CLI runs in their own process, without paying the torch import for each.

The crash tests kill an extraction with SIGKILL or SIGTERM, so it must run in a process of its
own; a fresh ``python -m hscache.cli`` spends ~7 CPU-s importing torch, transformers and the
target's model class before it extracts anything. One server process holds them imported (and runs
no torch op, so the forked OpenMP state is clean); each run is a fork of it that calls the CLI as
``python -m hscache.cli`` would, with stdout and stderr in files. The server reaps it and reports
its exit status, which ``ForkedRun`` reads: the same status a ``subprocess.Popen`` of the CLI
would give (-9 for SIGKILL).

The server is forked from pytest itself while it collects (``prefork``: tests/hscache/conftest.py
imports this module), when pytest has imported torch, transformers and hscache but run nothing
and started no thread yet, so the imports cost the server nothing (a separate ``python -c`` server
spent 8 CPU-s on them, measured). Where pytest already runs threads (a thread's locks do not
survive a fork) it is started as its own interpreter instead (``_SERVER``).

The runs' CPU time reaches pytest's ``RUSAGE_CHILDREN`` only when the session-scoped server is
reaped, at the session's end: a per-test profile books it to the last test's teardown.
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path


def _run(request: dict) -> None:
    """In the forked run: the CLI with stdout/stderr in the request's files; never returns."""
    import hscache.cli

    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    code = 0
    try:
        hscache.cli.main(request["args"], prog_name="hscache")
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _serve(requests, replies) -> None:
    """One run at a time: fork it, report its pid, reap it, report its exit status."""
    for line in requests:
        request = json.loads(line)
        if request is None:  # close(): whatever else holds the pipe open (a fork of pytest) cannot block it
            return
        pid = os.fork()
        if pid == 0:
            requests.close()  # replies stays: it may be sys.stdout, which the run points at its file
            _run(request)
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


# Imports what an extraction of builtin:tiny-qwen3.5 imports, then serves (a server of its own).
_IMPORTS = "import torch, transformers, hscache.cli, hscache.capture.extract, hscache.capture.target\n"
_IMPORTS += "from transformers import Qwen3_5ForCausalLM\n"
# ... and what each run imported on its own before 2026-12-07 (python -X importtime on one run of the
# small cache: 0.46 s, pandas 0.41 of it, pulled in through pyarrow): once here, not once per run
_IMPORTS += "import pandas, jsonschema, pyarrow.dataset, hscache.data.dataset\n"
# _FROZEN_HEAP: the server freezes what its imports made (gc.freeze) before it forks any run, so a run's
# collections walk only the objects the run made, not the ~1M of torch, transformers and pandas: walking
# them also wrote their reference counts and so copied every page they sit on into the fork. Nothing a
# run made is frozen (it exits with os._exit, no interpreter teardown). Measured: test_crash_safety.py
# 20.8 -> 17.5 CPU-s, back to back (2026-12-07, the shared 2-core VM, noisy).
_SERVER = (
    _IMPORTS
    + "import gc\ngc.freeze()\nfrom tests.hscache.forked_cli import _serve\n_serve(sys.stdin, sys.stdout)\n"
)
_SERVER = "import sys\n" + _SERVER

# Threads a fork may leave behind: jemalloc's (pyarrow's allocator) re-creates its background thread
# in the child and guards its locks across fork itself.
_FORK_SAFE_THREADS = {"jemalloc_bg_thd"}


def _only_fork_safe_threads() -> bool:
    try:
        tasks = os.listdir("/proc/self/task")
        names = [Path(f"/proc/self/task/{t}/comm").read_text().strip() for t in tasks]
    except OSError:
        return False
    return sum(name not in _FORK_SAFE_THREADS for name in names) == 1  # this thread alone


class _Preforked:
    """A server forked from this process, with the part of ``subprocess.Popen`` CliServer uses."""

    def __init__(self, env: dict[str, str]):
        requests_r, requests_w = os.pipe()
        replies_r, replies_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(requests_w)
                os.close(replies_r)
                _become_a_cli_process(env)
                exec(_IMPORTS)  # what pytest has not imported yet (the model class): once, for every run
                gc.freeze()  # see _FROZEN_HEAP
                _serve(os.fdopen(requests_r), os.fdopen(replies_w, "w"))
            finally:
                os._exit(0)
        os.close(requests_r)
        os.close(replies_w)
        self.stdin, self.stdout = os.fdopen(requests_w, "w"), os.fdopen(replies_r)
        self.returncode: int | None = None

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                pid, status = os.waitpid(self.pid, os.WNOHANG if deadline is not None else 0)
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() > deadline:
                    raise subprocess.TimeoutExpired(f"CLI server (pid {self.pid})", timeout)
                time.sleep(0.01)
        return self.returncode


def _become_a_cli_process(env: dict[str, str]) -> None:
    """Undo what pytest set in this (forked) interpreter that a fresh ``python -m hscache.cli`` lacks:
    its output capture, log capture, fault handler and signal handlers; one torch thread as ``env``."""
    import faulthandler
    import io
    import logging

    import torch

    faulthandler.disable()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    os.environ.update(env)
    torch.set_num_threads(int(env.get("OMP_NUM_THREADS", "1")))
    captured = sys.stderr
    sys.stdin = open(os.devnull)  # no stdin, as the server's runs
    # Fresh streams on fds 1 and 2 (each run points them at its files), not pytest's capture objects.
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    root = logging.getLogger()
    root.handlers = [h for h in root.handlers if not type(h).__module__.startswith("_pytest")]
    root.setLevel(logging.WARNING)
    for logger in [root, *logging.Logger.manager.loggerDict.values()]:
        for handler in getattr(logger, "handlers", ()):
            if isinstance(handler, logging.StreamHandler) and handler.stream is captured:
                handler.setStream(sys.stderr)  # transformers' own handler, made while pytest captured


_preforked: list[_Preforked | None] = []  # one per process: pytest imports its conftest twice


def prefork(env: dict[str, str]) -> _Preforked | None:
    """The server, forked from this process now if no thread a fork would break runs; else None."""
    if not _preforked:
        _preforked.append(_Preforked(env) if _only_fork_safe_threads() else None)
    return _preforked[0]


class CliServer:
    """The warm interpreter; ``start`` forks one ``hscache`` CLI run from it. ``preforked``: a server
    ``prefork`` made (None: start one, ``python -c _SERVER`` with ``env``)."""

    def __init__(self, env: dict[str, str], workdir: Path, preforked: _Preforked | None = None):
        self.workdir, self.runs, self.current = workdir, 0, None
        self.process = preforked or subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
            cwd=Path(__file__).resolve().parents[2],  # where `tests.hscache.forked_cli` imports from
        )

    def start(self, args: list[str]) -> ForkedRun:
        if self.current is not None and self.current.poll() is None:  # a failed test left it running
            self.current.kill()
            self.current.wait(60)
        self.runs += 1
        out, err = self.workdir / f"run{self.runs}.out", self.workdir / f"run{self.runs}.err"
        request = {"args": list(args), "stdout": str(out), "stderr": str(err)}
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        self.current = ForkedRun(self, int(self._reply(None)["pid"]), out, err)
        return self.current

    def _reply(self, timeout: float | None) -> dict | None:
        """The server's next line, or None if none came within ``timeout`` seconds."""
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the CLI server exited with {self.process.wait()}")
        return json.loads(line)

    def close(self) -> None:
        if self.current is not None and self.current.poll() is None:
            self.current.kill()
            self.current.wait(60)
        self.process.stdin.write("null\n")
        self.process.stdin.close()
        self.process.wait(timeout=60)


class ForkedRun:
    """The part of ``subprocess.Popen`` the crash tests use, for one forked CLI run."""

    def __init__(self, server: CliServer, pid: int, stdout: Path, stderr: Path):
        self.server, self.pid, self.stdout_path, self.stderr_path = server, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        return self._wait(0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._wait(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(f"hscache (pid {self.pid})", timeout)
        return code

    def _wait(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            reply = self.server._reply(timeout)
            if reply is not None:
                self.returncode = reply["returncode"]
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reaped yet, so the pid is still this run's
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout_path.read_text(), self.stderr_path.read_text()
