"""Queue markers (a ``lock_mode`` other than ``while_running``) in a SQL table, for
every dialect: :class:`SqlMarkers`, the compare-and-set loop around the protocol's
steps (:mod:`celery_dlock.core.marker_steps`, the same rules and replies as the
Redis scripts).

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
between), and a re-sent one (a lost reply) is harmless: its compare-and-set fails,
and the step, run again on what the first send wrote, answers as a re-sent Redis
script does (the steps are written so).

A row past its ``expires_at`` holds nothing; rows are kept (a later step of the name
overwrites them), so a version never repeats.  The dialect (PostgreSQL:
:mod:`.postgres.markers`) sends the statements.  No driver is imported here.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, TypeVar

from ...core import marker_steps as steps
from ...core.errors import BackendUnavailable
from ...core.expiring import ExpiringKeys
from ...core.marker_steps import Holder

__all__ = ["TRIES", "MarkerRow", "SqlMarkers", "holder_of"]

#: How many times a step reads and tries to write before giving up (the row kept
#: changing under it: :class:`BackendUnavailable`).
TRIES = 100

_T = TypeVar("_T")


class MarkerRow(NamedTuple):
    """What a step reads: the server's clock (ms), the row's ``version`` and document
    (None, None: no row), the name's live hold, and its lease row's fence (-1: none),
    which a claim's write is conditioned on."""

    now: int
    version: int | None
    doc: str | None
    hold: Holder | None
    lease: int


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


class SqlMarkers:
    """The :class:`~celery_dlock.task.markers.MarkerStore` of one SQL server (the
    dialect subclasses it with its statements)."""

    #: The database's name in messages.
    label = ""

    # -- what a dialect provides ----------------------------------------------------

    def _read(self, prefix: str, name: str, *, create: bool = True
              ) -> MarkerRow | None:
        """The row of ``name`` as read now; None where the table was never made and
        not ``create`` (nothing is made by reading)."""
        raise NotImplementedError

    def _write(self, prefix: str, name: str, version: int | None, doc: str,
               expires: int | None, lease: int | None) -> bool:
        """Write ``name``'s document if its row is still at ``version`` (None:
        insert it, if there is still none) and, when ``lease`` is given, its lease
        row's fence is still that; False when it changed nothing."""
        raise NotImplementedError

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """Every row under ``prefix`` not past its expiry: the name as shown, the
        server's clock (ms), the document."""
        raise NotImplementedError

    # -- the loop ---------------------------------------------------------------------

    def _step(self, prefix: str, name: str,
              step: Callable[[ExpiringKeys, Holder | None], _T], *,
              on_lease: bool = False) -> _T:
        for _ in range(TRIES):
            row = self._read(prefix, name)
            if row is None:  # pragma: no cover - a step always makes the table
                raise AssertionError("the markers table was not made")
            keys = ExpiringKeys(row.doc, row.now)
            answer = step(keys, row.hold)
            if not keys.changed or self._write(
                    prefix, name, row.version, keys.dumps(), keys.expires(),
                    row.lease if on_lease else None):
                return answer
        raise BackendUnavailable(
            f"{self.label}: the queue markers of {name!r} kept changing under this "
            f"call ({TRIES} tries); try again", lock_name=name)

    # -- the store ------------------------------------------------------------------

    def claim(self, prefix: str, name: str, task_id: str, ttl: float, *,
              running_counts: bool, replace: bool, requeue: bool,
              op: str = "", started: bool = False,
              waits: bool = False) -> tuple[int, str, float | None]:
        """As :meth:`celery_dlock.backends.redis.markers.RedisMarkers.claim`."""
        code, other, left = self._step(prefix, name, lambda k, hold: steps.claim(
            k, hold, task_id, _ms(ttl), running_counts=running_counts,
            replace=replace, requeue=requeue, op=op or task_id, started=started,
            waits=waits), on_lease=True)
        return code, other, (left / 1000.0 if left > 0 else None)

    def confirm(self, prefix: str, name: str, task_id: str) -> bool:
        return self._step(prefix, name,
                          lambda k, _: steps.confirm(k, task_id)) != 0

    def undo(self, prefix: str, name: str, task_id: str, op: str, ttl: float) -> bool:
        return bool(self._step(prefix, name,
                               lambda k, _: steps.undo(k, task_id, op, _ms(ttl))))

    def hand_over(self, prefix: str, name: str, task_id: str, *, remove: bool,
                  replaced_check: bool, running_counts: bool = False,
                  keep: float = 0.0) -> str | None:
        code, by = self._step(prefix, name, lambda k, _: steps.hand_over(
            k, task_id, remove=remove, replaced_check=replaced_check,
            running_counts=running_counts, keep=max(0, int(keep * 1000))))
        return None if code == 1 else by

    def keep_for_redelivery(self, prefix: str, name: str, task_id: str, ttl: float, *,
                            running_counts: bool) -> bool:
        return bool(self._step(prefix, name, lambda k, _: steps.redelivery(
            k, task_id, _ms(ttl), running_counts=running_counts)))

    def clear(self, prefix: str, name: str, task_id: str) -> bool:
        return bool(self._step(prefix, name, lambda k, _: steps.clear(k, task_id)))

    def read(self, prefix: str, name: str) -> tuple[str, float | None] | None:
        """The marker of ``name``: ``(task id, seconds left)``, or None."""
        row = self._read(prefix, name, create=False)
        if row is None:
            return None
        return _marker(ExpiringKeys(row.doc, row.now))

    def queued(self, prefix: str) -> Iterator[tuple[str, str, float | None]]:
        """Every marker under ``prefix``: ``(lock name, task id, seconds left)``."""
        for shown, now, doc in self._rows(prefix):
            found = _marker(ExpiringKeys(doc, now))
            if found is not None:
                yield shown, found[0], found[1]


def _marker(keys: ExpiringKeys) -> tuple[str, float | None] | None:
    task_id = keys.get(steps.MARKER)
    if task_id is None:
        return None
    left = keys.pttl(steps.MARKER)
    return task_id, (left / 1000.0 if left > 0 else None)


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))
