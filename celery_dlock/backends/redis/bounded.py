"""A client of the same server as another, with a connection pool of its own whose
calls are bounded in time and never re-sent: for renewal and for Redlock's nodes,
which must not wait behind the application's connections nor retry on their own."""

from __future__ import annotations

from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

__all__ = ["PLAIN_POOLS", "bounded_client"]

#: The pools whose settings can be copied (Sentinel-managed and unknown ones cannot).
PLAIN_POOLS = (redis.ConnectionPool, redis.BlockingConnectionPool)


def bounded_client(pool: Any, timeout: float, *, connect_timeout: bool = False,
                   max_connections: int | None = None,
                   drop_connect_func: bool = False) -> redis.Redis:
    """A client with ``pool``'s connection settings in a pool of its own: its socket
    timeout (and with ``connect_timeout``, its connect timeout) at most ``timeout``
    seconds, no re-sends; ``drop_connect_func`` leaves out a cluster node's
    on-connect hook."""
    kwargs = dict(pool.connection_kwargs)
    for key in ("retry_on_timeout", "retry_on_error"):
        kwargs.pop(key, None)
    if drop_connect_func:
        kwargs.pop("redis_connect_func", None)
    options = ("socket_timeout", "socket_connect_timeout") if connect_timeout else (
        "socket_timeout",)
    for option in options:
        given = kwargs.get(option)
        kwargs[option] = timeout if not given else min(float(given), timeout)
    kwargs["retry"] = Retry(NoBackoff(), 0)
    if max_connections is not None:
        kwargs["max_connections"] = max_connections
    own = redis.ConnectionPool(connection_class=pool.connection_class, **kwargs)
    return redis.Redis(connection_pool=own)
