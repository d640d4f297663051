"""Tables printed whole: rich's boxes on a terminal, plain columns or markdown when redirected
(a log, a file, CI), where rich would cut every row to 80 columns."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import TextIO

from rich.console import Console
from rich.table import Table

__all__ = ["TABLE_FORMATS", "markdown_table", "plain_table", "print_table"]

TABLE_FORMATS = ("auto", "plain", "markdown")


def plain_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Whole cells in columns padded to their widest, two spaces apart: for logs and files."""
    widths = [max(len(str(c)) for c in column) for column in zip(header, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
    return "\n".join([line(header), line(["-" * w for w in widths]), *(line(r) for r in rows)]) + "\n"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured markdown table (``|`` in a cell escaped)."""
    cell = lambda c: str(c).replace("|", "\\|")
    lines = ["| " + " | ".join(map(cell, header)) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(cell, row)) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def print_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], fmt: str = "auto", stream: TextIO | None = None
) -> None:
    """One table on ``stream`` (stdout), never cut: ``auto`` draws rich's boxes on a terminal (a cell
    too wide folds onto more lines) and plain columns otherwise, where rich would cut every row to
    80 columns ("7.7..."); ``plain`` and ``markdown`` as named."""
    stream = stream if stream is not None else sys.stdout
    if fmt == "auto" and stream.isatty():
        table = Table(*header)
        for column in table.columns:
            column.overflow = "fold"
        for row in rows:
            table.add_row(*row)
        Console(file=stream).print(table)
        return
    stream.write(markdown_table(header, rows) if fmt == "markdown" else plain_table(header, rows))
    stream.write("\n")
    stream.flush()
