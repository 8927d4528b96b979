"""A marked call on the worker: its queue marker handed over when it starts, freed
when it ends without running (see :mod:`celery_dlock.task.markers`)."""

from __future__ import annotations

import logging
from typing import Any

from celery.exceptions import Ignore, Reject, Retry
from celery.worker import state as worker_state

from ..core.errors import DLockError
from ..core.protocol import Lock
from .backend import markers_for
from .markers import MARKER_HEADER, MarkerRecord, record_of

__all__ = ["TIMED_OUT", "end_started", "free_marker", "free_marker_of", "hand_over",
           "wait_for_redelivery"]

logger = logging.getLogger("celery_dlock.task")

#: Set on a worker's request killed for its hard time limit (Celery acknowledges its
#: message: it never comes back).
TIMED_OUT = "_dlock_timed_out"

#: Set on a worker's request whose call :func:`wait_for_redelivery` kept live.
_KEPT = "_dlock_kept_for_redelivery"

#: Set on a request whose marker :func:`free_marker` freed (skip frees it before it
#: stores its result; the attempt's end then need not ask again).
_FREED = "_dlock_marker_freed"


def _own_record(request: Any) -> MarkerRecord | None:
    record = record_of(request)
    if record is None or record.task_id != getattr(request, "id", None):
        return None
    return record


def hand_over(task: Any, request: Any, lock: Lock, keep: float) -> None:
    """The call starts holding its lock: its queue marker goes (per its mode), and
    its task id is kept among the started calls waiting (for ``keep`` seconds, or
    until :func:`end_started`), so that its message, should its worker die (whole,
    or with the store unreachable then), comes back as this call: never superseded,
    and a send of its task id meanwhile a duplicate of it.

    A call whose marker now names another task id was superseded: replaced
    (``on_duplicate="replace"``), revoked before a worker read the revoke (the next
    call took the marker), or kept in the queue past ``lock_queue_ttl`` while a later
    call was accepted.  The later call runs; this one ends here (Ignore), recorded as
    revoked, without running.  A throttle's window is left alone: each accepted call
    runs.

    The retry of a call that started (its record says ``started``) is never
    superseded: it removes the marker only if it took it again (``until_finished``);
    in the other modes it claimed none, and its task id leaves the retries waiting
    (held by the lock from here on).
    Every other call, once handed over, is marked ``started`` on its request, so that
    a retry it asks for carries the mark."""
    record = _own_record(request)
    if record is None or not record.removed_at_start:
        return
    bare = record.started and record.mode != "until_finished"  # no marker of its own
    try:
        replaced_by = markers_for(task.app).hand_over(
            record.prefix, record.name, record.task_id, remove=not bare,
            replaced_check=not record.started,
            running_counts=record.mode == "until_finished", keep=keep)
    except DLockError as exc:
        logger.warning("Task %s[%s]: could not hand its queue marker of %r over (it "
                       "expires within lock_queue_ttl): %s", task.name, request.id,
                       record.name, exc)
        replaced_by = None
    if replaced_by is None:
        _mark_started(request, record)
        return
    lock.release()
    logger.info("Task %s[%s] does not run: its queue marker of %r was taken by %s "
                "(replaced, revoked, or queued past lock_queue_ttl)", task.name,
                request.id, record.name, replaced_by)
    if not request.ignore_result and not task.ignore_result:
        task.backend.mark_as_revoked(request.id, reason=f"superseded by {replaced_by}",
                                     request=request)
    raise Ignore(f"{request.id} was superseded by {replaced_by}")


def _mark_started(request: Any, record: MarkerRecord) -> None:
    """Record on ``request`` that its call started: a retry it asks for copies the
    request's headers, and so carries a record that says so."""
    if record.started:
        return
    record.started = True
    header = record.header()
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict) and MARKER_HEADER in headers:
        headers[MARKER_HEADER] = header
    if isinstance(getattr(request, MARKER_HEADER, None), dict):
        try:
            setattr(request, MARKER_HEADER, header)
        except AttributeError:  # a request that takes no attributes
            pass


def end_started(task: Any, request: Any, exc: BaseException | None = None) -> None:
    """A call that started (was handed over) ends: its task id leaves the started
    calls waiting (a marker still naming it goes too), unless the attempt ends
    re-queued as this same call (``self.retry()``, a requeueing ``Reject``: the retry
    keeps it)."""
    if isinstance(exc, Retry) or (isinstance(exc, Reject) and exc.requeue):
        return
    record = _own_record(request)
    if record is not None and record.started:
        free_marker_of(task.app, request, f"Task {task.name}[{request.id}]")


def free_marker(task: Any, request: Any, requeue: bool = True) -> None:
    """The call ends without running (skip, raise, its bound of contention retries):
    free its queue marker (a throttle's window stays), once."""
    if requeue and not getattr(request, _FREED, False):
        free_marker_of(task.app, request, getattr(task, "name", "?"))
        try:
            setattr(request, _FREED, True)
        except AttributeError:  # a request that takes no attributes: freed again
            pass


def free_marker_of(app: Any, source: Any, what: str) -> bool:
    """Free the queue marker a request or a message's headers carry, if it is still
    that call's (revoked, rejected, expired, or ended without running); a throttle's
    window stays: it counts accepted calls."""
    record = _own_record(source) if not isinstance(source, dict) else record_of(source)
    if record is None or not record.removed_at_start:
        return False
    try:
        return markers_for(app).clear(record.prefix, record.name, record.task_id)
    except DLockError as exc:
        logger.warning("%s: could not remove the queue marker of %r (it expires within "
                       "lock_queue_ttl): %s", what, record.name, exc)
        return False


def wait_for_redelivery(task: Any, request: Any) -> None:
    """The process running ``request`` died, and its message will be delivered
    again (``acks_late`` with ``reject_on_worker_lost``): a call that had started is
    kept live as its retry would be (in ``until_finished`` it takes the marker again;
    in the other modes its task id waits), so that a send of that task id meanwhile
    is a duplicate of this call, not a second message of it, and (``until_finished``)
    a new call of the name is a duplicate too; its redelivery is never superseded.
    One that had not started keeps what its marker (or its replace) says.
    Written before the dead process's lock is freed (the lock said "running" until
    then).  The redelivery's start takes it out; it lapses after ``lock_queue_ttl``
    if none comes."""
    record = _own_record(request)
    if record is None or not record.removed_at_start or getattr(request, _KEPT, False):
        return
    if not (getattr(task, "acks_late", False) and
            getattr(task, "reject_on_worker_lost", False)):
        return  # Celery ends the call (WorkerLostError): nothing comes back
    if request.id in worker_state.revoked or getattr(request, TIMED_OUT, False):
        return  # revoke(terminate=True), a hard time limit: nothing comes back either
    try:
        markers_for(task.app).keep_for_redelivery(
            record.prefix, record.name, record.task_id,
            float(task.dlock_settings()["lock_queue_ttl"]),
            running_counts=record.mode == "until_finished")
        setattr(request, _KEPT, True)  # (once: the watch of the child, or Celery)
    except DLockError as exc:
        logger.warning("Task %s[%s]: could not keep its task id as waiting for its "
                       "redelivery (a send of it meanwhile is a second message): %s",
                       task.name, request.id, exc)
