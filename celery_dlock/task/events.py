"""A short history of lock contention, for ``celery dlock top``.

Off by default.  When an app sets ``app.conf.dlock_record_events = True``, every worker
that runs its locked tasks appends one small JSON record to a capped Redis list,
``<prefix>:events`` (newest first, at most :data:`EVENTS_MAX` records, expiring a day
after the last one), each time a task

* finds its lock held elsewhere (``signals.lock_contended``: which task, which policy,
  who held the lock),
* loses its lock while running (``signals.lock_lost``),
* is sent while a call of its lock name is already queued, running or throttled (an
  enqueue-time ``lock_mode``: ``signals.lock_duplicate``, recorded by the producer, as
  ``duplicate``: the new call, the other call's id as the holder, the policy), or
* is parked over its ``lock_rate`` (``signals.lock_parked``, as ``parked``).

The cost is one pipelined round trip (``LPUSH``, ``LTRIM``, ``EXPIRE``, and the
minute's count: :mod:`.event_counts`) per event, on the contended path (a contention,
a duplicate, a park, a loss); an acquisition is counted only (``HINCRBY``,
``EXPIRE``: one round trip per acquire); releasing and sending a call that is not a
duplicate record nothing.
A contention caused by Redis being unreachable is not recorded (there is nowhere to
write it).  Failures to record are logged at debug level and never affect the task.

Why a list rather than the waiters' lines (``<prefix>:{name}:q``): only the ``wait``
policy joins a line, and only while it blocks; contention handled by ``retry``, ``skip``
or ``raise`` leaves no trace there.  ``top`` shows the live lines too (its ``WAITING``
column).

Timestamps are the recording worker's wall clock.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from ..core.errors import BackendUnavailable, DLockError
from . import signals
from .config import get_client, read_setting
from .event_counts import count_into
from .settings import conf_value

__all__ = ["EVENTS_MAX", "EVENTS_TTL", "Event", "events_key", "install", "push_event",
           "recent_events", "recording_enabled"]

logger = logging.getLogger("celery_dlock.events")

#: Records kept per prefix.
EVENTS_MAX = 200
#: The list expires this many seconds after its last record.
EVENTS_TTL = 24 * 3600

_FIELDS = ("at", "kind", "key", "task_name", "task_id", "worker", "policy",
           "holder_task_name", "holder_task_id", "holder_worker", "detail")


def events_key(prefix: str) -> str:
    """The list holding the history of ``prefix``'s locks."""
    return f"{prefix}:events"


@dataclass(frozen=True)
class Event:
    """One recorded contention (``kind="contended"``), lost lock (``"lost"``),
    duplicate call (``"duplicate"``), parked call (``"parked"``) or release by hand
    (``"released"``, :mod:`celery_dlock.ops.audit`)."""

    at: float
    kind: str
    key: str
    task_name: str | None = None
    task_id: str | None = None
    worker: str | None = None
    policy: str | None = None
    holder_task_name: str | None = None
    holder_task_id: str | None = None
    holder_worker: str | None = None
    detail: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in _FIELDS}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Event:
        def text(name: str) -> str | None:
            value = data.get(name)
            return None if value is None else str(value)

        return cls(at=float(data.get("at") or 0.0), kind=str(data.get("kind") or "?"),
                   key=str(data.get("key") or "?"),
                   **{name: text(name) for name in _FIELDS[3:]})


def recent_events(client: Any, prefix: str, limit: int = 20) -> list[Event]:
    """The newest ``limit`` records under ``prefix``, newest first.

    Unreadable records are skipped.  Redis errors propagate (the caller reports them).
    """
    if limit <= 0:
        return []
    out = []
    for raw in client.lrange(events_key(prefix), 0, limit - 1):
        try:
            data = json.loads(raw)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append(Event.from_dict(data))
    return out


def recording_enabled(app: Any) -> bool:
    """Whether ``app`` asked for contention history (``dlock_record_events``)."""
    return bool(conf_value(app, "dlock_record_events", False))


def _recording(sender: Any) -> bool:
    """Whether the app of ``sender`` (a task) records events: read once per task and
    process, as the task's other settings are (:meth:`LockedTask.dlock_settings`),
    since every acquisition asks."""
    cache = getattr(sender, "__dict__", None)
    if not isinstance(cache, dict):  # (a class's is read-only)
        return recording_enabled(getattr(sender, "app", None))
    found: bool | None = cache.get("_dlock_record_events")
    if found is None:
        found = recording_enabled(getattr(sender, "app", None))
        cache["_dlock_record_events"] = found
    return found


def push_event(pipe: Any, prefix: str, event: Event) -> None:
    """Queue on ``pipe`` the recording of ``event`` under ``prefix``: the history
    list, capped, and its minute's count (:mod:`.event_counts`)."""
    key = events_key(prefix)
    pipe.lpush(key, json.dumps(event.as_dict(), separators=(",", ":")))
    pipe.ltrim(key, 0, EVENTS_MAX - 1)
    pipe.expire(key, EVENTS_TTL)
    count_into(pipe, prefix, event.kind, event.at)


def _record(task: Any, event: Event) -> None:
    try:
        pipe = get_client(task.app).pipeline(transaction=False)
        push_event(pipe, read_setting(task, "lock_prefix"), event)
        pipe.execute()
    except (RedisError, DLockError) as exc:
        logger.debug("could not record a %s event for %r: %s", event.kind, event.key,
                     exc)


def _on_acquired(sender: Any = None, name: str = "?", **_: Any) -> None:
    """An acquisition is counted (its minute's count), not kept in the history."""
    if not _recording(sender):
        return
    try:
        pipe = get_client(sender.app).pipeline(transaction=False)
        count_into(pipe, read_setting(sender, "lock_prefix"), "acquired")
        pipe.execute()
    except (RedisError, DLockError) as exc:
        logger.debug("could not count an acquisition of %r: %s", name, exc)


def _on_contended(sender: Any = None, name: str = "?", policy: str | None = None,
                  holder: Any = None, task_id: str | None = None, error: Any = None,
                  **_: Any) -> None:
    if not _recording(sender):
        return
    if isinstance(error, BackendUnavailable):
        return
    info = getattr(holder, "info", None) or {}
    request = getattr(sender, "request", None)
    _record(sender, Event(
        at=time.time(), kind="contended", key=name,
        task_name=getattr(sender, "name", None), task_id=task_id,
        worker=getattr(request, "hostname", None), policy=policy,
        holder_task_name=info.get("task_name"), holder_task_id=info.get("task_id"),
        holder_worker=info.get("worker") or info.get("host"),
        detail=holder.describe() if holder is not None else None))


def _on_lost(sender: Any = None, name: str = "?", task_id: str | None = None,
             reason: str | None = None, **_: Any) -> None:
    if not _recording(sender):
        return
    # Sent from the scheduler thread: the task's request context is not ours to read.
    _record(sender, Event(at=time.time(), kind="lost", key=name,
                          task_name=getattr(sender, "name", None), task_id=task_id,
                          detail=reason))


def _on_duplicate(sender: Any = None, name: str = "?", task_id: str | None = None,
                  existing: str | None = None, mode: str | None = None,
                  policy: str | None = None, **_: Any) -> None:
    if not _recording(sender):
        return
    _record(sender, Event(at=time.time(), kind="duplicate", key=name,
                          task_name=getattr(sender, "name", None), task_id=task_id,
                          policy=policy, holder_task_id=existing,
                          detail=f"lock_mode {mode}" if mode else None))


def _on_parked(sender: Any = None, name: str = "?", task_id: str | None = None,
               delay: float | None = None, rate: str | None = None, **_: Any) -> None:
    if not _recording(sender):
        return
    request = getattr(sender, "request", None)
    slot = "" if delay is None else f", its slot in {delay:.2f}s"
    _record(sender, Event(at=time.time(), kind="parked", key=name,
                          task_name=getattr(sender, "name", None), task_id=task_id,
                          worker=getattr(request, "hostname", None),
                          detail=f"lock_rate {rate or '?'}{slot}"))


_installed = False
_install_lock = threading.Lock()


def install() -> None:
    """Connect the recorders to the package's signals (once; idempotent).

    Done when a :class:`~celery_dlock.LockedTask` is bound to an app; the recorders do
    nothing unless the task's app sets ``dlock_record_events``.
    """
    global _installed
    with _install_lock:
        if _installed:
            return
        signals.lock_contended.connect(_on_contended, weak=False,
                                       dispatch_uid="celery_dlock.events.contended")
        signals.lock_lost.connect(_on_lost, weak=False,
                                  dispatch_uid="celery_dlock.events.lost")
        signals.lock_duplicate.connect(_on_duplicate, weak=False,
                                       dispatch_uid="celery_dlock.events.duplicate")
        signals.lock_parked.connect(_on_parked, weak=False,
                                    dispatch_uid="celery_dlock.events.parked")
        signals.lock_acquired.connect(_on_acquired, weak=False,
                                      dispatch_uid="celery_dlock.events.acquired")
        _installed = True
