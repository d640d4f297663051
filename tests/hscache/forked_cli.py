"""``hscache`` CLI runs in their own process, without paying the torch import for each.

The crash tests kill an extraction with SIGKILL or SIGTERM, so it must run in a process of its
own; a fresh ``python -m hscache.cli`` spends ~4 CPU-s importing torch and transformers before it
extracts anything. One server interpreter imports them once (and runs no torch op, so the forked
OpenMP state is clean); each run is a fork of it that calls the CLI as ``python -m hscache.cli``
would, with stdout and stderr in files. The server reaps it and reports its exit status, which
``ForkedRun`` reads: the same status a ``subprocess.Popen`` of the CLI would give (-9 for SIGKILL).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

# Imports what an extraction of builtin:tiny-qwen3.5 imports, then serves one run at a time.
_SERVER = r"""
import json, os, signal, sys
import torch, transformers, hscache.cli, hscache.capture.extract, hscache.capture.target
from transformers import Qwen3_5ForCausalLM

for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        sys.stdin.close()
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
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)
"""


class CliServer:
    """The warm interpreter; ``start`` forks one ``hscache`` CLI run from it."""

    def __init__(self, env: dict[str, str], workdir: Path):
        self.workdir, self.runs, self.current = workdir, 0, None
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
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
