"""Queue markers on Redis: the enqueue-time record that a call of a lock name is
queued (:mod:`celery_dlock.task.markers` says what they mean to the Celery face).

``P:{NAME}:m`` is a string holding the task id of the queued call, with an expiry (the
caller's queue ttl); ``P:{NAME}:mr`` the calls replaced by a later one
(``on_duplicate="replace"``), a sorted set whose scores are the ms (server clock) until
which each one's message could still be delivered (its own marker's time, and at least
the new marker's), so that a replaced call never runs, also when the call that replaced
it has started and a worker restart lost the revoke; ``P:{NAME}:mc`` the claim record
(see :data:`CLAIM`): the reply of the last send's claim, so a re-sent claim (its reply
lost) gets its first answer and not "a duplicate of itself", and a replace pending until
its publish is confirmed (:data:`CONFIRM`) or taken back (:data:`UNDO`); ``P:{NAME}:mw``
the retries waiting: the task ids of started calls whose retry holds no marker
(``until_started``, ``queued_and_running``), so that a send of one is a duplicate of
that call, in the claim's own step.  They share the lock's hash tag, so one script reads
the marker and the lock's hash together, also on a cluster.  Every script here reads a
key before it writes one, so another application's data at the marker's key
(``WRONGTYPE``) stops it before any write: :class:`LockKeyConflict`.

A send of a task id already queued, running or waiting for its retry is a duplicate
of that call (reply 2 or 3 naming its own id), and a send of a replaced task id is a
duplicate too (reply 2); only a re-queue (``requeue``: a message carrying its own
marker record) takes the marker again.  A replace is done in three steps: the claim
(the marker names the new call at once, the old one is recorded replaced), the
publish, then :data:`CONFIRM`; a failed publish runs :data:`UNDO` instead, which
gives the name back to the old call.  The old call starting in between takes the
replace back itself (:data:`HAND_OVER`): it runs, and the new one never does.  The
re-queue of a call that has started (its retry; ``started``) is never replaced: a
replace finds it queued (reply 2), as a replace finds a running call.

Replies of :data:`CLAIM` (first element):

* ``0`` CLAIMED: the marker now holds this task id, with the ttl given;
* ``1`` OURS: it held this task id already (the call's own re-queue): its
  expiry is moved to the ttl given, nothing else changes;
* ``2`` QUEUED: another call (element 2, its task id) is queued; element 3 is the
  marker's time left in ms;
* ``3`` RUNNING: another call (element 2; empty when the holder is not a task) holds
  the lock (``until_finished``), or this very task id does (every mode); element 3 is
  the hold's time left in ms;
* ``4`` REPLACED: the queued call (element 2) was replaced: the marker now holds this
  task id;
* ``5`` PENDING: (a replace only) the queued call (element 2) is itself a replace whose
  publish is not confirmed yet: nothing was written; the caller asks again shortly.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from redis.exceptions import RedisError, ResponseError

from ...core.errors import BackendUnavailable, LockKeyConflict
from .cluster import node_clients
from .hashtag import name_of_key, scan_pattern
from .keyspace import MARKER_SUFFIX, LockKeys, decode
from .marker_scripts import (
    CLAIM,
    CLEAR,
    CONFIRM,
    HAND_OVER,
    RECORD_SUFFIX,
    REDELIVERY,
    REPLACED_SUFFIX,
    TAKEN_BACK_SUFFIX,
    UNDO,
    WAITING_SUFFIX,
)
from .refusals import acl_refusal
from .scripts import LuaScript

__all__ = ["CLAIM", "CLEAR", "CONFIRM", "HAND_OVER", "UNDO", "RedisMarkers"]

class RedisMarkers:
    """The queue markers of one Redis (what :class:`~celery_dlock.task.markers.
    MarkerStore` asks of a backend)."""

    def __init__(self, client: Any) -> None:
        self.client = client

    @staticmethod
    def key(prefix: str, name: str) -> str:
        return LockKeys.for_name(prefix, name).lock + MARKER_SUFFIX

    def _run(self, script: LuaScript, keys: tuple[str, ...], args: tuple[Any, ...],
             name: str) -> Any:
        try:
            return script(self.client, keys, args)
        except ResponseError as exc:
            if "WRONGTYPE" in str(exc):
                raise LockKeyConflict(
                    f"{keys[0]!r} or {keys[-1]!r} holds another application's data "
                    f"(not a queue marker or a lock): it was left untouched (use another "
                    f"prefix or lock name)", lock_name=name) from exc
            refused = acl_refusal(exc, "the queue markers' scripts need it", name)
            if refused is not None:
                raise refused from exc
            raise BackendUnavailable(f"Redis refused {script.name}: {exc}",
                                     lock_name=name) from exc
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable during {script.name}: {exc}",
                                     lock_name=name) from exc

    def claim(self, prefix: str, name: str, task_id: str, ttl: float, *,
              running_counts: bool, replace: bool, requeue: bool,
              op: str = "", started: bool = False,
              waits: bool = False) -> tuple[int, str, float | None]:
        """Claim the marker of ``name`` for ``task_id`` (see the module's reply
        codes): ``(code, other task id, its seconds left or None)``.  ``op``: the
        send's operation id (a re-sent claim gets the first reply); ``started``: a
        re-queue of a call that has started (its marker is never replaced);
        ``waits``: the re-queue of a started call that holds no marker in its mode
        (its retry): nothing is claimed, its task id is kept as waiting for ``ttl``
        (a send of it is a duplicate until the retry starts or ends)."""
        lock = LockKeys.for_name(prefix, name).lock
        marker = lock + MARKER_SUFFIX
        reply = self._run(CLAIM, (marker, lock, marker + REPLACED_SUFFIX,
                                  marker + RECORD_SUFFIX, marker + WAITING_SUFFIX),
                          (task_id, max(1, int(ttl * 1000)), _flag(running_counts),
                           _flag(replace), _flag(requeue), op or task_id,
                           _flag(started), _flag(waits)), name)
        left = int(reply[2])
        return int(reply[0]), decode(reply[1]), (left / 1000.0 if left > 0 else None)

    def confirm(self, prefix: str, name: str, task_id: str) -> bool:
        """The publish of ``task_id``, which replaced a queued call, went through:
        False when this call is replaced itself (the replaced call started first and
        took the replace back, or a later replace replaced this one), else True (the
        replaced call is to be revoked)."""
        marker = self.key(prefix, name)
        return int(self._run(CONFIRM, (marker + RECORD_SUFFIX, marker + REPLACED_SUFFIX,
                                       marker + TAKEN_BACK_SUFFIX),
                             (task_id,), name)) != 0

    def undo(self, prefix: str, name: str, task_id: str, op: str, ttl: float) -> bool:
        """The publish of ``task_id`` failed, or its claim (operation ``op``) got no
        reply: take the claim back (a replace gives the name back to the call it
        replaced; a claim not run yet does nothing when it runs, for ``ttl``)."""
        marker = self.key(prefix, name)
        return bool(self._run(UNDO, (marker, marker + REPLACED_SUFFIX,
                                     marker + RECORD_SUFFIX),
                              (task_id, op, max(1, int(ttl * 1000))), name))

    def hand_over(self, prefix: str, name: str, task_id: str, *, remove: bool,
                  replaced_check: bool, running_counts: bool = False,
                  keep: float = 0.0) -> str | None:
        """At the start of ``task_id``'s run: remove its marker (``remove``); the task
        id that replaced it, or None to go on.  ``running_counts``: a running call is
        a duplicate (``until_finished``): a replace of this call not confirmed yet
        never runs; otherwise it stays queued and runs after this one.  ``keep``
        (seconds): a call that goes on stays among the started calls waiting that
        long, or until its end (:meth:`clear`)."""
        marker = self.key(prefix, name)
        reply = self._run(HAND_OVER, (marker, marker + REPLACED_SUFFIX,
                                      marker + RECORD_SUFFIX, marker + WAITING_SUFFIX,
                                      marker + TAKEN_BACK_SUFFIX),
                          (task_id, _flag(remove), _flag(replaced_check),
                           _flag(running_counts), max(0, int(keep * 1000))), name)
        return None if int(reply[0]) == 1 else decode(reply[1])

    def keep_for_redelivery(self, prefix: str, name: str, task_id: str, ttl: float, *,
                            running_counts: bool) -> bool:
        """The worker process running ``task_id`` died and its message will come
        back: a call that had started is kept live for ``ttl`` as its retry would
        be (``running_counts``, until_finished: the marker taken again; otherwise
        its task id waits).  False: nothing written (it had not started)."""
        marker = self.key(prefix, name)
        return bool(self._run(REDELIVERY, (marker, marker + REPLACED_SUFFIX,
                                           marker + RECORD_SUFFIX,
                                           marker + WAITING_SUFFIX),
                              (task_id, max(1, int(ttl * 1000)),
                               _flag(running_counts)), name))

    def clear(self, prefix: str, name: str, task_id: str) -> bool:
        """Remove the marker of ``name`` if it is ``task_id``'s (and ``task_id``
        from the retries waiting: the call ended, or ends without running)."""
        marker = self.key(prefix, name)
        return bool(self._run(CLEAR, (marker, marker + WAITING_SUFFIX), (task_id,),
                              name))

    def read(self, prefix: str, name: str) -> tuple[str, float | None] | None:
        """The marker of ``name``: ``(task id, seconds left)``, or None."""
        try:
            with self.client.pipeline(transaction=False) as pipe:
                pipe.get(self.key(prefix, name))
                pipe.pttl(self.key(prefix, name))
                value, pttl = pipe.execute(raise_on_error=False)
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable reading the marker of "
                                     f"{name!r}: {exc}", lock_name=name) from exc
        if value is None or isinstance(value, Exception):
            return None  # none, or another application's data at its key
        try:
            task_id = decode(value)
        except UnicodeDecodeError:
            return None
        left = pttl if isinstance(pttl, int) else -1
        return task_id, (left / 1000.0 if left > 0 else None)

    def queued(self, prefix: str, *,
               page_size: int = 500) -> Iterator[tuple[str, str, float | None]]:
        """Every marker under ``prefix``: ``(lock name, task id, seconds left)``.

        ``SCAN ... TYPE string`` on each master (a cluster's in turn), a page of keys
        read with one pipeline (``GET`` and ``PTTL`` per key).  A key that is not
        UTF-8, or holds a value that is not, was not written here: it is skipped, as
        is a marker that expires between the scan and the read."""
        seen: set[str] = set()
        try:
            for node in node_clients(self.client):
                page: list[tuple[str, str]] = []
                for raw in node.scan_iter(match=scan_pattern(prefix) + MARKER_SUFFIX,
                                          count=page_size, _type="string"):
                    try:
                        key = decode(raw)
                    except UnicodeDecodeError:
                        continue
                    name = name_of_key(prefix, key[:-len(MARKER_SUFFIX)])
                    if name is None or key in seen:
                        continue
                    seen.add(key)
                    page.append((key, name))
                    if len(page) >= page_size:
                        yield from _read_markers(node, page)
                        page = []
                if page:
                    yield from _read_markers(node, page)
        except ResponseError as exc:
            raise BackendUnavailable(f"Redis refused reading markers: {exc}") from exc
        except RedisError as exc:
            raise BackendUnavailable(f"Redis unavailable reading markers: {exc}") from exc


def _read_markers(node: Any, page: list[tuple[str, str]]
                  ) -> Iterator[tuple[str, str, float | None]]:
    with node.pipeline(transaction=False) as pipe:
        for key, _ in page:
            pipe.get(key)
            pipe.pttl(key)
        replies = pipe.execute(raise_on_error=False)
    for i, (_, name) in enumerate(page):
        value, pttl = replies[2 * i], replies[2 * i + 1]
        if value is None or isinstance(value, Exception):
            continue  # gone since the scan, or another type by now
        try:
            task_id = decode(value)
        except UnicodeDecodeError:
            continue
        left = pttl if isinstance(pttl, int) else -1
        yield name, task_id, (left / 1000.0 if left > 0 else None)


def _flag(value: bool) -> str:
    return "1" if value else "0"
