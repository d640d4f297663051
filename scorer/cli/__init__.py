"""The ``scorer`` command line: a thin layer over the Python API (scorer.studies.evaluate, compare, sweep,
online, init, train, diagnose_run, watch), one module per command; what the commands share (option
declarations, range checks, output helpers) is in shared.py."""

from __future__ import annotations

import click

from scorer.cli.compare import compare
from scorer.cli.diagnose import diagnose
from scorer.cli.eval import eval_command
from scorer.cli.init import init
from scorer.cli.online import online
from scorer.cli.served import served
from scorer.cli.sweep import sweep
from scorer.cli.watch import watch_command

__all__ = ["main"]


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hscache")
def main() -> None:
    """Score drafter checkpoints (DFlash, EAGLE-3, ...) against hidden-state caches, without the target."""


for _command in (eval_command, compare, diagnose, sweep, watch_command, online, served, init):
    main.add_command(_command)
