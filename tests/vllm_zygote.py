"""vLLM's interpreter for the tests, with vLLM imported once: a "python" that forks a warm process.

Every process the tests start in vLLM's venv (`.vllm`: the judge's worker, the extraction worker, the
``hscache`` CLI run there) would import vLLM itself, ~16 CPU-s each (measured: `import vllm; from vllm
import LLM`, 14.6 user + 1.7 sys). Here one server process in that venv imports vLLM and the hscache
modules its workers run, then forks once per run. The tests hand the callers the ``vllm_python`` fixture
(tests/conftest.py): a small executable that passes its argv, environment, working directory and
stdin/stdout/stderr to the server and exits with the forked run's status, so callers that take an
interpreter path (``--vllm-python``, ``ServedConfig.vllm_python``) run unchanged.

A run sees what ``python ARGS`` would: ``-m MODULE``, ``-c CODE`` or a script path; its own argv,
environment, working directory and ``sys.path`` (the script's folder or the working directory first,
then its PYTHONPATH); the interpreter's exit as far as a program can see it: non-daemon threads joined,
atexit handlers run (weakref finalizers and logging's flush included), stdout and stderr flushed, the
exit status. What it skips is the interpreter's own teardown (the final garbage collection and the
freeing of every module): in a fork of the server that walked the ~640,000 objects vLLM's import made
and, writing their reference counts, copied every page they sit on, ~3 CPU-s per run for nothing the run
can observe (measured: `-c pass` through the server 3.0-3.5 CPU-s, with this exit 0.09; 2026-12-07, the
shared 2-core VM). What it cannot see: modules the server imported are already imported (vLLM reads its environment lazily, and the
server runs with the environment the workers get: hscache.engines.vllm.runtime.engine_env). Other
interpreter flags are refused by name. The server holds no thread but jemalloc's background one (fork
safe), so a fork is a clean copy.

A run also skips what each vLLM engine's shutdown spends walking that same heap: hscache's start_engine
freezes it (gc.freeze, hscache/engines/vllm/runtime.py) and the shutdown unfreezes it (vllm 0.32.0
v1/engine/core.py:836, v1/worker/gpu_worker.py:1607) and collects it whole, twice
(v1/worker/gpu_model_runner.py:6291, distributed/parallel_state.py:2543), ~0.3 CPU-s each in a fork. In a
run ``gc.unfreeze`` does nothing, so those collections walk only what was made since the last freeze: every
engine's garbage is still collected except what vLLM itself froze once the engine had started
(v1/engine/core.py:253; the tests' targets are tiny: +18 MB after 4 engines), which the run's exit frees.
What the engines serve is unchanged (measured: the judge's DFlash and EAGLE-3 engines, 4 in one run, 7.4 ->
4.6 CPU-s; the judge tests' 18 engines served what they served before, run for run; 2026-12-07, the shared
2-core VM).
"""

from __future__ import annotations

import gc
import json
import os
import selectors
import signal
import socket
import stat
import subprocess
import sys
from pathlib import Path

# What the workers import, imported once (vLLM's CPU worker without torchvision: the hybrid target's
# stub is added by the worker itself, hscache/engines/vllm/runtime.vision_stub).
_PRELOAD = (
    "vllm",
    "vllm.entrypoints.llm",
    "hscache.cli",
    "hscache.capture.extract",
    "hscache.engines.vllm.worker",
    "hscache.engines.vllm.extract_worker",
)

_CLIENT = """#!{python} -SE
# A "python" whose runs are forks of the warm vLLM process at {socket} (tests/vllm_zygote.py).
import json, os, signal, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect({socket!r})
request = {{"argv": sys.argv[1:], "env": dict(os.environ), "cwd": os.getcwd()}}
socket.send_fds(s, [json.dumps(request).encode()], [0, 1, 2])
pid = json.loads(s.recv(1 << 16))["pid"]
for number in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
    signal.signal(number, lambda n, frame: os.kill(pid, n))
code = json.loads(s.recv(1 << 16))["returncode"]
if code < 0:
    signal.signal(-code, signal.SIG_DFL)
    os.kill(os.getpid(), -code)
sys.exit(code)
"""


def _run(request: dict, base_path: list[str]) -> int:
    """In the forked run: become ``python *argv`` and run it; returns its exit status."""
    import runpy

    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    argv = list(request["argv"])
    pythonpath = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    try:
        if argv[:1] == ["-m"] and len(argv) > 1:
            sys.argv, first = [argv[1], *argv[2:]], os.getcwd()
            sys.path[:] = [first, *pythonpath, *base_path]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[:1] == ["-c"] and len(argv) > 1:
            sys.argv = ["-c", *argv[2:]]
            sys.path[:] = ["", *pythonpath, *base_path]
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
        elif argv and not argv[0].startswith("-"):
            script = os.path.abspath(argv[0])
            sys.argv = argv
            sys.path[:] = [os.path.dirname(script), *pythonpath, *base_path]
            runpy.run_path(script, run_name="__main__")
        else:
            print(
                f"tests/vllm_zygote.py runs `-m MODULE`, `-c CODE` or a script, not {argv!r}", file=sys.stderr
            )
            return 2
    except SystemExit as done:
        code = done.code
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1
    return 0


def _status(request: dict, base_path: list[str]) -> int:
    """The run's exit status; an uncaught exception is printed as the interpreter prints it (status 1;
    a KeyboardInterrupt: -SIGINT, the interpreter then ends itself by that signal)."""
    try:
        return _run(request, base_path)
    except BaseException as error:
        sys.excepthook(*sys.exc_info())
        return -signal.SIGINT if isinstance(error, KeyboardInterrupt) else 1


def _keep_frozen() -> None:
    """A run's ``gc.unfreeze``: the heap frozen so far stays out of later collections."""


def _exit(status: int) -> None:
    """Leave the forked run as the interpreter's exit does for the program, without its teardown (the
    module docstring: the final collection of the server's objects cost ~3 CPU-s per run)."""
    import atexit
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()  # what Py_FinalizeEx runs before its teardown (no public name exists)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the run, or its reader is gone: nothing to flush to
            pass
    if status < 0:
        signal.signal(-status, signal.SIG_DFL)
        os.kill(os.getpid(), -status)
    os._exit(status if status >= 0 else 1)


def serve(socket_path: str) -> None:
    """Import vLLM, then fork one run per connection; report each run's pid, then its status."""
    base_path = [p for p in sys.path[1:] if p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
    import importlib

    for name in _PRELOAD:
        importlib.import_module(name)
    # No gc.freeze() here: a run's objects would then outlive its interpreter's shutdown (nanobind
    # reports triton's as leaked on stderr, after the run's own last line).
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(16)
    print("ready", flush=True)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for key, _ in selector.select():
            if key.fileobj is listener:
                conn, _ = listener.accept()
                message, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    gc.unfreeze = _keep_frozen  # the module docstring: engines' shutdowns walk less
                    selector.close()
                    listener.close()
                    conn.close()
                    for target, fd in zip((0, 1, 2), fds):
                        os.dup2(fd, target)
                        os.close(fd)
                    _exit(_status(request, base_path))
                for fd in fds:
                    os.close(fd)
                conn.send(json.dumps({"pid": pid}).encode())
                selector.register(os.pidfd_open(pid), selectors.EVENT_READ, (pid, conn))
            else:
                pid, conn = key.data
                selector.unregister(key.fd)
                os.close(key.fd)
                _, status = os.waitpid(pid, 0)
                conn.send(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}).encode())
                conn.close()


class Zygote:
    """The server process (started by ``start``) and the client executable that runs through it."""

    def __init__(self, vllm_python: Path, root: Path, workdir: Path, env: dict[str, str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket_path = str(workdir / "zygote.sock")
        self.python = workdir / "python"
        self.python.write_text(_CLIENT.format(python=vllm_python, socket=self.socket_path))
        self.python.chmod(self.python.stat().st_mode | stat.S_IXUSR)
        env = {**env, "PYTHONPATH": os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])}
        self.log = (workdir / "zygote.log").open("w")
        self.process = subprocess.Popen(
            [str(vllm_python), __file__, self.socket_path],
            stdout=subprocess.PIPE, stderr=self.log, env=env, cwd=workdir, text=True,
        )  # fmt: skip
        ready = self.process.stdout.readline().strip()
        if ready != "ready":
            self.close()
            raise RuntimeError(f"the vLLM zygote did not start (log: {workdir / 'zygote.log'})")

    def close(self) -> None:
        self.process.terminate()
        self.process.wait()
        self.log.close()


if __name__ == "__main__":
    serve(sys.argv[1])
