"""Who released which lock by hand, and why: one event and one log line per release.

``celery dlock release`` records each lock it frees in the prefix's event list
(``<prefix>:events``, the one ``top`` shows, see :mod:`celery_dlock.task.events`) as a
``released`` event naming the operator (``user@host``), the hold that was freed and
the ``--reason`` given, and logs the same at WARNING on ``celery_dlock.audit``.  The
holder is told too: the release script leaves a short-lived marker with who and why
(:mod:`celery_dlock.backends.redis.released`), which the holder reads when it finds its
hold
gone, so its ``on_lost``, ``LockLost`` and ``lock_lost`` reason say
``released by alice@host with celery dlock release --force: <reason>``.
"""

from __future__ import annotations

import getpass
import logging
import socket
import time
from typing import Any

from ..core.holds import HoldInfo
from ..core.text import clean_text
from ..task.events import Event, push_event
from .formatting import printable

__all__ = ["operator", "record_release", "released_by"]

logger = logging.getLogger("celery_dlock.audit")


def operator() -> str:
    """``user@host`` of whoever runs this command."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "?"
    return f"{user}@{socket.gethostname()}"


def released_by(force: bool) -> str:
    """Who released a lock, and how, as the holder's loss reason names it."""
    return f"{operator()} with celery dlock release{' --force' if force else ''}"


def record_release(client: Any, prefix: str, key: str, freed: HoldInfo,
                   reason: str | None, who: str | None = None) -> Event:
    """Record that ``freed`` (the hold on ``key``) was released by hand, by ``who``
    (default: :func:`operator`, the ``user@host`` running this).

    Redis errors propagate (the command reports them); the log line is written first.
    With no Redis (``client`` None: a backend that keeps no history), only the log
    line.
    """
    event = Event(at=time.time(), kind="released", key=key, worker=who or operator(),
                  holder_task_name=freed.task_name, holder_task_id=freed.task_id,
                  holder_worker=freed.worker,
                  detail=clean_text(reason) or "no reason given")
    logger.warning("lock %r released by %s (reason: %s); it was held by %s[%s] on %s",
                   key, *(printable(str(x)) for x in (
                       event.worker, event.detail, freed.task_name or "?",
                       freed.task_id or "?", freed.worker or "?")))
    if client is None:
        return event
    pipe = client.pipeline(transaction=False)
    push_event(pipe, prefix, event)
    pipe.execute()
    return event
