"""Per-test CPU time of the suite, for keeping it within its budget (README "Run the tests").

    .venv/bin/python -m pytest -q -p tests.cpu_profile tests   # CPU_PROFILE_OUT=cpu.tsv by default

writes one line per test phase (setup, call, teardown) and per fixture set up:
``kind  name  where  cpu_s  wall_s``, appended as the suite runs (a run cut short keeps what it measured),
and ``#session  cpu_s  wall_s`` at the end. Sort it with ``sort -t$'\\t' -k4 -rn``.

CPU time is user + sys of this process, of its reaped children (RUSAGE_CHILDREN), and of every live
descendant (utime + stime + cutime + cstime from /proc): the warm servers the tests fork their runs
from (tests/vllm_zygote.py, tests/hscache/forked_cli.py, dask's workers) are reaped only at the
session's end, so without the live ones their runs would all be booked to the last teardown. A fixture's
line is its own setup: pytest sets up what it depends on first, each on a line of its own.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import pytest

_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
_PHASES = ("setup", "call", "teardown")


def _descendants_cpu_s(pid: int) -> float:
    """CPU seconds of the live descendants of ``pid`` (with what each has reaped)."""
    total = 0.0
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return 0.0
    children: list[str] = []
    for tid in threads:
        try:
            children += Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
        except OSError:
            pass
    for child in children:
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            continue  # exited meanwhile: its time is in its parent's reaped children now
        fields = stat[stat.rindex(")") + 2 :].split()
        total += sum(int(x) for x in fields[11:15]) / _TICKS_PER_S  # utime stime cutime cstime
        total += _descendants_cpu_s(int(child))
    return total


def cpu_s() -> float:
    """CPU seconds of this process, its reaped children and its live descendants."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    reaped = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + reaped.ru_utime + reaped.ru_stime + _descendants_cpu_s(os.getpid())


class _Profile:
    def __init__(self, path: str) -> None:
        self.out = open(path, "a", buffering=1)  # for the session, line by line: a cut-short run keeps it
        self.start = (cpu_s(), time.time())

    def write(self, kind: str, name: str, where: str, since: tuple[float, float]) -> None:
        cpu, wall = cpu_s() - since[0], time.time() - since[1]
        self.out.write(f"{kind}\t{name}\t{where}\t{cpu:.3f}\t{wall:.2f}\n")

    @pytest.hookimpl(hookwrapper=True)
    def pytest_fixture_setup(self, fixturedef, request):
        since = (cpu_s(), time.time())
        yield
        name = f"{fixturedef.baseid}::{fixturedef.argname}[{fixturedef.scope}]"
        self.write("fixture", name, request.node.nodeid, since)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_setup(self, item):
        since = (cpu_s(), time.time())
        yield
        self.write("test", item.nodeid, "setup", since)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_call(self, item):
        since = (cpu_s(), time.time())
        yield
        self.write("test", item.nodeid, "call", since)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_teardown(self, item):
        since = (cpu_s(), time.time())
        yield
        self.write("test", item.nodeid, "teardown", since)

    def pytest_sessionfinish(self) -> None:
        cpu, wall = cpu_s() - self.start[0], time.time() - self.start[1]
        self.out.write(f"#session\t{cpu:.2f}\t{wall:.1f}\n")
        self.out.close()


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_Profile(os.environ.get("CPU_PROFILE_OUT", "cpu.tsv")), "cpu_profile")
