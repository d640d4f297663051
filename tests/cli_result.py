"""What the fault tests assert about a ``CliRunner`` result: a refusal in one ``error:`` line."""

from __future__ import annotations

from typing import Any


def output_lines(result: Any) -> list[str]:
    """The non-blank lines a command printed."""
    return [line for line in result.output.splitlines() if line.strip()]


def one_line_refusal(result: Any, code: int = 2) -> bool:
    """Exit ``code``, no traceback, and exactly one printed line, which starts with ``error: ``."""
    lines = output_lines(result)
    return (
        result.exit_code == code
        and "Traceback" not in result.output
        and len(lines) == 1
        and lines[0].startswith("error: ")
    )
