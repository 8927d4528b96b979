"""Queue markers (a ``lock_mode`` other than ``while_running``) in a SQL table, for
every dialect: :class:`SqlMarkers`, the compare-and-set loop around the protocol's
steps (:class:`celery_dlock.core.marker_store.DocumentMarkers`, over
:mod:`celery_dlock.core.marker_steps`: the same rules and replies as the Redis
scripts), with a dialect's statements.

A name's markers (its queued call, the claim record, the replaced calls, the retries
waiting, each with its expiry) are one JSON document in one row of the markers table.
A step reads the row, the name's lease row (its live holder's task id, for
``until_finished``, and its fence) and the server's clock in one statement, runs in
Python, and, when it changed the document, writes it back in one statement that
changes the row only if no one wrote it since (``version``), or inserts it only if
there is none; a claim's write also only if the lease row's fence is still the one
read (a call that took the lock since is seen by the claim run again).  When the
write changes nothing, another call got there first, and the step runs again on what
is there now.  Every statement is autocommitted on its own (a pooler may sit
between), and a re-sent one (a lost reply: the server object sends a statement
again on a fresh connection) is harmless: its compare-and-set fails, and the step,
run again on what the first send wrote, answers as a re-sent Redis script does (the
steps are written so).

A row past its ``expires_at`` holds nothing; rows are kept (a later step of the name
overwrites them), so a version never repeats.  The dialect (PostgreSQL:
:mod:`.postgres.markers`) sends the statements.  No driver is imported here.
"""

from __future__ import annotations

import json
from typing import Any

from ...core.marker_steps import Holder
from ...core.marker_store import TRIES, DocumentMarkers, MarkerRow

__all__ = ["TRIES", "MarkerRow", "SqlMarkers", "holder_of"]


def holder_of(live: Any, info: Any, expires_ms: Any, now: int) -> Holder | None:
    """The live hold of a lease row as read (``info`` a dict, or its JSON text)."""
    if not live or expires_ms is None:
        return None
    if isinstance(info, (bytes, bytearray)):
        info = info.decode("utf-8", "surrogateescape")
    if isinstance(info, str):
        try:
            info = json.loads(info)
        except ValueError:
            info = {}
    task_id = info.get("task_id") if isinstance(info, dict) else None
    return Holder(None if task_id is None else str(task_id), int(expires_ms) - now)


class SqlMarkers(DocumentMarkers):
    """The :class:`~celery_dlock.task.markers.MarkerStore` of one SQL server (the
    dialect subclasses it with its statements: ``_read`` the row, the lease row and
    the clock; ``_write`` by version and, for a claim, the lease row's fence read;
    ``_rows`` those under a prefix not past their ``expires_at``; where the table was
    never made, reading makes nothing)."""
