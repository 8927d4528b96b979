"""Fixtures for the fault tests: the fault proxy in front of the test's own server
(``own_server``, from the root conftest), and a MariaDB server of a module's own."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from proxy import FaultProxy
from sql_dbs import MariaDBServer, start_mariadb

from celery_dlock.ops.embedded import EmbeddedRedis


@pytest.fixture
def proxy(own_server: EmbeddedRedis) -> Iterator[FaultProxy]:
    """The fault proxy in front of ``own_server``."""
    with FaultProxy(own_server.port) as p:
        yield p


@pytest.fixture(scope="module")
def shared_mariadb() -> Iterator[MariaDBServer]:
    """A MariaDB server for a module's tests that do not stop it."""
    server = start_mariadb()
    try:
        yield server
    finally:
        server.stop()
