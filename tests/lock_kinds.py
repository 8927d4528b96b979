"""Every kind of lock, as one parameter: tests of the lock's contract take the
``lock_kind`` fixture and run once per kind (a new backend adds one entry here).

A :class:`LockKind` makes locks (``kind.make(name, ttl=..., **options)``) and gives the
tests the handles a fault needs: the clients of every server that keeps the lock,
``lose_data(lock)`` (every server forgets the lock, as an empty restart would) and
``force_release(name)`` (what an operator's ``celery dlock release --force`` does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from celery_dlock import FencingUnavailable, RedisLock, RedlockLock
from celery_dlock.ops.embedded import EmbeddedRedis

__all__ = ["KINDS", "NO_FENCE", "NO_LINE", "NO_LONGER_SESSION", "LockKind",
           "lose_lock_data", "redlock_servers"]

#: The kinds of lock every lock-contract test runs on.
KINDS = ("redis", "redlock", "zookeeper")

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

    @property
    def server(self) -> Any:
        """Where a test reads the lock's keys: the one server, or on a kind with
        several, what a majority of them says (a Redlock call returns once a quorum
        confirmed it; the other nodes follow a moment later)."""
        return self.clients[0] if len(self.clients) == 1 else QuorumView(self.clients)

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
        from celery_dlock.backends.redis.keyspace import LockKeys
        from celery_dlock.ops.inspect import force_release

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

    def __str__(self) -> str:
        return self.name


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


def make_kind(kind: str, request: pytest.FixtureRequest) -> Iterator[LockKind]:
    """The :class:`LockKind` named ``kind`` (for the ``lock_kind`` fixture)."""
    clients: list[redis.Redis]
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
