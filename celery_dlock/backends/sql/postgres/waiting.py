"""Waking blocked acquirers: PostgreSQL ``LISTEN``/``NOTIFY``.

A blocked acquirer opens a connection of its own, ``LISTEN``s on its lock's channel
(:func:`channel_of`: a digest of prefix and name, so any name makes a valid channel)
and tries once more before sleeping, so a release between its refused try and its
``LISTEN`` is never missed.  A release that frees the hold, and a force release,
``NOTIFY`` the channel in the same statement; every waiter wakes and tries, the first
in line (:mod:`.statements`, ``ACQUIRE``) takes the lock and the others, refused, go
back to sleep (renewing their places in line).  A waiter that gives up and was first
in line while the lock is free ``NOTIFY``s too, so the next one takes its turn.  An
expiry has no trigger: each sleep is bounded by the holder's remaining ttl and by
:data:`WAIT_SLICE` (the bounded fallback poll), and by the caller's timeout.  A waiter
that died in line keeps its place until its lease (:data:`QUEUE_LEASE`) lapses: the
others, refused meanwhile, sleep until then and are passed on.

The listening connection is session state, so it must reach the server directly (a
pooler in transaction mode drops ``LISTEN``): when it cannot, the waiter falls back
to sleeping a slice, which costs latency and never correctness.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from typing import Any

import psycopg
from psycopg import sql

from ..server import close_quietly
from .server import PgServer

__all__ = ["QUEUE_LEASE", "QUEUE_LEASE_MS", "WAIT_SLICE", "Listener", "channel_of"]

logger = logging.getLogger("celery_dlock.lock")

#: The longest single sleep of a blocked acquirer before it tries again (seconds).
WAIT_SLICE = 2.0
#: How long a waiter keeps its place in line without trying again (seconds): longer
#: than a slice and a round trip, so a live waiter never loses it; a waiter that died
#: in line is passed over once it lapses.
QUEUE_LEASE = 2 * WAIT_SLICE + 1.0
QUEUE_LEASE_MS = int(QUEUE_LEASE * 1000)


def channel_of(prefix: str, name: str) -> str:
    """The ``NOTIFY`` channel of a lock."""
    digest = hashlib.sha1(f"{prefix}\x00{name}".encode()).hexdigest()
    return f"dlock_{digest}"


class Listener:
    """One waiter's ``LISTEN`` connection (opened on its first wait)."""

    def __init__(self, server: PgServer, channel: str) -> None:
        self.server = server
        self.channel = channel
        self._conn: psycopg.Connection[Any] | None = None
        self._pid = os.getpid()

    def wait(self, seconds: float) -> None:
        """Sleep until the channel is notified, at most ``seconds``.  The first call
        only starts listening and returns at once (the caller tries again, now
        covered)."""
        if seconds <= 0:
            return
        if self._conn is not None and self._pid != os.getpid():
            self._conn = None  # a forked child: the parent's connection
        if self._conn is None:
            try:
                conn = self.server.connect()
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
            except Exception as exc:  # no doorbell: poll this slice
                logger.debug("cannot listen on %s: %s", self.channel, exc)
                time.sleep(min(seconds, WAIT_SLICE))
                return
            self._conn, self._pid = conn, os.getpid()
            return
        try:
            for _ in self._conn.notifies(timeout=seconds, stop_after=1):
                break
        except psycopg.Error as exc:
            logger.debug("listening on %s failed: %s", self.channel, exc)
            self.close()
            time.sleep(min(seconds, 0.1))

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            close_quietly(conn, psycopg.Error)
