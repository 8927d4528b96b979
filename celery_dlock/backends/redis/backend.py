"""The Redis backend: one Redis server, a Cluster, Sentinel, TLS or a unix socket,
behind :class:`~celery_dlock.core.protocol.Backend`."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from ...core.errors import BackendUnavailable
from ...core.holds import HoldInfo
from ...core.lock_options import LockOptions
from ...core.registry import entry_named
from ...core.store_check import Problem, probe
from .inspect import force_release, get_lock, iter_locks, release_matching, waiting_counts
from .keyspace import LockKeys
from .lock import RedisLock
from .markers import RedisMarkers
from .rate import RedisRates
from .semaphore import RedisSemaphore
from .server_checks import server_problems

__all__ = ["RedisBackend"]


class RedisBackend:
    """The locks of one Redis (any topology one client reaches)."""

    kind = "redis"
    fences = True
    capabilities = entry_named("redis").capabilities

    def __init__(self, client: Any) -> None:
        self.client = client

    def lock(self, options: LockOptions) -> RedisLock | RedisSemaphore:
        if options.limit != 1:
            return RedisSemaphore.with_options(self.client, options)
        return RedisLock.with_options(self.client, options)

    def read(self, prefix: str, name: str) -> HoldInfo | None:
        return get_lock(self.client, prefix, name)

    def holds(self, prefix: str) -> Iterator[HoldInfo]:
        return iter_locks(self.client, prefix)

    def waiting(self, prefix: str, names: Iterable[str]) -> dict[str, int]:
        return waiting_counts(self.client, prefix, names)

    def storage_key(self, prefix: str, name: str) -> str:
        """Where each server keeps the hold of ``name`` (for operators)."""
        return LockKeys.for_name(prefix, name).lock

    def force_release(self, prefix: str, name: str, *, fence: int | None = None,
                      by: str | None = None, reason: str | None = None,
                      conditions: Mapping[str, str] | None = None) -> HoldInfo | None:
        if conditions:
            freed = release_matching(self.client, prefix, name, conditions)
            return HoldInfo.matched(name, conditions) if freed else None
        return force_release(self.client, prefix, name, fence=fence, by=by,
                             reason=reason)

    def check(self, prefix: str) -> list[Problem]:
        """The server's version and eviction policy (every master of a cluster),
        then the probe lock (:mod:`celery_dlock.core.store_check`)."""
        try:
            problems = server_problems(self.client)
        except (RedisConnectionError, RedisTimeoutError) as exc:
            raise BackendUnavailable(f"Redis unavailable: {exc}") from exc
        return problems + probe(self, prefix)

    def markers(self) -> RedisMarkers:
        """The queue markers of enqueue-time uniqueness, on the same Redis."""
        return RedisMarkers(self.client)

    def rates(self) -> RedisRates:
        """Per-name rates (``lock_rate``), on the same Redis."""
        return RedisRates(self.client)

    def __repr__(self) -> str:
        return f"<RedisBackend {self.client!r}>"
