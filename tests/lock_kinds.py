"""Every kind of lock, as one parameter: tests of the lock's contract take the
``lock_kind`` fixture and run once per kind (a new backend adds one entry here).

A :class:`LockKind` makes locks (``kind.make(name, ttl=..., **options)``) and gives the
tests the handles a fault needs: the clients of every server that keeps the lock,
``lose_data(lock)`` (every server forgets the lock, as an empty restart would) and
``force_release(name)`` (what an operator's ``celery dlock release --force`` does).

The tests read a lock's state with Redis commands on ``kind.server`` and
``lock.keys``; a kind whose server is not a Redis answers the same reads from its own
storage (:class:`PgView`: a PostgreSQL lease row seen as the lock's hash), so every
contract test runs on it unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis
from sql_view import SqlView

from celery_dlock import FencingUnavailable, RedisLock, RedisSemaphore, RedlockLock
from celery_dlock.ops.embedded import EmbeddedRedis

__all__ = ["KINDS", "NO_FENCE", "NO_KEYS", "NO_LINE", "NO_LONGER_SESSION",
           "ONE_SERVER_KINDS", "LockKind", "OneServerKind", "PgView", "lose_lock_data",
           "postgres_server", "redlock_servers"]

#: The kinds of lock every lock-contract test runs on ("semaphore": a RedisSemaphore
#: of one slot, which behaves as a lock; "pg_semaphore": a PostgreSQL semaphore of one
#: slot, the slot rows every SQL dialect shares, without a line of waiters).
#: ``$DLOCK_LOCK_KINDS`` (comma-separated) narrows them: CI's reruns of the lock core
#: on other Redis servers name only the kinds those servers keep.
_ALL_KINDS = ("redis", "redlock", "semaphore", "postgres", "pg_semaphore", "mysql",
              "zookeeper")
KINDS = tuple(k for k in _ALL_KINDS
              if k in (os.environ.get("DLOCK_LOCK_KINDS") or ",".join(_ALL_KINDS))
              .split(","))

#: Why a fencing test is skipped on a kind without fencing tokens (docs/deployments.md).
NO_FENCE = ("Redlock gives no fencing token (each node counts on its own; fence raises "
            "FencingUnavailable): docs/deployments.md, Redlock")
#: Why a test that lengthens a hold past its ttl, or holds one for a month, is skipped
#: on ZooKeeper (docs/backends.md).
NO_LONGER_SESSION = ("ZooKeeper: a hold lives as long as its session, whose timeout (the "
                     "lock's ttl, at most 24.8 days) is fixed when the session is made: "
                     "extend cannot lengthen it: docs/backends.md, ZooKeeper")
#: Why a test of the line of waiters is skipped on Redlock (docs/deployments.md).
NO_LINE = ("Redlock has no line of waiters: a blocked acquire tries again after a random "
           "delay, not woken in turn by a release: docs/deployments.md, Redlock")

#: Why a test of foreign data at a lock's key is skipped on the SQL kinds: their locks
#: are rows of one table; another application's data there is a table of another
#: shape (docs/backends.md, Errors; tests/faults/test_sql_faults.py).
NO_KEYS = ("PostgreSQL and MySQL keep no key per lock: another application's data is a "
           "table at the lease table's name, tested in tests/faults/"
           "test_sql_faults.py::"
           "test_another_applications_table_at_our_name_is_a_conflict "
           "(docs/backends.md, Errors)")


@dataclass
class LockKind:
    """One kind of lock, with its servers' clients."""

    name: str
    clients: list[redis.Redis]
    factory: Callable[..., Any]
    #: Whether ``fence`` gives fencing tokens on this kind.
    fences: bool
    #: The servers' URLs, for a child process to make its own locks of this kind.
    urls: list[str] = dataclasses.field(default_factory=list)

    #: Wraps a client of one of its servers for the reads a test makes (a
    #: semaphore keeps its holds beside its key: :class:`SemaphoreView`).
    view: Callable[[Any], Any] = lambda client: client

    @property
    def server(self) -> Any:
        """Where a test reads the lock's keys: the one server, or on a kind with
        several, what a majority of them says (a Redlock call returns once a quorum
        confirmed it; the other nodes follow a moment later)."""
        if len(self.clients) == 1:
            return self.view(self.clients[0])
        return QuorumView(self.clients)

    def make(self, lock_name: str, ttl: float = 30.0, **options: Any) -> Any:
        return self.factory(lock_name, ttl, **options)

    def fence_of(self, lock: Any) -> int | None:
        """``lock.fence`` on a kind that fences; None on one that does not, after
        checking that its ``fence`` raises :class:`FencingUnavailable` as documented."""
        if self.fences:
            return lock.fence  # type: ignore[no-any-return]
        with pytest.raises(FencingUnavailable):
            _ = lock.fence
        return None

    def gone_everywhere(self, key: str) -> bool:
        """Whether no server of this kind has ``key`` (an expired hold's hash)."""
        return not any(c.exists(key) for c in self.clients)

    def lose_data(self, lock: Any) -> None:
        """Every server forgets everything it had of ``lock``: its hold, its fence
        counter, its line (what an empty restart, or a failover to a replica that
        missed the writes, does to it; the servers may be shared with other tests, so
        nothing else is touched)."""
        self._settle(lock.keys.lock)
        lose_lock_data(self.clients, lock.keys.lock)

    def drop_hold(self, lock: Any) -> None:
        """Every server forgets ``lock``'s hold (its hash) and nothing else: its fence
        counter and line stay, as when the key is deleted by hand or evicted."""
        self._settle(lock.keys.lock)
        for c in self.clients:
            c.delete(lock.keys.lock)

    def force_release(self, lock_name: str, prefix: str = "dlock") -> None:
        """Free ``lock_name`` on every server whoever holds it (an operator's
        ``celery dlock release --force``)."""
        from celery_dlock.backends.redis.inspect import force_release
        from celery_dlock.backends.redis.keyspace import LockKeys

        self._settle(LockKeys.for_name(prefix, lock_name).lock)
        for c in self.clients:
            force_release(c, prefix, lock_name)

    def _settle(self, key: str, timeout: float = 2.0) -> None:
        """Let a just-granted hold reach every server first: a Redlock acquire returns
        at its quorum, and its call to the last node may land a moment later (after a
        fault the test stages now, which would then look like a new hold)."""
        if len(self.clients) < 2:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and \
                not all(c.exists(key) for c in self.clients):
            time.sleep(0.01)

    @property
    def has_line(self) -> bool:
        """Whether blocked acquirers of this kind keep a FIFO line in the server."""
        return self.name in ("redis", "semaphore", "zookeeper", "postgres", "mysql")

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class PgKeys:
    """A SQL lock's "keys" as the tests name them: ``lock`` is its row, ``queue`` and
    ``leases`` its rows in the line table, a doorbell nothing (there are none)."""

    lock: str

    @classmethod
    def for_name(cls, prefix: str, name: str) -> PgKeys:
        return cls(json.dumps([prefix, name]))

    @property
    def queue(self) -> str:
        return self.lock + ":queue"

    @property
    def leases(self) -> str:
        return self.lock + ":leases"

    def doorbell(self, owner: str) -> str:
        return self.lock + ":doorbell:" + owner


class PgView(SqlView):
    """:class:`~sql_view.SqlView` on the PostgreSQL tables (a row keyed by prefix and
    name, or their digests: celery_dlock/backends/sql/postgres/keys.py)."""

    def __init__(self, url: str) -> None:
        import psycopg

        self.url = url
        self.conn = psycopg.connect(url, autocommit=True)

    @staticmethod
    def _row(prefix: str, name: str) -> tuple[str, str]:
        # a name PostgreSQL cannot index as it is is keyed by its digest
        from celery_dlock.backends.sql.postgres.keys import row_key

        return row_key(prefix, name)

    def _line(self, key: str) -> list[tuple[str, int, int]] | None:
        found = self._line_key(key)
        if found is None:
            return None
        rows = self.conn.execute(
            "SELECT owner, floor(extract(epoch FROM arrived_at) * 1000000)::bigint, "
            "floor(extract(epoch FROM expires_at) * 1000)::bigint "
            f"FROM {self.LINE} WHERE prefix = %s AND name = %s "
            "AND expires_at > clock_timestamp() ORDER BY arrived_at, owner",
            found).fetchall()
        return [(str(o), int(a), int(e)) for o, a, e in rows]

    def _line_rows(self, key: str) -> int:
        found = self._line_key(key)
        if found is None:
            return 0
        row = self.conn.execute(f"SELECT count(*) FROM {self.LINE} WHERE prefix = %s "
                                "AND name = %s", found).fetchone()
        return int(row[0]) if row is not None else 0

    def _hold(self, key: str) -> dict[str, Any] | None:
        found = self._row_key(key)
        if found is None:
            return None
        row = self.conn.execute(
            "SELECT owner, count, fence, info, ttl_ms, "
            "floor(extract(epoch FROM acquired_at) * 1000)::bigint, "
            "floor(extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint "
            "FROM dlock_locks WHERE prefix = %s AND name = %s AND owner IS NOT NULL "
            "AND expires_at > clock_timestamp()", found).fetchone()
        if row is None:
            return None
        owner, count, fence, info, ttl, acquired_at, pttl = row
        return {"owner": owner, "count": count, "fence": fence, "ttl": ttl,
                "acquired_at": acquired_at, **(info or {}), "pttl": max(int(pttl), 1)}

    def delete(self, *keys: str) -> int:
        """Forget the holds (their fence counters stay, as a deleted hash's do)."""
        done = 0
        for key in keys:
            found = self._row_key(key)
            if found is not None:
                done += self.conn.execute(
                    "UPDATE dlock_locks SET owner = NULL, count = 0, "
                    "expires_at = '-infinity' WHERE prefix = %s AND name = %s "
                    "AND owner IS NOT NULL", found).rowcount
        return done

    def lose(self, key: str) -> None:
        """Forget the row, fence counter and all (an empty restart of the server)."""
        found = self._row_key(key)
        if found is not None:
            self.conn.execute("DELETE FROM dlock_locks WHERE prefix = %s AND name = %s",
                              found)
            self.conn.execute(f"DELETE FROM {self.LINE} WHERE prefix = %s "
                              "AND name = %s", found)

    def close(self) -> None:
        self.conn.close()


class PgKind(LockKind):
    """The PostgreSQL kind: its one "client" is a :class:`PgView`."""

    def lose_data(self, lock: Any) -> None:
        self.clients[0].lose(lock.keys.lock)  # type: ignore[attr-defined]

    def force_release(self, lock_name: str, prefix: str = "dlock") -> None:
        from celery_dlock.backends.sql.postgres.backend import PostgresBackend

        PostgresBackend(self.urls[0]).force_release(prefix, lock_name)


class QuorumView:
    """The reads the tests make (``exists``, ``hget``, ``hgetall``, ``pttl``,
    ``zrange``), answered as a majority of ``clients`` has the key."""

    def __init__(self, clients: list[redis.Redis]) -> None:
        self.clients = clients

    def _landed(self, timeout: float = 2.0) -> None:
        """Let the node calls already sent land first: a Redlock operation returns at
        its quorum, and its calls to the other nodes may still be on their way (two
        releases in a row can each leave a different node behind for a moment)."""
        from celery_dlock.backends.redis.redlock.workers import calls_in_flight

        deadline = time.monotonic() + timeout
        while calls_in_flight() and time.monotonic() < deadline:
            time.sleep(0.005)

    def _agreed(self, read: Callable[[redis.Redis], Any]) -> Any:
        self._landed()
        values = [read(c) for c in self.clients]
        for value in values:
            if values.count(value) > len(values) // 2:
                return value
        raise AssertionError(f"no majority of the servers agrees: {values!r}")

    def exists(self, *keys: str) -> Any:
        return self._agreed(lambda c: c.exists(*keys))

    def hget(self, key: str, field: str) -> Any:
        return self._agreed(lambda c: c.hget(key, field))

    def hgetall(self, key: str) -> Any:
        return self._agreed(lambda c: c.hgetall(key))

    def zrange(self, key: str, start: int, end: int) -> Any:
        return self._agreed(lambda c: c.zrange(key, start, end))

    def pttl(self, key: str) -> int:
        """The median: a value of the majority (theirs differ by the time between
        the reads)."""
        self._landed()
        values = sorted(int(c.pttl(key)) for c in self.clients)
        return values[len(values) // 2]


class SemaphoreView:
    """A client of a semaphore's server, answering the reads the lock tests make of
    ``lock.keys.lock`` (a lock's hash) from the hash of the semaphore's only holder
    (its key is a sorted set of holders; each hold is a hash beside it)."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.client, attr)

    def _hold_key(self, key: str) -> str | None:
        if self.client.type(key) != b"zset":
            return key
        from celery_dlock.backends.redis.keyspace import LockKeys

        members = self.client.zrange(key, 0, -1)
        if len(members) != 1:
            return None
        return LockKeys(key, "", "", "", "", "").holder(members[0].decode())

    def hget(self, key: str, field: str) -> Any:
        hold = self._hold_key(key)
        return None if hold is None else self.client.hget(hold, field)

    def hgetall(self, key: str) -> Any:
        hold = self._hold_key(key)
        return {} if hold is None else self.client.hgetall(hold)


@dataclass(frozen=True)
class OneServerKind:
    """A kind of lock on one Redis, made on any client: for tests that put a fault
    proxy between a lock and its server (and match its scripts by their SHA1)."""

    name: str
    #: ``make(client, name, ttl=..., **options)``
    make: Callable[..., Any]
    acquire: Any
    release: Any
    #: Wraps a direct client for the reads a test makes of ``lock.keys.lock``.
    view: Callable[[Any], Any]

    def __str__(self) -> str:
        return self.name


def _one_server_kinds() -> dict[str, OneServerKind]:
    from celery_dlock.backends.redis.scripts import ACQUIRE, RELEASE
    from celery_dlock.backends.redis.semaphore_scripts import SEM_ACQUIRE, SEM_RELEASE

    return {
        "redis": OneServerKind("redis", RedisLock, ACQUIRE, RELEASE, lambda c: c),
        "semaphore": OneServerKind(
            "semaphore", lambda c, n, **kw: RedisSemaphore(c, n, 1, **kw),
            SEM_ACQUIRE, SEM_RELEASE, SemaphoreView),
    }


#: The kinds of lock that live on one Redis, by name.
ONE_SERVER_KINDS = _one_server_kinds()


def lose_lock_data(clients: list[redis.Redis], lock_key: str) -> None:
    """Delete the hash ``lock_key`` and every helper key of it on each client."""
    pattern = lock_key.replace("[", "\\[").replace("*", "\\*").replace("?", "\\?")
    for c in clients:
        doomed = [lock_key, *c.scan_iter(match=pattern + ":*", count=1000)]
        c.delete(*doomed)


@pytest.fixture(scope="session")
def redlock_servers() -> Iterator[list[EmbeddedRedis]]:
    """Three independent redis-servers for the Redlock kind (started once)."""
    servers = [EmbeddedRedis(extra_args=("--maxmemory-policy", "noeviction"))
               for _ in range(3)]
    try:
        for s in servers:
            s.start()
        yield servers
    finally:
        for s in servers:
            with contextlib.suppress(Exception):
                s.stop()


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[Any]:
    """A throwaway PostgreSQL server for the postgres kind (started once), else a skip
    with the reason (no server binaries, no driver)."""
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"no PostgreSQL driver: {exc} (pip install 'celery-dlock[postgres]')")
    from fencing.pg_server import PostgresServer, Unavailable

    try:
        server = PostgresServer().start()
    except Unavailable as exc:
        pytest.skip(f"no PostgreSQL server: {exc}")
    try:
        yield server
    finally:
        server.stop()


def make_lock_postgres(url: str, name: str, ttl: float, **options: Any) -> Any:
    """A PostgreSQL lock with the ``keys`` the tests read it by."""
    from celery_dlock.backends.sql.postgres.lock import PostgresLock

    lock = PostgresLock(url, name, ttl, **options)
    lock.keys = PgKeys.for_name(lock.prefix, name)  # type: ignore[attr-defined]
    return lock


def make_pg_semaphore(url: str, name: str, ttl: float, **options: Any) -> Any:
    """A PostgreSQL semaphore of one slot (its slot rows, celery_dlock/backends/sql/
    slots.py), with the ``keys`` the tests read it by: the slot's row."""
    from celery_dlock.backends.sql.postgres.semaphore import PostgresSemaphore
    from celery_dlock.backends.sql.slots import slot_name, slot_prefix

    lock = PostgresSemaphore(url, name, ttl, **options)
    lock.keys = PgKeys.for_name(  # type: ignore[attr-defined]
        slot_prefix(lock.prefix), slot_name(name, 0))
    return lock


def make_kind(kind: str, request: pytest.FixtureRequest) -> Iterator[LockKind]:
    """The :class:`LockKind` named ``kind`` (for the ``lock_kind`` fixture)."""
    clients: list[Any]
    if kind == "redis":
        url = request.getfixturevalue("redis_url")
        clients = [redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)]
        yield LockKind("redis", clients,
                       lambda n, ttl, **kw: RedisLock(clients[0], n, ttl, **kw), True,
                       [url])
    elif kind == "redlock":
        servers = request.getfixturevalue("redlock_servers")
        clients = [redis.Redis.from_url(s.url, socket_timeout=10,
                                        socket_connect_timeout=5)
                   for s in servers]
        yield LockKind("redlock", clients,
                       lambda n, ttl, **kw: RedlockLock(clients, n, ttl, **kw), False,
                       [s.url for s in servers])
    elif kind in ("postgres", "pg_semaphore"):
        url = request.getfixturevalue("postgres_server").url
        clients = [PgView(url)]
        make = make_lock_postgres if kind == "postgres" else make_pg_semaphore
        yield PgKind(kind, clients,
                     lambda n, ttl, **kw: make(url, n, ttl, **kw), True, [url])
    elif kind == "mysql":
        from my_kind import make_my_kind

        my = make_my_kind(request.getfixturevalue("mariadb_url"))
        yield my
        my.clients[0].close()
        return
    elif kind == "semaphore":
        url = request.getfixturevalue("redis_url")
        clients = [redis.Redis.from_url(url, socket_timeout=10, socket_connect_timeout=5)]
        yield LockKind("semaphore", clients,
                       lambda n, ttl, **kw: RedisSemaphore(clients[0], n, 1, ttl, **kw),
                       True, [url], view=SemaphoreView)
    elif kind == "zookeeper":
        pytest.importorskip("kazoo", reason="kazoo is not installed (the zookeeper "
                            "extra)")
        from zk_kind import make_zk_kind

        zk = make_zk_kind(request.getfixturevalue("zk_server"))
        yield zk
        zk.clients[0].close()
        return
    else:  # pragma: no cover - a typo in KINDS
        raise ValueError(kind)
    for c in clients:
        c.close()
