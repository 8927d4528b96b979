"""Fixtures for the fault tests: the fault proxy in front of the test's own server
(``own_server``, from the root conftest)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxy import FaultProxy

from celery_dlock.ops.embedded import EmbeddedRedis


@pytest.fixture
def proxy(own_server: EmbeddedRedis) -> Iterator[FaultProxy]:
    """The fault proxy in front of ``own_server``."""
    with FaultProxy(own_server.port) as p:
        yield p
