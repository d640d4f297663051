"""Render a self-contained HTML page in headless Chromium and check the screenshot is not blank.

Shared by the tests of every HTML report (diff, eval, drift study). Without Chromium the calling
test is skipped with a visible reason rather than passing unseen.
"""

from __future__ import annotations

import shutil
import subprocess
import zlib
from pathlib import Path

import pytest

__all__ = ["png_is_not_blank", "screenshot"]


def png_is_not_blank(data: bytes) -> bool:
    """True when the decoded image data holds many distinct byte values (a blank page holds a few)."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        length = int.from_bytes(data[pos : pos + 4], "big")
        if data[pos + 4 : pos + 8] == b"IDAT":
            idat += data[pos + 8 : pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(idat))) > 64


def screenshot(page: Path, work: Path, *, width: int = 1200, height: int = 2000) -> Path:
    """Screenshot ``page`` into ``work/shot.png`` with headless Chromium (skips the test without it)."""
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("chromium not installed (apt-get install chromium); the HTML report was not rendered")
    png = work / "shot.png"
    command = [
        chromium,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={work / 'profile'}",
        f"--screenshot={png}",
        f"--window-size={width},{height}",
        page.resolve().as_uri(),
    ]
    subprocess.run(command, check=True, capture_output=True, timeout=60)
    return png
