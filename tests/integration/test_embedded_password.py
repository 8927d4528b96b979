"""EmbeddedRedis with a password: it becomes ready, and its url carries the password."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from celery_dlock.ops.embedded import EmbeddedRedis

PASSWORD = "s3cret p@ss/word:%"  # characters a URL must quote


def test_password_parameter_starts_an_authenticated_server() -> None:
    with EmbeddedRedis(password=PASSWORD, startup_timeout=5) as server:
        assert server.process is not None
        with redis.Redis.from_url(server.url) as client:
            assert client.ping()
        with redis.Redis(host=server.host, port=server.port) as anonymous, \
                pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in cmdline  # not visible in ps


def test_requirepass_in_extra_args_still_becomes_ready() -> None:
    server = EmbeddedRedis(extra_args=("--requirepass", "pw2"), startup_timeout=5)
    with server, redis.Redis(host=server.host, port=server.port,
                             password="pw2") as client:
        assert client.ping()
