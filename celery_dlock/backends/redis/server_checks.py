"""Checks of the Redis server a lock runs on, made once per client.

The guarantees need a server that never evicts a lock's keys: with ``maxmemory`` set
and an evicting ``maxmemory-policy`` (``allkeys-lru``, ``volatile-ttl``, ...), Redis may
drop a live hold (two holders) or a fence counter (fences go backwards).  The check
reads ``INFO memory`` (allowed where ``CONFIG`` is not), of every master on a cluster,
and warns once per client.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any

from redis.exceptions import RedisError

from .cluster import node_clients

__all__ = ["check_server"]

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


def _check_one(client: Any) -> None:
    try:
        info = client.info("memory")
    except (RedisError, AttributeError, TypeError) as exc:
        logger.debug("could not read the server's memory settings: %s", exc)
        return
    if not isinstance(info, dict):
        return
    policy = str(info.get("maxmemory_policy", "noeviction"))
    try:
        maxmemory = int(info.get("maxmemory", 0) or 0)
    except (TypeError, ValueError):
        maxmemory = 0
    if maxmemory > 0 and policy != "noeviction":
        logger.warning(
            "Redis may evict lock keys: maxmemory is %d bytes with maxmemory-policy %s. "
            "An evicted lock can have two holders and an evicted fence counter goes "
            "backwards: set maxmemory-policy noeviction on the server that holds locks",
            maxmemory, policy)


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
