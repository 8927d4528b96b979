"""The lock's script calls go through the client's own connection pool, so the pool's
lifecycle is theirs: a connection the server closed is replaced before use, a
failover followed by ``pool.disconnect()`` moves them, the pool's bound counts them,
a connection that cannot be made leaves them on the ones that work, and an argument
the client cannot encode is a configuration error that uses up nothing.  They also
do what the client does on errors (re-send what its retry policy names, raise the
rest, never read a stale reply) and never cross a fork."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator

import pytest
import redis
import redis.backoff
import redis.retry
from dlock_helpers import wait_until

from celery_dlock import BackendUnavailable, InvalidLockConfig, RedisLock
from celery_dlock.backends.redis.renewal import renew_target
from celery_dlock.backends.redis.script_call import _packed
from celery_dlock.backends.redis.scripts import LuaScript
from celery_dlock.ops.embedded import EmbeddedRedis

#: redis-py 4 (the floors job) differs from later redis-py where these tests read it.
_REDIS_4 = int(redis.__version__.split(".")[0]) < 5

ECHO = LuaScript("echo_args", "return ARGV")


def _no_resends() -> redis.retry.Retry:
    return redis.retry.Retry(redis.backoff.NoBackoff(), 0)


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


@contextlib.contextmanager
def _restarted(server: EmbeddedRedis) -> Iterator[EmbeddedRedis]:
    """``server`` stopped and a new one started on its port (empty): every connection
    made before is closed by the server's side."""
    port = server.port
    server.stop()
    again = EmbeddedRedis(port=port).start()
    try:
        yield again
    finally:
        again.stop()


def _client(url: str, **options: object) -> redis.Redis:
    return redis.Redis.from_url(url, **options)  # type: ignore[arg-type]


def _others(admin: redis.Redis) -> list[dict[str, str]]:
    """The server's client connections but ``admin``'s own."""
    mine = admin.client_id()
    return [c for c in admin.client_list() if int(c["id"]) != mine]


# -- the pool's lifecycle ------------------------------------------------------------


@pytest.mark.parametrize("call", ["lock", "renewal"])
def test_the_first_call_after_a_server_restart_works_without_re_sends(own_server, prefix,
                                                                     name, call):
    """A client that never re-sends (``Retry(0)``, as renewal's own is) finds its idle
    connection closed by the restarted server: the pool replaces it before use, as it
    does for the application's own commands."""
    client = _client(own_server.url, socket_timeout=5, retry=_no_resends(),
                     retry_on_timeout=False)
    lock = RedisLock(client, name, ttl=30, prefix=prefix, owner="owner-a",
                     auto_renew=False)
    target = renew_target(client)
    assert lock.acquire(blocking=False)
    item = (lock.keys.lock, "owner-a", 30_000)
    assert target.renew([item]) == [1]  # renewal's connection is made
    lock.release()
    with _restarted(own_server):
        if call == "lock":
            assert lock.acquire(blocking=False)
        else:
            assert RedisLock(_client(own_server.url), name, ttl=30, prefix=prefix,
                             owner="owner-a", auto_renew=False).acquire(blocking=False)
            assert target.renew([item]) == [1]
            assert lock.acquire(blocking=False)  # re-enters the same hold
            lock.release()
        lock.release()
        assert lock.holder() is None
    client.close()


@pytest.mark.parametrize("old", ["still-a-master", "demoted-to-replica"])
def test_after_a_failover_and_pool_disconnect_the_scripts_follow(own_server, proxy,
                                                                 prefix, name, old):
    """The application's name for Redis (the proxy: a DNS name, a virtual IP) moves to
    a new server and the application calls ``pool.disconnect()``: the lock's scripts
    go to the new server too.  Left on the old one, they granted the lock a second
    time (the old server still a master) or failed READONLY until the process
    restarted (the old server a replica now)."""
    client = _client(proxy.url, socket_timeout=5)
    lock = RedisLock(client, name, ttl=30, prefix=prefix, owner="owner-a",
                     auto_renew=False)
    assert lock.acquire(blocking=False)  # the lock's connections are made
    lock.release()
    with EmbeddedRedis() as new:
        proxy.point_to(new.port)
        client.connection_pool.disconnect()
        if old == "demoted-to-replica":
            demoted = _client(own_server.url)
            demoted.replicaof(new.host, new.port)
            demoted.close()
        direct = _client(new.url)
        other = RedisLock(direct, name, ttl=30, prefix=prefix, owner="owner-x",
                          auto_renew=False)
        assert other.acquire(blocking=False)  # on the new server
        assert not lock.acquire(blocking=False)  # never two holders
        assert lock.last_holder is not None and lock.last_holder.owner == "owner-x"
        other.release()
        assert lock.acquire(blocking=False)  # the new server grants it
        assert direct.hget(lock.keys.lock, "owner") == b"owner-a"
        lock.release()
        direct.close()
    client.close()


@pytest.mark.skipif(_REDIS_4, reason="redis-py 4 re-sends a command after a timeout "
                    "only with retry_on_timeout=True, whatever set_retry() says")
def test_set_retry_and_close_reach_the_lock_calls(own_server, proxy, prefix, name):
    """``client.set_retry()`` after the lock's first calls governs its next ones (a
    reply lost on the way is re-sent, the operation id making it harmless), and
    ``client.close()`` leaves no connection of the lock's open."""
    admin = _client(own_server.url)
    client = _client(proxy.url, socket_timeout=0.5, retry=_no_resends())
    lock = RedisLock(client, name, ttl=30, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)  # the lock's connections are made
    lock.release()
    client.set_retry(redis.retry.Retry(redis.backoff.NoBackoff(), 2))
    dropped = proxy.drop_reply(b"EVALSHA")
    assert lock.acquire(blocking=False)  # its reply lost once, the call re-sent
    assert dropped.is_set()
    assert lock.holder() is not None and lock.holder().count == 1
    lock.release()
    client.close()
    assert wait_until(lambda: _others(admin) == [])
    admin.close()


def test_clients_sharing_a_pool_share_its_bound(own_server, prefix):
    """20 clients on one pool of ``max_connections=2``: the lock's calls take the
    pool's connections, so the server sees at most 2 and no client opens one of its
    own; renewal adds its own pool once for them all; ``pool.disconnect()`` closes
    the pool's."""
    admin = _client(own_server.url)
    made_before = int(admin.info("stats")["total_connections_received"])
    pool = redis.ConnectionPool.from_url(own_server.url, max_connections=2)
    clients = [redis.Redis(connection_pool=pool) for _ in range(20)]  # all kept
    for i, c in enumerate(clients):
        for _ in range(2):  # two lock cycles per client
            lock = RedisLock(c, f"shared-{i}", ttl=30, prefix=prefix, auto_renew=False)
            assert lock.acquire(blocking=False)
            lock.release()
    assert len(_others(admin)) <= 2
    made = int(admin.info("stats")["total_connections_received"]) - made_before
    assert made <= 3, made  # the pool's (at most 2) and admin's own INFO connection
    # Renewal has a pool of its own (at most 2 connections), one per shared pool, not
    # one per client.
    holds = [RedisLock(c, f"renewed-{i}", ttl=0.9, prefix=prefix)
             for i, c in enumerate(clients)]
    for lock in holds:
        assert lock.acquire(blocking=False)
    time.sleep(1.2)  # several renewal passes (every ttl / 3)
    assert not any(lock.lost for lock in holds)
    assert len(_others(admin)) <= 2 + 2
    for lock in holds:
        lock.release()
    pool.disconnect()
    assert wait_until(lambda: len(_others(admin)) <= 2)  # renewal's own, if any
    admin.close()


def test_a_connection_that_cannot_be_made_does_not_fail_an_acquire(own_server, prefix,
                                                                   name):
    """The server takes no more clients (``maxclients``); the client's pool has a
    connection that works, and the lock's calls use it."""
    admin = _client(own_server.url)
    client = _client(own_server.url, socket_timeout=5)
    assert client.ping()
    admin.config_set("maxclients", len(admin.client_list()))
    try:
        refused = _client(own_server.url, socket_timeout=5)
        with pytest.raises(redis.RedisError):
            refused.ping()
        refused.close()
        lock = RedisLock(client, name, ttl=30, prefix=prefix, auto_renew=False)
        assert lock.acquire(blocking=False)
        lock.release()
        assert lock.holder() is None
    finally:
        admin.config_set("maxclients", 10000)
        admin.close()
        client.close()


@pytest.mark.parametrize(("encoding", "field", "text"), [
    ("utf-8", "owner", "owner-\ud800"),
    ("utf-8", "info", "report-\ud800"),
    pytest.param("latin-1", "owner", "owner-€", marks=pytest.mark.skipif(
        _REDIS_4, reason="redis-py 4 sends every argument as UTF-8 whatever the "
                         "client's encoding: nothing to refuse")),
    pytest.param("latin-1", "info", "report-€", marks=pytest.mark.skipif(
        _REDIS_4, reason="redis-py 4 sends every argument as UTF-8 whatever the "
                         "client's encoding: nothing to refuse")),
])
def test_an_argument_that_cannot_be_encoded_is_invalid_lock_config(
        own_server, prefix, name, encoding, field, text):
    """An owner or metadata the client cannot encode is InvalidLockConfig (at
    declaration for UTF-8, the default; when sent for another encoding), however
    often it is tried: nothing is written, no connection is used up, and the client's
    next lock works."""
    admin = _client(own_server.url)
    client = _client(own_server.url, socket_timeout=5, encoding=encoding)
    options: dict[str, object] = (
        {"owner": text} if field == "owner" else {"info": {"task_name": text}})
    for _ in range(6):
        with pytest.raises(InvalidLockConfig):
            RedisLock(client, name, ttl=30, prefix=prefix, auto_renew=False,
                      **options).acquire(blocking=False)  # type: ignore[arg-type]
    assert admin.keys(f"{prefix}*") == []
    lock = RedisLock(client, name, ttl=30, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    assert len(_others(admin)) <= 1
    admin.close()
    client.close()


# -- what the client does on errors ----------------------------------------------------


@pytest.mark.parametrize("encoding", ["utf-8", "latin-1"])
def test_a_call_reaches_the_server_in_the_clients_encoding(redis_url, prefix, name,
                                                           encoding):
    # The server gets what the client's own HSET sends.
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
    client.close()


class _CountingCommands(redis.Redis):  # type: ignore[type-arg]
    calls = 0

    def execute_command(self, *args: object, **options: object) -> object:
        type(self).calls += 1
        return super().execute_command(*args, **options)


class _CountingEvalsha(redis.Redis):  # type: ignore[type-arg]
    calls = 0

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: object) -> object:
        type(self).calls += 1
        return super().evalsha(sha, numkeys, *keys_and_args)  # type: ignore[arg-type]


@pytest.mark.parametrize("kind", [_CountingCommands, _CountingEvalsha],
                         ids=["execute_command", "evalsha"])
def test_a_client_subclass_sees_every_script_call(redis_url, prefix, name, kind):
    """A subclass with its own ``execute_command`` or ``evalsha`` gets every call."""
    kind.calls = 0
    client = kind.from_url(redis_url)
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    lock.release()
    assert kind.calls >= 2  # acquire and release went through it
    client.close()


def test_a_wrapper_put_on_the_client_class_later_sees_every_script_call(
        redis_url, prefix, name, monkeypatch):
    """An instrumentation that wraps ``redis.Redis.execute_command`` after the lock's
    modules were imported (OpenTelemetry's does) still sees the lock's calls."""
    seen: list[object] = []
    stock = redis.Redis.execute_command

    def wrapped(self: redis.Redis, *args: object, **options: object) -> object:
        seen.append(args[0])
        return stock(self, *args, **options)

    client = _client(redis_url)
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)  # the lean path: nothing to see
    lock.release()
    assert seen == []
    monkeypatch.setattr(redis.Redis, "execute_command", wrapped)
    assert lock.acquire(blocking=False)
    lock.release()
    assert seen.count("EVALSHA") >= 2
    client.close()


@pytest.mark.skipif(_REDIS_4, reason="redis-py 4's script calls keep its own path "
                    "(backends/redis/script_call.py): nothing packed to compare")
@pytest.mark.parametrize(("encoding", "errors"),
                         [("utf-8", "strict"), ("latin-1", "strict"),
                          ("latin-1", "replace")])
def test_a_script_call_is_packed_as_redis_py_packs_it(encoding, errors):
    """The bytes sent for a script call are the bytes redis-py's own packer makes
    for the same command, whatever the arguments' types and the client's encoding
    and its errors setting."""
    import random

    class Text(str):
        pass

    conn = redis.Connection(encoding=encoding, encoding_errors=errors)
    top = 0x2FF if errors == "replace" else 0xFF  # beyond latin-1 only when replaced
    rng = random.Random(5)
    for _ in range(200):
        args: list[object] = ["EVALSHA", "ab" * 20, 1, f"dlock:{{k{rng.random()}}}"]
        for _ in range(rng.randint(0, 12)):
            text = "".join(chr(rng.randint(32, top)) for _ in range(rng.randint(1, 40)))
            raw = bytes(rng.randint(0, 255) for _ in range(rng.randint(0, 40)))
            args.append(rng.choice([
                rng.randint(-10**15, 10**15), rng.random() * 1e6, "", text,
                Text(text), raw, bytearray(raw), memoryview(raw),
                "x" * rng.randint(6000, 7000)]))
        theirs = b"".join(bytes(part) for part in conn.pack_command(*args))
        assert _packed(conn.encoder, args) == theirs, args


def test_a_connection_with_an_encoder_of_its_own_packs_with_it():
    """Arguments reach the server as the connection's own encoder (a subclass of
    redis-py's) makes them, also the strings the packer encodes itself for a stock
    encoder."""
    from redis.connection import Encoder

    class Upper(Encoder):
        def encode(self, value):
            return super().encode(value.upper() if isinstance(value, str) else value)

    conn = redis.Connection()
    conn.encoder = Upper(conn.encoder.encoding, conn.encoder.encoding_errors, False)
    assert _packed(conn.encoder, ["EVALSHA", "ab", 1, "k", 7]) == \
        b"*5\r\n$7\r\nEVALSHA\r\n$2\r\nAB\r\n$1\r\n1\r\n$1\r\nK\r\n$1\r\n7\r\n"


def test_a_value_the_client_cannot_send_is_refused_before_anything_is_sent(
        redis_url, prefix, name):
    client = _client(redis_url)
    with pytest.raises(redis.DataError):
        LuaScript("echo_b", "return ARGV")(client, (f"{prefix}:{name}",), (True,))
    assert client.ping()
    client.close()


def test_a_timed_out_call_leaves_no_stale_reply_for_the_next(own_server, prefix):
    """The first call times out while the server is stopped; its reply, sent once the
    server goes on, must not be read as the reply of a later call."""
    client = _client(own_server.url, socket_timeout=0.3, retry=_no_resends())
    assert ECHO(client, (f"{prefix}k",), ("warm",)) == [b"warm"]
    with _stopped(own_server), pytest.raises(redis.TimeoutError):
        ECHO(client, (f"{prefix}k",), ("late",))
    for i in range(3):
        assert ECHO(client, (f"{prefix}k",), (f"fresh{i}",)) == [f"fresh{i}".encode()]
    client.close()


def test_a_lock_call_that_times_out_is_backend_unavailable_and_the_next_works(
        own_server, prefix, name):
    client = _client(own_server.url, socket_timeout=0.3, retry=_no_resends())
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    with _stopped(own_server), pytest.raises(BackendUnavailable):
        lock.extend(10)
    assert lock.owned()
    lock.release()
    assert lock.holder() is None
    client.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_never_writes_on_its_parents_connection(redis_url, prefix, name):
    client = _client(redis_url)
    lock = RedisLock(client, name, ttl=10, prefix=prefix, auto_renew=False)
    assert lock.acquire(blocking=False)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the pool gives it connections of its own
        ok = False
        try:
            other = RedisLock(client, name + "-child", ttl=10, prefix=prefix,
                              auto_renew=False)
            ok = (other.acquire(blocking=False)
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
