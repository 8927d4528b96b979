"""The Redlock backend: one lock on a quorum of independent Redis servers, behind
:class:`~celery_dlock.core.protocol.Backend`.  Listing and force release by hand are
not supported yet (each node would have to be read, and a quorum agreed on)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ....core.errors import BackendUnavailable, NotSupported
from ....core.holds import HoldInfo
from ....core.lock_options import LockOptions
from ....core.registry import entry_named
from ....core.store_check import Problem, probe
from ..inspect import release_matching
from ..keyspace import LockKeys
from ..server_checks import server_problems
from .lock import RedlockLock
from .nodes import check_nodes
from .quorum import REDLOCK_NO_SEMAPHORE, check_redlock_limit

__all__ = ["REDLOCK_NO_SEMAPHORE", "RedlockBackend", "check_redlock_limit"]

class RedlockBackend:
    """The locks held on a quorum of ``clients`` (3 or more independent servers)."""

    kind = "redlock"
    fences = False
    capabilities = entry_named("redlock").capabilities

    def __init__(self, clients: Sequence[Any]) -> None:
        # Refused here (InvalidLockConfig), not at a task's first lock: fewer than 3,
        # or one server given as several nodes.
        self.clients = check_nodes(clients, None)

    def lock(self, options: LockOptions) -> RedlockLock:
        return RedlockLock.with_options(self.clients, options)

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        holder = RedlockLock(self.clients, name, prefix=prefix, auto_renew=False).holder()
        if holder is None or holder.owner is None:
            return None
        return HoldInfo(key=name, task_name=holder.task_name, task_id=holder.task_id,
                        worker=holder.worker, pid=holder.pid, owner=holder.owner,
                        count=holder.count, fence=None, ttl=holder.ttl,
                        held_for=holder.age, host=holder.info.get("host"))

    def check(self, prefix: str) -> list[Problem]:
        """Each node's version and eviction policy, then the probe lock on the quorum.
        A node that does not answer is a problem that may pass (the quorum works
        without it); fewer answering nodes than a quorum is an unavailable store."""
        problems: list[Problem] = []
        down = 0
        for i, client in enumerate(self.clients, 1):
            try:
                problems += [Problem(f"Redlock node {i} of {len(self.clients)}: {p}",
                                     p.lasting) for p in server_problems(client)]
            except (RedisConnectionError, RedisTimeoutError) as exc:
                down += 1
                problems.append(Problem(f"Redlock node {i} of {len(self.clients)} does "
                                        f"not answer: {exc}", lasting=False))
        if len(self.clients) - down < len(self.clients) // 2 + 1:
            raise BackendUnavailable(f"{down} of {len(self.clients)} Redlock nodes do "
                                     f"not answer: no quorum")
        return problems + probe(self, prefix)

    def _unsupported(self, what: str) -> NotSupported:
        return NotSupported(
            f"{what} reads one Redis; the locks are on {len(self.clients)} servers "
            f"(Redlock): give --url with one of them to read that node")

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        raise self._unsupported("listing the locks")

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        raise self._unsupported("counting the waiters")

    def storage_key(self, prefix: str, name: str) -> str:
        """Where each server keeps the hold of ``name`` (for operators)."""
        return LockKeys.for_name(prefix, name).lock

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        if not conditions:
            raise self._unsupported("a force release")
        # The conditions name one hold (a dead child's): safe on every node.
        freed = False
        for client in self.clients:
            try:
                freed = release_matching(client, prefix, name, conditions) or freed
            except Exception:
                continue
        return HoldInfo.matched(name, conditions) if freed else None
