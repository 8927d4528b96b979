"""Fixtures of the web page's tests: the page served on a free loopback port (the
standard library's server in a thread, as ``celery dlock web`` serves it), and a
headless Chromium (skipped, saying why, when none is installed)."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from cdp import Browser, chromium_binary
from celery import Celery

from celery_dlock.ops.web import make_app
from celery_dlock.ops.web.command import serve


class Served:
    """A page being served: its base URL and the app behind it."""

    def __init__(self, url: str, app: Any) -> None:
        self.url = url
        self.app = app


@pytest.fixture
def web_prefix() -> str:
    return f"web{uuid.uuid4().hex[:8]}"


@pytest.fixture
def serve_page() -> Iterator[Callable[..., Served]]:
    """``serve_page(store_url, prefix, token=None, **conf)``: the page of that store,
    served until the test ends."""
    servers: list[Any] = []

    def start(store_url: str, prefix: str, token: str | None = None,
              refresh: float = 5.0, **conf: Any) -> Served:
        app = Celery("webtest", set_as_current=False)
        app.conf.update(dlock_url=store_url, dlock_key_prefix=prefix,
                        broker_url="memory://", **conf)
        web = make_app(app, token=token, refresh=refresh)
        server = serve(web, "127.0.0.1", 0)
        thread = threading.Thread(target=server.serve_forever,
                                  kwargs={"poll_interval": 0.1}, daemon=True)
        thread.start()
        servers.append((server, thread, web))
        return Served(f"http://127.0.0.1:{server.server_port}/", web)

    yield start
    for server, thread, web in servers:
        server.shutdown()
        server.server_close()
        thread.join(10)
        web.target.close()


@pytest.fixture
def browser() -> Iterator[Browser]:
    binary = chromium_binary()
    if binary is None:
        pytest.skip("no Chromium to drive: apt-get install chromium")
    b = Browser(binary)
    try:
        yield b
    finally:
        b.close()
