"""The ZooKeeper kind of lock for tests/lock_kinds.py: its locks carry the ``keys`` the
lock-contract tests read (``keys.lock`` the lock node, ``keys.queue`` its line), and
its faults act on ZooKeeper's nodes (tests/zk_server.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from lock_kinds import LockKind
from zk_server import LINE, ZkServer, ZkView

from celery_dlock.backends.zookeeper import ZooKeeperBackend, ZooKeeperLock, parse_url

__all__ = ["ZkLockKind", "make_zk_kind", "zk_lock"]


def zk_lock(url: str, name: str, ttl: float = 30.0, **options: Any) -> ZooKeeperLock:
    """A ZooKeeperLock with the ``keys`` the contract tests read."""
    lock = ZooKeeperLock(url, name, ttl, **options)
    lock.keys = SimpleNamespace(  # type: ignore[attr-defined]
        lock=lock.path, queue=lock.path + LINE, leases=lock.path + LINE)
    return lock


class ZkLockKind(LockKind):
    """The ZooKeeper kind: one server, read through a :class:`ZkView`."""

    def lose_data(self, lock: Any) -> None:
        """The server forgets the lock: its node, its holder and its line (zxids go
        on: a data dir lost for good is docs/backends.md's, not this)."""
        self.clients[0].delete_all(lock.keys.lock)  # type: ignore[attr-defined]

    def drop_hold(self, lock: Any) -> None:
        self.clients[0].delete(lock.keys.lock)

    def force_release(self, lock_name: str, prefix: str = "dlock") -> None:
        ZooKeeperBackend(parse_url(self.urls[0])).force_release(prefix, lock_name)


def make_zk_kind(server: ZkServer) -> ZkLockKind:
    view = ZkView(server.hosts)
    url = server.url
    return ZkLockKind("zookeeper", [view],  # type: ignore[list-item]
                      lambda n, ttl, **kw: zk_lock(url, n, ttl, **kw), True, [url])
