"""Render a self-contained HTML page in headless Chromium and check the screenshot is not blank.

Shared by the tests of every HTML report (diff, eval, drift study). Without Chromium the calling
test is skipped with a visible reason rather than passing unseen.
"""

from __future__ import annotations

import asyncio
import atexit
import base64
import itertools
import json
import shutil
import subprocess
import tempfile
import time
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
    global _browser
    if _browser is None:
        _browser = _Browser(chromium, Path(tempfile.mkdtemp(prefix="hscache-chromium-")))
        atexit.register(_browser.close)
    png = work / "shot.png"
    png.write_bytes(_browser.screenshot(page.resolve().as_uri(), width, height))
    return png


_browser: _Browser | None = None


class _Browser:
    """One headless Chromium for the session, driven over the DevTools protocol: a launch per
    screenshot (``--screenshot``) costs ~1 CPU-s of browser start-up; a tab costs ~0.3. The
    capture is the same: the page at the window size, after its load event."""

    def __init__(self, chromium: str, profile: Path):
        self.profile = profile
        self.process = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--no-first-run",
                f"--user-data-dir={profile}",
                "--remote-debugging-port=0",  # Chromium picks a free port and writes it to the profile
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and port_file.read_text().strip()):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"headless Chromium did not start (exit {self.process.poll()})")
            time.sleep(0.02)
        self.base = f"http://127.0.0.1:{int(port_file.read_text().split()[0])}"

    def screenshot(self, url: str, width: int, height: int) -> bytes:
        return asyncio.run(asyncio.wait_for(self._screenshot(url, width, height), timeout=60))

    async def _screenshot(self, url: str, width: int, height: int) -> bytes:
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.put(f"{self.base}/json/new?about:blank") as response:
                tab = await response.json()
            try:
                async with http.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0) as ws:
                    return await _capture(ws, url, width, height)
            finally:
                async with http.get(f"{self.base}/json/close/{tab['id']}") as response:
                    await response.read()

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        shutil.rmtree(self.profile, ignore_errors=True)


async def _capture(ws, url: str, width: int, height: int) -> bytes:
    """Size the tab, load ``url``, wait for its load event, return the PNG."""
    messages, loaded = itertools.count(1), False

    async def call(method: str, **params) -> dict:
        nonlocal loaded
        number = next(messages)
        await ws.send_json({"id": number, "method": method, "params": params})
        while True:
            message = json.loads((await ws.receive()).data)
            if message.get("method") == "Page.loadEventFired":
                loaded = True
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"Chromium {method}: {message['error']}")
                return message["result"]

    await call(
        "Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False
    )
    await call("Page.enable")
    await call("Page.navigate", url=url)
    while not loaded:
        if json.loads((await ws.receive()).data).get("method") == "Page.loadEventFired":
            loaded = True
    shot = await call("Page.captureScreenshot", format="png")
    return base64.b64decode(shot["data"])
