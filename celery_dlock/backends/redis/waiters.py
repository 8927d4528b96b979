"""Waking blocked acquirers when a lock is released.

A blocked acquirer joins a FIFO line kept in Redis (see
:mod:`celery_dlock.backends.redis.scripts`) and sleeps in ``BLPOP`` on its own
*doorbell* key.  A release rings the doorbell of the
first live waiter only, so a hand-off costs the same number of Redis commands whatever
the number of waiters, the waiter that has waited longest goes first, and nobody polls.

Every sleep is bounded, so that a lost doorbell (a waiter restarted, a failover dropped
the push) or a holder that died without releasing never strands a waiter:

* by the holder's remaining ttl (an expiry rings no doorbell),
* by the caller's own timeout,
* by :data:`WAIT_SLICE`, after which the waiter re-tries and refreshes its lease in the
  line (a waiter that stops refreshing for :data:`QUEUE_LEASE` is dropped from it),
* by the client's ``socket_timeout``, so ``BLPOP`` never outlasts the socket.

A waiter that died in line cannot keep a free lock: when its doorbell rings it has
:data:`WAKE_GRACE` to take the lock, after which it is dropped and the next in line (or
anyone, when the line is empty) may take it.
"""

from __future__ import annotations

import hashlib
from typing import Any

__all__ = [
    "DOORBELL_TTL_MS",
    "LINE_TTL_MS",
    "QUEUE_LEASE",
    "WAIT_SLICE",
    "WAKE_GRACE",
    "WAKE_GRACE_MS",
    "doorbell_suffix",
    "ring_wait",
    "wait_slice",
]

#: Longest single sleep of a blocked acquirer before it re-tries (seconds).
WAIT_SLICE = 2.0
#: How long a waiter keeps its place in line without re-trying (seconds).  Longer than
#: a slice plus the time to act on a wake-up, so live waiters never lose their place.
QUEUE_LEASE = 2 * WAIT_SLICE + 1.0
#: How long a woken waiter has to take a free lock before it loses its place (seconds).
WAKE_GRACE = 0.5
WAKE_GRACE_MS = int(WAKE_GRACE * 1000)
#: A doorbell nobody answers disappears after this (ms).
DOORBELL_TTL_MS = int(QUEUE_LEASE * 1000)
#: The line's keys disappear this long after the last waiter refreshed its lease (ms).
LINE_TTL_MS = int(QUEUE_LEASE * 1000) + 1000


def doorbell_suffix(owner: str) -> str:
    """The doorbell's key suffix of ``owner``: a digest, so that no owner string can
    spell a key of another lock (the scripts use ``redis.sha1hex``, the same)."""
    return hashlib.sha1(owner.encode()).hexdigest()


def wait_slice(client: Any) -> float:
    """The longest ``BLPOP`` that is safe on this client's sockets (seconds)."""
    kwargs = getattr(getattr(client, "connection_pool", None), "connection_kwargs", None)
    if kwargs is None and callable(getattr(client, "get_connection_kwargs", None)):
        kwargs = client.get_connection_kwargs()  # a cluster client: its nodes' settings
    socket_timeout = kwargs.get("socket_timeout") if isinstance(kwargs, dict) else None
    if socket_timeout:
        return max(0.01, min(WAIT_SLICE, float(socket_timeout) * 0.5))
    return WAIT_SLICE


def ring_wait(client: Any, doorbell: str, seconds: float) -> bool:
    """Sleep on ``doorbell`` for at most ``seconds``; True when it rang.

    ``seconds`` must already be capped by :func:`wait_slice`.
    """
    if seconds <= 0:
        return False
    # BLPOP takes fractional seconds since Redis 6.0; 0 would mean "forever".
    reply = client.blpop([doorbell], timeout=max(seconds, 0.001))
    return reply is not None
