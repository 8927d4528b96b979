"""Fixtures for the fault tests: a redis-server of the test's own (to stop, freeze or
reconfigure at will) and the fault proxy in front of it."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import pytest
from proxy import FaultProxy

from celery_dlock.ops.embedded import EmbeddedRedis


@pytest.fixture
def own_server() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test's own, to SIGSTOP or reconfigure at will."""
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        if server.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(server.process.pid, signal.SIGCONT)
        server.stop()


@pytest.fixture
def proxy(own_server: EmbeddedRedis) -> Iterator[FaultProxy]:
    """The fault proxy in front of ``own_server``."""
    with FaultProxy(own_server.port) as p:
        yield p
