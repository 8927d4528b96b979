"""The lock over TLS: ``rediss://host:port/0?ssl_ca_certs=CA`` (a CA and a server
certificate made with ``openssl`` for the test)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import redis
from celery import Celery
from servers import free_port, tls_unsupported
from task_helpers import check_runs, run_locked_task

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.config import get_client
from celery_dlock.embedded import EmbeddedRedis


def _make_certificates(directory: Path) -> None:
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True,
                       capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
        "-out", "ca.crt", "-days", "2", "-subj", "/CN=celery-dlock test CA")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key",
        "-out", "server.csr", "-subj", "/CN=localhost")
    (directory / "ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-days", "2", "-extfile", "ext", "-out", "server.crt")


@pytest.fixture(scope="module")
def tls() -> Iterator[SimpleNamespace]:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl binary to make a test certificate with")
    why = tls_unsupported()
    if why:
        pytest.skip(why)
    with tempfile.TemporaryDirectory(prefix="dlock-tls-") as tmp:
        directory = Path(tmp)
        _make_certificates(directory)
        port = free_port()
        server = EmbeddedRedis(extra_args=(
            "--tls-port", str(port), "--tls-cert-file", str(directory / "server.crt"),
            "--tls-key-file", str(directory / "server.key"),
            "--tls-ca-cert-file", str(directory / "ca.crt"),
            "--tls-auth-clients", "no"))
        server.start()
        try:
            yield SimpleNamespace(
                url=f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={directory / 'ca.crt'}",
                bare_url=f"rediss://127.0.0.1:{port}/0", plain=server.url)
        finally:
            server.stop()


def _app(url: str) -> Celery:
    app = Celery(f"dlt{uuid.uuid4().hex[:6]}", set_as_current=False)
    app.conf.dlock_url = url
    return app


def test_redis_lock_over_tls(tls):
    client = get_client(_app(tls.url))
    prefix = f"dlt{uuid.uuid4().hex[:8]}"
    a = RedisLock(client, "job", ttl=5, owner="A", prefix=prefix)
    b = RedisLock(client, "job", ttl=5, owner="B", prefix=prefix)
    with a:
        assert not b.acquire(blocking=False)
        plain = redis.Redis.from_url(tls.plain)
        assert plain.hget(a.keys.lock, "owner") == b"A"  # the same server
        plain.close()
        assert a.holder() is not None
    assert b.acquire(blocking=False)
    b.release()


def test_an_unknown_certificate_authority_is_refused(tls):
    client = get_client(_app(tls.bare_url))  # verifies against the system CAs
    with pytest.raises(BackendUnavailable) as caught:
        RedisLock(client, "job", ttl=5).acquire(blocking=False)
    assert "certificate" in str(caught.value).lower()


def test_locked_task_over_tls(tls, redis_url):
    probe = redis.Redis.from_url(tls.plain)
    try:
        check_runs(run_locked_task(redis_url, probe, dlock_url=tls.url))
    finally:
        probe.close()
