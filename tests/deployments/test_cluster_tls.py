"""A Redis Cluster over TLS: ``rediss+cluster://host:port/0?ssl_ca_certs=CA``.

Three masters whose clients and cluster bus speak TLS (certificates made with
``openssl``); the lock and LockedTask reach it through the documented URL spelling,
and the cluster tells a TLS client the nodes' TLS ports, so every master is reached
over TLS.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from celery_helpers import close_app, test_app
from servers import Cluster, make_certificates, supports_cluster, tls_unsupported
from task_helpers import check_runs, run_locked_task

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.backends.redis.keyspace import LockKeys
from celery_dlock.task.config import get_client


@pytest.fixture(scope="module")
def tls_cluster() -> Iterator[SimpleNamespace]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a test certificate with")
    why = tls_unsupported() or supports_cluster()
    if why:
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="dlock-tlsc-") as tmp:
        certificates = Path(tmp)
        make_certificates(certificates)
        cluster = Cluster(masters=3, certificates=certificates).start()
        ca = certificates / "ca.crt"
        try:
            yield SimpleNamespace(
                cluster=cluster,
                url=f"rediss+cluster://127.0.0.1:{cluster.tls_ports[0]}/0?ssl_ca_certs={ca}",
                bare_url=f"rediss+cluster://127.0.0.1:{cluster.tls_ports[0]}/0")
        finally:
            cluster.stop()


def _app(url: str) -> Celery:
    return test_app(f"dltc{uuid.uuid4().hex[:6]}", dlock_url=url)


def _names_on_every_master(client: redis.cluster.RedisCluster, prefix: str) -> list[str]:
    """Lock names whose keys land on three different masters."""
    by_node: dict[str, str] = {}
    for i in range(500):
        name = f"job-{i}"
        node = client.get_node_from_key(LockKeys.for_name(prefix, name).lock)
        by_node.setdefault(node.name, name)
        if len(by_node) == 3:
            return list(by_node.values())
    raise AssertionError(f"500 names landed on only {sorted(by_node)}")


def test_the_url_gives_a_cluster_client_that_speaks_tls_to_every_master(tls_cluster):
    app = _app(tls_cluster.url)
    try:
        client = get_client(app)
        assert isinstance(client, redis.cluster.RedisCluster)
        ports = sorted(node.port for node in client.get_primaries())
        assert ports == sorted(tls_cluster.cluster.tls_ports)
        for node in client.get_primaries():
            kwargs = node.redis_connection.connection_pool.connection_kwargs
            assert kwargs.get("ssl_ca_certs"), node.name
    finally:
        close_app(app)


def test_locks_on_every_master_exclude_another_owner(tls_cluster, prefix):
    app = _app(tls_cluster.url)
    try:
        client = get_client(app)
        names = _names_on_every_master(client, prefix)
        plain = tls_cluster.cluster.client(socket_timeout=5)
        for name in names:
            a = RedisLock(client, name, ttl=5, owner="A", prefix=prefix)
            b = RedisLock(client, name, ttl=5, owner="B", prefix=prefix)
            with a:
                assert not b.acquire(blocking=False)
                holder = a.holder()
                assert holder is not None and holder.owner == "A"
                # the hold is on the cluster itself, seen in the clear as well
                assert plain.hget(a.keys.lock, "owner") == b"A"
            assert b.acquire(blocking=False)
            b.release()
        plain.close()
    finally:
        close_app(app)


def test_an_unknown_certificate_authority_is_refused(tls_cluster):
    app = _app(tls_cluster.bare_url)  # verifies against the system CAs
    try:
        with pytest.raises(BackendUnavailable) as caught:
            RedisLock(get_client(app), "job", ttl=5).acquire(blocking=False)
        assert "certificate" in str(caught.value).lower()
    finally:
        close_app(app)


def test_locked_task_over_a_tls_cluster(tls_cluster, redis_url):
    probe = tls_cluster.cluster.client(socket_timeout=5)
    try:
        check_runs(run_locked_task(redis_url, probe, dlock_url=tls_cluster.url))
    finally:
        probe.close()
