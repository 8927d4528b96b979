"""Checks of the Redis server a lock runs on, made once per client.

The guarantees need a server that never evicts a lock's keys: with ``maxmemory`` set
and an evicting ``maxmemory-policy`` (``allkeys-lru``, ``volatile-ttl``, ...), Redis may
drop a live hold (two holders) or a fence counter (fences go backwards).  The check
reads ``INFO memory`` (allowed where ``CONFIG`` is not), of every master on a cluster,
and warns once per client.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.process import after_fork
from ...core.store_check import Problem
from .cluster import node_clients

__all__ = ["OLDEST", "check_server", "server_problems"]

#: The oldest Redis (or Valkey) the scripts run on.
OLDEST = (6, 2)

logger = logging.getLogger("celery_dlock.server")

_checked: weakref.WeakSet[Any] = weakref.WeakSet()
_checked_ids: set[int] = set()
_lock = threading.Lock()


def _first_time(client: Any) -> bool:
    with _lock:
        try:
            if client in _checked:
                return False
            _checked.add(client)
        except TypeError:  # not weak-referenceable
            if id(client) in _checked_ids:
                return False
            _checked_ids.add(id(client))
    return True


def check_server(client: Any) -> None:
    """Warn (once per client) when the server may evict keys."""
    if not _first_time(client):
        return
    for server in node_clients(client):  # every master of a cluster
        _check_one(server)


def _eviction(info: Any) -> str | None:
    """The eviction problem ``INFO memory`` shows, as a sentence (None: none)."""
    if not isinstance(info, dict):
        return None
    policy = str(info.get("maxmemory_policy", "noeviction"))
    try:
        maxmemory = int(info.get("maxmemory", 0) or 0)
    except (TypeError, ValueError):
        maxmemory = 0
    if maxmemory > 0 and policy != "noeviction":
        return (f"Redis may evict lock keys: maxmemory is {maxmemory} bytes with "
                f"maxmemory-policy {policy}. An evicted lock can have two holders and an "
                f"evicted fence counter goes backwards: set maxmemory-policy noeviction "
                f"on the server that holds locks")
    return None


def _check_one(client: Any) -> None:
    try:
        info = client.info("memory")
    except (RedisError, AttributeError, TypeError) as exc:
        logger.debug("could not read the server's memory settings: %s", exc)
        return
    problem = _eviction(info)
    if problem is not None:
        logger.warning("%s", problem)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split(".")[:2] if part.isdigit())


def server_problems(client: Any) -> list[Problem]:
    """What keeps each master of ``client`` from keeping locks as documented: a
    version older than :data:`OLDEST`, an evicting memory policy (one line each).
    Raises redis-py's connection errors when a server does not answer."""
    _first_time(client)  # said here: the probe's first lock need not warn again
    problems: list[str] = []
    servers = list(node_clients(client))
    for server in servers:
        # each master of a cluster by its address; one server needs no name
        where = _where(server) + ": " if len(servers) > 1 else ""
        try:
            info = server.info("server")
        except ResponseError as exc:  # refused (an ACL without INFO), not unreachable
            problems.append(f"{where}the server's version and eviction policy cannot "
                            f"be read ({exc})")
            continue
        version = str(info.get("redis_version", "")) if isinstance(info, dict) else ""
        if version and _version(version) < OLDEST:
            problems.append(f"{where}Redis {version} is older than "
                            f"{'.'.join(map(str, OLDEST))}, the oldest server the "
                            f"lock's scripts run on")
        try:
            memory = server.info("memory")
        except ResponseError as exc:  # refused: say what was not checked
            problems.append(f"{where}the eviction policy cannot be read ({exc})")
            continue
        eviction = _eviction(memory)
        if eviction is not None:
            problems.append(f"{where}{eviction}")
    return [Problem(text) for text in problems]


def _where(client: Any) -> str:
    """A server's address for a problem line (never its password)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", {})
    if "path" in kwargs:
        return f"Redis at {kwargs['path']}"
    host, port = kwargs.get("host"), kwargs.get("port")
    return f"Redis at {host}:{port}" if host else "Redis"


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


after_fork(_after_fork_in_child)
