"""The queue markers of a store that keeps one name's markers as one document (a SQL
row, a znode) and writes it by compare-and-set: :class:`DocumentMarkers`, the loop
around the protocol's steps (:mod:`.marker_steps`, the same rules and replies as the
Redis scripts), and the store's three hooks (read, write, list).

A step reads the name's document (an :class:`~.expiring.ExpiringKeys` as stored, its
version), the server's clock and the name's live hold (:class:`MarkerRow`), runs the
step, and, when the step changed the document, writes it back only if no one wrote
it since (``version``; or makes it only if there is still none).  When the write
changes nothing, another call got there first, and the step runs again on what is
there now; at most :data:`TRIES` times, then :class:`~.errors.BackendUnavailable`.
A re-sent write (a lost reply) is harmless: its compare-and-set fails, and the step,
run again on what the first send wrote, answers as a re-sent Redis script does (the
steps are written so).  A store whose connection does not re-send a write whose reply
was lost sets :attr:`DocumentMarkers.resends`: the step then reads again instead.

No store is imported here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import NamedTuple, TypeVar

from . import marker_steps as steps
from .errors import BackendUnavailable
from .expiring import ExpiringKeys
from .marker_steps import Holder

__all__ = ["TRIES", "DocumentMarkers", "MarkerRow"]

#: How many times a step reads and tries to write before giving up (the document
#: kept changing under it: :class:`BackendUnavailable`).
TRIES = 100

_T = TypeVar("_T")


class MarkerRow(NamedTuple):
    """What a step reads: the server's clock (ms), the document's ``version`` and
    text (None, None: there is none), the name's live hold, and what a claim's write
    is conditioned on besides the version (a SQL lease row's fence; -1: none)."""

    now: int
    version: int | None
    doc: str | None
    hold: Holder | None
    lease: int


class DocumentMarkers:
    """The :class:`~celery_dlock.task.markers.MarkerStore` of a store of documents
    (the store subclasses it with its reads and writes)."""

    #: The store's name in messages.
    label = ""
    #: How many writes of one step that failed with BackendUnavailable (the reply
    #: lost: the write may have landed) are answered by reading again.
    resends = 0

    # -- what a store provides --------------------------------------------------------

    def _read(self, prefix: str, name: str, *, create: bool = True,
              holder: bool = True) -> MarkerRow | None:
        """The document of ``name`` as read now, with the clock and, where
        ``holder`` (a claim: the only step that asks), the name's live hold (a store
        may give it always, or None where not asked); where not ``create`` (a read
        of the markers), None when the store has nothing for the name (and nothing
        is made by reading)."""
        raise NotImplementedError

    def _write(self, prefix: str, name: str, version: int | None, doc: str,
               expires: int | None, lease: int | None) -> bool:
        """Write ``name``'s document if it is still at ``version`` (None: make it, if
        there is still none) and, when ``lease`` is given, what the store conditions
        a claim on is still that; False when it changed nothing.  ``expires``: when
        its last key expires (ms; None: never)."""
        raise NotImplementedError

    def _rows(self, prefix: str) -> Iterator[tuple[str, int, str]]:
        """Every document under ``prefix`` that may hold a live key: the name as
        shown, the server's clock (ms), the document."""
        raise NotImplementedError

    # -- the loop ---------------------------------------------------------------------

    def _step(self, prefix: str, name: str,
              step: Callable[[ExpiringKeys, Holder | None], _T], *,
              on_lease: bool = False) -> _T:
        """Run ``step`` until its write lands (or it writes nothing); ``on_lease``:
        a claim (it reads the name's hold, and its write is conditioned on what
        the store conditions a claim on)."""
        resent = 0
        for _ in range(TRIES):
            row = self._read(prefix, name, holder=on_lease)
            if row is None:  # pragma: no cover - a step reads with create
                raise AssertionError(f"{self.label}: a step read nothing")
            keys = ExpiringKeys(row.doc, row.now)
            answer = step(keys, row.hold)
            if not keys.changed:
                return answer
            try:
                written = self._write(prefix, name, row.version, keys.dumps(),
                                      keys.expires(), row.lease if on_lease else None)
            except BackendUnavailable:
                if resent >= self.resends:
                    raise
                resent += 1  # it may have landed: the read tells
                continue
            if written:
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
