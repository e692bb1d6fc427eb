"""Headless Chromium driven over the DevTools protocol, for tests of the HTML report.

Debian's chromium package and the websockets client are all it needs: no driver
binary, no browser download. Chromium listens on a loopback port of its choosing and
writes it to DevToolsActivePort in its own fresh profile directory.
"""

from __future__ import annotations

import base64
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

from websockets.sync.client import connect

CANDIDATES = ("/usr/bin/chromium", "/usr/bin/chromium-browser")
# The flags a sandboxed, offline machine needs: no GPU, no sandbox (root), no
# background fetches of any kind.
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-default-apps", "--hide-scrollbars", "--remote-debugging-port=0",
]


def find_chromium() -> str | None:
    """The chromium binary, or None where it is not installed."""
    for path in CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return shutil.which("chromium")


class Chromium:
    """One headless browser with one page; use as a context manager."""

    def __init__(self, binary: str, profile_dir: Path, width: int = 1280, height: int = 900) -> None:
        self.proc = subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile_dir}", f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self._stack = contextlib.ExitStack()
        try:
            port = self._port(profile_dir / "DevToolsActivePort")
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                page = next(t for t in json.load(response) if t["type"] == "page")
            self.ws = self._stack.enter_context(connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=10))
        except BaseException:
            self.proc.kill()
            self.proc.wait()
            raise
        self.ids = itertools.count(1)
        self.events: list[dict] = []

    def _port(self, path: Path, timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().strip():
                return int(path.read_text().split()[0])
            if self.proc.poll() is not None:
                raise RuntimeError(f"chromium exited with {self.proc.returncode} before it listened")
            time.sleep(0.1)
        raise TimeoutError("chromium did not write DevToolsActivePort")

    def call(self, method: str, **params) -> dict:
        """Send one DevTools command; events that arrive meanwhile are kept in ``events``."""
        ident = next(self.ids)
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=30))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self.call("Page.enable")
        self.call("Network.enable")
        self.call("Page.navigate", url=url)
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            self.events.append(json.loads(self.ws.recv(timeout=30)))

    def requested_urls(self) -> list[str]:
        return [e["params"]["request"]["url"] for e in self.events if e.get("method") == "Network.requestWillBeSent"]

    def evaluate(self, expression: str):
        """The JSON value of a JavaScript expression in the page."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        """A PNG of the whole page, not only the window."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        shot = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True,
                         clip={"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1})
        path.write_bytes(base64.b64decode(shot["data"]))

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
