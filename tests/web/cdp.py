"""A headless Chromium driven through its DevTools protocol over a pipe
(``--remote-debugging-pipe``: JSON messages ended by NUL on file descriptors 3 and 4),
so the browser tests need Debian's ``chromium`` and nothing else: no driver binary,
no websocket client.

Every wait is bounded; a browser that does not answer fails the test with the
command it did not answer."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["Browser", "chromium_binary"]

#: Seconds any one protocol command may take (a loaded two-core machine).
COMMAND_TIMEOUT = 30.0


def chromium_binary() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """One headless Chromium with one page."""

    def __init__(self, binary: str) -> None:
        self._dir = tempfile.mkdtemp(prefix="dlock-chromium-")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()

        def fds() -> None:  # in the child: the pipe ends where Chromium looks
            # (copied first: a pipe end already at 3 or 4 would stay close-on-exec)
            read_end, write_end = os.dup(to_browser_r), os.dup(from_browser_w)
            os.dup2(read_end, 3)
            os.dup2(write_end, 4)

        self.proc = subprocess.Popen(
            [binary, "--headless", "--no-sandbox", "--disable-gpu",
             "--disable-dev-shm-usage", "--no-first-run", "--no-default-browser-check",
             "--disable-extensions", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--mute-audio",
             "--hide-scrollbars", "--window-size=1280,860",
             f"--user-data-dir={self._dir}", "--remote-debugging-pipe",
             "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL, close_fds=False, preexec_fn=fds)  # noqa: PLW1509
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._next = 0
        self._replies: dict[int, dict[str, Any]] = {}
        self._cond = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        targets = self.send("Target.getTargets")["targetInfos"]
        page = next(t for t in targets if t["type"] == "page")
        self._session = self.send("Target.attachToTarget", targetId=page["targetId"],
                                  flatten=True)["sessionId"]
        self.page("Page.enable")
        self.page("Runtime.enable")

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self._from_browser, 65536)
            except OSError:
                chunk = b""
            if not chunk:
                with self._cond:
                    self._closed = True
                    self._cond.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                message = json.loads(raw)
                if "id" in message:
                    with self._cond:
                        self._replies[message["id"]] = message
                        self._cond.notify_all()

    def send(self, method: str, session: str | None = None, **params: Any
             ) -> dict[str, Any]:
        with self._cond:
            self._next += 1
            ident = self._next
        message: dict[str, Any] = {"id": ident, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._to_browser, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + COMMAND_TIMEOUT
        with self._cond:
            while ident not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or self._closed:
                    raise TimeoutError(f"Chromium did not answer {method}")
                self._cond.wait(left)
            reply = self._replies.pop(ident)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    def page(self, method: str, **params: Any) -> dict[str, Any]:
        return self.send(method, self._session, **params)

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page."""
        reply = self.page("Runtime.evaluate", expression=expression,
                          returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in reply:
            raise RuntimeError(f"{expression}: {reply['exceptionDetails']}")
        return reply["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 20.0) -> Any:
        """Poll ``expression`` until it is truthy (its value), or fail."""
        deadline = time.monotonic() + timeout
        value = None
        while time.monotonic() < deadline:
            with contextlib.suppress(RuntimeError):
                value = self.eval(expression)
                if value:
                    return value
            time.sleep(0.1)
        raise AssertionError(f"not true within {timeout}s: {expression} (last: "
                             f"{value!r})")

    def go(self, url: str) -> None:
        """Load ``url`` and wait until it is loaded."""
        self.eval("window.__dlock_loaded = false")
        self.page("Page.navigate", url=url)
        self.wait_load()

    def wait_load(self) -> None:
        """Wait for a new document (one without the mark the last one had) to load."""
        self.wait_for("document.readyState === 'complete' && "
                      "window.__dlock_loaded === undefined && "
                      "(window.__dlock_loaded = true)")

    def text(self) -> str:
        return str(self.eval("document.body ? document.body.innerText : ''"))

    def screenshot(self) -> bytes:
        data = self.page("Page.captureScreenshot", format="png",
                         captureBeyondViewport=False)["data"]
        return base64.b64decode(data)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.send("Browser.close")
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        os.close(self._to_browser)
        self._reader.join(5)
        os.close(self._from_browser)
        shutil.rmtree(self._dir, ignore_errors=True)


@contextlib.contextmanager
def browser(binary: str) -> Iterator[Browser]:
    b = Browser(binary)
    try:
        yield b
    finally:
        b.close()
