"""Queue markers: what enqueue-time uniqueness keeps per lock name, and the record a
marked message carries.

A marker says "a call of this lock name is queued": it holds the call's task id and
expires (``lock_queue_ttl`` after the enqueue, plus the countdown or eta; never later
than the message's own ``expires``), so a message lost by the broker (a purge, a lost
queue) keeps its name from being queued again for at most that long.  The backend keeps
them (:class:`MarkerStore`; on Redis, ``P:{NAME}:m`` beside the lock's hash).

A marked message carries :data:`MARKER_HEADER`, a record of its marker (lock name,
prefix, mode, duplicate policy and its task id), so the worker can hand the marker
over when the call starts, and free it when the message is revoked, rejected or
expires, without knowing the task.  Lifecycle, per mode::

    until_started       send: claim   start: hand-over removes it
    until_finished      send: claim (a running holder counts)   start: hand-over
                        removes it; the runtime lock keeps the name until the end
    queued_and_running  send: claim   start: hand-over removes it
    throttle            send: claim (ttl = lock_ttl, the window); kept after start

The hand-over runs after the runtime lock is taken, so at every instant the name
shows its marker or its holder (``until_finished`` checks both): no gap in which a
second call could queue.  A call that ends without taking the lock (skip, raise,
its bound of retries) frees its marker; a call re-queued with its task id (a retry,
a contention retry) keeps it.

Re-queues: a call re-queued before it started (a contention retry, a rate park) keeps
its marker; a ``throttle`` call's re-queue claims nothing, so its window keeps counting
from the accepted enqueue.  A call that started and retries (``self.retry()``,
``autoretry_for``) carries ``started`` in its record: in ``until_finished`` it takes
the marker again (the name stays held between its attempts), in ``until_started`` and
``queued_and_running`` it claims nothing (the name freed at its start, and a call
queued meanwhile stays queued) but keeps its task id as waiting until it starts (a
send of that id is a duplicate); its start is never taken for a superseded call's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from datetime import datetime, timezone
from typing import Any, Protocol

__all__ = [
    "CLAIMED",
    "MARKER_HEADER",
    "OURS",
    "PENDING",
    "QUEUED",
    "REPLACED",
    "RUNNING",
    "MarkerRecord",
    "MarkerStore",
    "marker_ttl",
    "record_of",
]

#: The message header that carries a marked call's :class:`MarkerRecord`.
MARKER_HEADER = "dlock_marker"

# Claim replies (see celery_dlock.backends.redis.markers).
CLAIMED, OURS, QUEUED, RUNNING, REPLACED, PENDING = 0, 1, 2, 3, 4, 5


class MarkerStore(Protocol):
    """What enqueue-time uniqueness asks of a backend."""

    def claim(self, prefix: str, name: str, task_id: str, ttl: float, *,
              running_counts: bool, replace: bool, requeue: bool,
              op: str = "", started: bool = False,
              waits: bool = False) -> tuple[int, str, float | None]: ...

    def confirm(self, prefix: str, name: str, task_id: str) -> bool: ...

    def undo(self, prefix: str, name: str, task_id: str, op: str,
             ttl: float) -> bool: ...

    def hand_over(self, prefix: str, name: str, task_id: str, *, remove: bool,
                  replaced_check: bool, running_counts: bool = False,
                  keep: float = 0.0) -> str | None: ...

    def keep_for_redelivery(self, prefix: str, name: str, task_id: str, ttl: float, *,
                            running_counts: bool) -> bool: ...

    def clear(self, prefix: str, name: str, task_id: str) -> bool: ...

    def queued(self, prefix: str) -> Iterator[tuple[str, str, float | None]]: ...

    def read(self, prefix: str, name: str) -> tuple[str, float | None] | None: ...


class MarkerRecord:
    """The marker a message carries: ``name`` under ``prefix``, for ``task_id``.

    ``started``: the call has started once (its marker was handed over), so this
    message is its retry (``self.retry()``, ``autoretry_for``, or a re-queue of such a
    retry): it is never superseded, and in ``until_started`` and ``queued_and_running``
    it claims nothing (the name freed when the call started)."""

    __slots__ = ("mode", "name", "policy", "prefix", "started", "task_id")

    def __init__(self, name: str, prefix: str, mode: str, policy: str,
                 task_id: str, started: bool = False) -> None:
        self.name = name
        self.prefix = prefix
        self.mode = mode
        self.policy = policy
        self.task_id = task_id
        self.started = started

    def header(self) -> dict[str, str]:
        fields = {"name": self.name, "prefix": self.prefix, "mode": self.mode,
                  "policy": self.policy, "id": self.task_id}
        if self.started:
            fields["started"] = "1"
        return fields

    @property
    def removed_at_start(self) -> bool:
        """Whether the call's start removes the marker (all modes but throttle)."""
        return self.mode != "throttle"

    def __repr__(self) -> str:
        return f"<MarkerRecord {self.prefix}:{self.name} {self.mode} {self.task_id}>"


def record_of(source: Any) -> MarkerRecord | None:
    """The marker record of a request, a message's headers, or None."""
    raw = getattr(source, MARKER_HEADER, None) if not isinstance(source, Mapping) \
        else source.get(MARKER_HEADER)
    if raw is None and not isinstance(source, Mapping):
        # a task's request (its headers), or a worker's Request in the main process
        # (the message's headers, as its request_dict)
        for where in ("headers", "request_dict"):
            headers = getattr(source, where, None)
            if isinstance(headers, Mapping):
                raw = headers.get(MARKER_HEADER)
                if raw is not None:
                    break
    if not isinstance(raw, Mapping):
        return None
    try:
        fields = [raw["name"], raw["prefix"], raw["mode"], raw["policy"], raw["id"]]
    except KeyError:
        return None
    if not all(isinstance(f, str) and f for f in fields):
        return None
    name, prefix, mode, policy, task_id = fields
    return MarkerRecord(name, prefix, mode, policy, task_id,
                        started=raw.get("started") == "1")


def _seconds(value: Any, now: datetime) -> float | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value)
        except ValueError:
            return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return float((value - now).total_seconds())
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None


def marker_ttl(mode: str, settings: Mapping[str, Any], options: Mapping[str, Any],
               now: datetime | None = None) -> float:
    """How long a new marker lives: the throttle window, or ``lock_queue_ttl`` after
    the call's countdown or eta; never past the message's ``expires``."""
    if mode == "throttle":
        return float(settings["lock_ttl"])
    now = now or datetime.now(timezone.utc)
    ttl = float(settings["lock_queue_ttl"])
    delay = _seconds(options.get("countdown"), now)
    if delay is None:
        delay = _seconds(options.get("eta"), now)
    if delay is not None and delay > 0:
        ttl += delay
    expires = _seconds(options.get("expires"), now)
    if expires is not None and expires > 0:
        ttl = min(ttl, expires)
    return max(ttl, 0.001)
