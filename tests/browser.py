"""Headless Chromium driven over the DevTools protocol, for checking reports/index.html as a browser shows it.

Chromium (Debian's package `chromium`, installed by ./setup.sh) talks the
DevTools protocol over a pipe (`--remote-debugging-pipe`: it reads commands on
fd 3 and writes answers on fd 4, each a JSON message ended by a NUL byte), so
no port is opened and no websocket or driver package is needed. The network is
switched off in the page (`Network.emulateNetworkConditions`, offline) before it
loads, and every request the page makes is recorded: a self-contained report
makes none but its own file and its data: images (Chromium lists those as requests too).
"""

from __future__ import annotations

import base64
import json
import os
import queue
import shutil
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
TIMEOUT_S = 60.0  # a page load or a command; Chromium's start on 2 busy cores takes a few seconds


def find_chromium() -> str | None:
    """The Chromium binary on PATH (GR2_CHROMIUM overrides), or None."""
    if env := os.environ.get("GR2_CHROMIUM"):
        return env
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


@dataclass
class PageCheck:
    """What one page load showed: its requests, failed loads, images and a full-page screenshot (PNG bytes)."""

    requests: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)  # "url: error" of every failed load (and HTTP >= 400)
    images: list[dict[str, Any]] = field(default_factory=list)  # {alt, src (first 40 chars), width, height, complete}
    screenshot: bytes = b""
    title: str = ""


class Chromium:
    """One headless Chromium process; `check(path)` loads a local page with the network off."""

    def __init__(self, binary: str, profile_dir: Path) -> None:
        args = [
            binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--no-default-browser-check",
            "--disable-extensions", "--disable-background-networking", "--disable-sync", "--disable-component-update",
            "--hide-scrollbars", "--mute-audio", f"--user-data-dir={profile_dir}", "--remote-debugging-pipe",
        ]  # fmt: skip
        # fd 3 (Chromium reads) is our stdin pipe, fd 4 (Chromium writes) our stdout pipe.
        self.proc = subprocess.Popen(
            ["sh", "-c", 'exec "$0" "$@" 3<&0 4>&1 </dev/null >/dev/null', *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        self._next_id = 0
        self._replies: dict[int, queue.Queue[dict[str, Any]]] = {}
        self._events: queue.Queue[dict[str, Any]] = queue.Queue()
        self._lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        buf = b""
        while chunk := self.proc.stdout.read1(65536):
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self._lock:
                        q = self._replies.get(msg["id"])
                    if q is not None:
                        q.put(msg)
                else:
                    self._events.put(msg)
        self._events.put({"method": "_closed"})

    def send(self, method: str, params: dict[str, Any] | None = None, session: str | None = None) -> dict[str, Any]:
        """One DevTools command; its result, or RuntimeError with Chromium's error."""
        with self._lock:
            self._next_id += 1
            msg_id = self._next_id
            self._replies[msg_id] = q = queue.Queue()
        msg: dict[str, Any] = {"id": msg_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(msg).encode() + b"\0")
        self.proc.stdin.flush()
        try:
            reply = q.get(timeout=TIMEOUT_S)
        except queue.Empty:
            raise RuntimeError(f"chromium: no answer to {method} in {TIMEOUT_S:.0f} s") from None
        if "error" in reply:
            raise RuntimeError(f"chromium: {method}: {reply['error']}")
        return reply.get("result", {})

    def check(self, page: Path, width: int = 1280, height: int = 900) -> PageCheck:
        """Load `page` from disk with the network off; requests, failures, image sizes and a screenshot."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for method in ("Network.enable", "Page.enable", "Runtime.enable"):
            self.send(method, session=session)
        self.send("Network.emulateNetworkConditions", {"offline": True, "latency": 0, "downloadThroughput": -1, "uploadThroughput": -1}, session)
        self.send("Emulation.setDeviceMetricsOverride", {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}, session)
        out = PageCheck()
        urls: dict[str, str] = {}
        self.send("Page.navigate", {"url": page.resolve().as_uri()}, session)
        while True:
            try:
                ev = self._events.get(timeout=TIMEOUT_S)
            except queue.Empty:
                raise RuntimeError(f"chromium: {page} did not finish loading in {TIMEOUT_S:.0f} s") from None
            method, params = ev.get("method"), ev.get("params", {})
            if method == "_closed":
                raise RuntimeError("chromium exited while loading the page")
            if ev.get("sessionId") != session:
                continue
            if method == "Network.requestWillBeSent":
                urls[params["requestId"]] = params["request"]["url"]
                out.requests.append(params["request"]["url"])
            elif method == "Network.loadingFailed":
                out.failed.append(f"{urls.get(params['requestId'], '?')}: {params.get('errorText')}")
            elif method == "Network.responseReceived" and int(params["response"].get("status") or 0) >= 400:
                out.failed.append(f"{params['response']['url']}: HTTP {params['response']['status']}")
            elif method == "Page.loadEventFired":
                break
        js = (
            "JSON.stringify({title: document.title, images: Array.from(document.images).map(i => ({alt: i.alt, "
            "src: i.getAttribute('src').slice(0, 40), width: i.naturalWidth, height: i.naturalHeight, complete: i.complete}))})"
        )
        found = json.loads(self.send("Runtime.evaluate", {"expression": js, "returnByValue": True}, session)["result"]["value"])
        out.title, out.images = found["title"], found["images"]
        size = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": width, "height": min(int(size["height"]), 16000), "scale": 1}
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True, "clip": clip}, session)
        out.screenshot = base64.b64decode(shot["data"])
        self.send("Target.closeTarget", {"targetId": target})
        return out

    def close(self) -> None:
        """Ask Chromium to quit, then wait for it (killed by its pid if it does not)."""
        try:  # no waiting for the answer: Chromium may close the pipe before it sends one
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"id": 0, "method": "Browser.close"}).encode() + b"\0")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
