"""Script calls on a plain client's channel (``backends/redis/channel.py``): they
skip the client's pool, do what the client would do on errors (re-send what its retry
policy names, raise the rest, never read a stale reply), stay bounded, and are not used
for clients that are not exactly ``redis.Redis`` on a plain pool."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator

import pytest
import redis
import redis.backoff
import redis.retry
from celery_helpers import collect_garbage

from celery_dlock import BackendUnavailable, RedisLock
from celery_dlock.backends.redis.channel import CHANNEL_CONNECTIONS, channel_of
from celery_dlock.backends.redis.scripts import LuaScript
from celery_dlock.ops.embedded import EmbeddedRedis

ECHO = LuaScript("echo_args", "return ARGV")


@contextlib.contextmanager
def _stopped(server: EmbeddedRedis) -> Iterator[None]:
    """The server SIGSTOPped (its socket still accepts and buffers) until the block
    ends."""
    assert server.process is not None
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(server.process.pid, signal.SIGCONT)


def _client(url: str, **options: object) -> redis.Redis:
    return redis.Redis.from_url(url, **options)  # type: ignore[arg-type]


def test_a_plain_clients_scripts_skip_its_pool(redis_url, prefix, name):
    client = _client(redis_url)
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    for _ in range(5):
        assert lock.acquire(blocking=False)
        lock.release()
    channel = channel_of(client)
    assert channel is not None
    # The lock's other commands (the server check) went through the pool; not one of
    # the ten script calls took a connection of it beyond that first one.
    assert client.connection_pool._created_connections <= 1
    assert 1 <= channel._made <= CHANNEL_CONNECTIONS
    assert lock.holder() is None


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_call_reaches_the_server_in_the_clients_encoding(redis_url, prefix, name,
                                                           encoding):
    # The channel packs a call itself only where its bytes are the ones redis-py
    # sends (resp.pack); a client of another encoding has redis-py pack it.  Either
    # way the server gets what the client's own HSET sends.
    client = _client(redis_url, encoding=encoding)
    reader = _client(redis_url)
    client.hset(f"{prefix}:probe:{name}", "f", "rapport_été")
    sent = reader.hget(f"{prefix}:probe:{name}", "f")
    assert sent is not None
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False,
                     info={"task_name": "rapport_été"})
    assert lock.acquire(blocking=False)
    try:
        assert reader.hget(lock.keys.lock, "task_name") == sent
    finally:
        lock.release()
        reader.delete(f"{prefix}:probe:{name}")
        reader.close()
    channel = channel_of(client)
    assert channel is not None and channel._packs is (encoding == "utf-8")
    client.close()


@pytest.mark.parametrize("kind", ["subclass", "single_connection"])
def test_clients_it_cannot_speak_for_have_no_channel(redis_url, prefix, name, kind):
    class Counting(redis.Redis):  # type: ignore[type-arg]
        calls = 0

        def execute_command(self, *args: object, **options: object) -> object:
            Counting.calls += 1
            return super().execute_command(*args, **options)

    if kind == "subclass":
        client = Counting.from_url(redis_url)
    else:
        client = redis.Redis.from_url(redis_url, single_connection_client=True)
    assert channel_of(client) is None
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    if kind == "subclass":
        assert Counting.calls >= 2  # acquire and release went through it
    client.close()


def test_a_timed_out_call_leaves_no_stale_reply_for_the_next(own_server, prefix):
    """The first call times out while the server is stopped; its reply, sent once the
    server goes on, must not be read as the reply of a later call."""
    client = _client(own_server.url, socket_timeout=0.3,
                     retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    assert ECHO(client, (f"{prefix}k",), ("warm",)) == [b"warm"]
    with _stopped(own_server), pytest.raises(redis.TimeoutError):
        ECHO(client, (f"{prefix}k",), ("late",))
    for i in range(CHANNEL_CONNECTIONS + 1):  # every connection of the channel
        assert ECHO(client, (f"{prefix}k",), (f"fresh{i}",)) == [f"fresh{i}".encode()]
    client.close()


def test_a_lock_call_that_times_out_is_backend_unavailable_and_the_next_works(
        own_server, prefix, name):
    client = _client(own_server.url, socket_timeout=0.3,
                     retry=redis.retry.Retry(redis.backoff.NoBackoff(), 0))
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    with _stopped(own_server), pytest.raises(BackendUnavailable):
        lock.extend(10)
    assert lock.owned()
    lock.release()
    assert lock.holder() is None
    client.close()


def test_calls_beyond_its_connections_go_through_the_client(own_server, prefix):
    client = _client(own_server.url, socket_timeout=10)
    calls = CHANNEL_CONNECTIONS * 2
    replies: list[bytes] = []

    def call(i: int) -> None:
        replies.extend(ECHO(client, (f"{prefix}k",), (f"r{i}",)))

    threads = [threading.Thread(target=call, args=(i,)) for i in range(calls)]
    with _stopped(own_server):  # every call waits for its reply at the same time
        for t in threads:
            t.start()
        time.sleep(0.5)
    for t in threads:
        t.join(10)
    assert sorted(replies) == sorted(f"r{i}".encode() for i in range(calls))
    channel = channel_of(client)
    assert channel is not None and channel._made == CHANNEL_CONNECTIONS
    assert client.connection_pool._created_connections >= 1  # the overflow
    client.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_writes_on_its_parents_connection(redis_url, prefix, name):
    client = _client(redis_url)
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    parent_channel = channel_of(client)
    assert parent_channel is not None
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its own channel, its own connection
        ok = False
        try:
            child_channel = channel_of(client)
            other = RedisLock(client, name + "-child", ttl=10, prefix=prefix,
                              auto_renew=False)
            ok = (child_channel is not parent_channel and other.acquire(blocking=False)
                  and not RedisLock(client, name, ttl=10, prefix=prefix,
                                    auto_renew=False).acquire(blocking=False))
            other.release()
        finally:
            os.write(write, b"1" if ok else b"0")
            os._exit(0)
    os.close(write)
    assert os.read(read, 1) == b"1"
    os.close(read)
    os.waitpid(pid, 0)
    # The parent's connection was not touched: its next replies are its own.
    lock.release()
    assert lock.holder() is None
    assert ECHO(client, (f"{prefix}k",), ("after",)) == [b"after"]
    client.close()


def test_a_collected_client_closes_its_channels_connections(redis_url, prefix):
    client = _client(redis_url)
    assert ECHO(client, (f"{prefix}k",), ("x",)) == [b"x"]
    channel = channel_of(client)
    assert channel is not None and channel._idle
    conn = channel._idle[0]
    assert conn._sock is not None
    del client
    collect_garbage()
    assert not channel._idle and conn._sock is None
