"""``python -m scorer.cli``: the ``scorer`` command."""

from scorer.cli import main

main()
