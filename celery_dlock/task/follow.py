"""A duplicate call inside a canvas: sent as a *follower*, so its own task id gets an
outcome.

The caller of a group, a chord or a chain (or of a call with ``link`` callbacks)
holds each member's own task id: the group's results, the chord's counter, the next
link.  A duplicate member that is not sent (:mod:`celery_dlock.task.modes`) would
leave its id pending for ever: the group's ``get()`` hangs, the chord's body never
runs, the rest of the chain never runs.  So, in a canvas only, a duplicate is
published anyway, carrying :data:`FOLLOW_HEADER` (the existing call's task id and
the duplicate policy) and no queue marker.  On a worker a follower takes no lock and
never runs the body while the existing call lives:

* ``return_existing`` (and ``replace`` against a running call): it takes the
  existing call's outcome as its own: that call's result when it succeeded, its
  error when it failed or was revoked.  While the existing call is queued, running
  or being retried, the follower re-queues itself (after 0.1 s, doubling up to 2 s),
  holding nothing and no worker process, in state RETRY.  An existing call that is
  gone without an outcome (neither queued, running nor ended on three checks in a
  row: its message was lost) is not waited for: the follower runs as the call it is,
  with its lock; one whose task keeps no results ends with ``None``;
* ``drop``: it ends at once with ``None`` (what a dropped call's ``get()`` returns);
* ``raise``: it fails with :class:`~celery_dlock.AlreadyQueued` naming the existing
  call (the chord or the chain fails, as with any failing member).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from celery import states
from celery.backends.base import DisabledBackend
from celery.exceptions import Retry, TaskRevokedError

from ..core.errors import DLockError
from .backend import backend_for, markers_for
from .duplicates import AlreadyQueued

__all__ = ["FOLLOW_HEADER", "follow", "follow_header", "follows", "in_canvas"]

logger = logging.getLogger("celery_dlock.task")

#: The message header of a follower: ``{"id", "policy", "name", "prefix", "polls",
#: "gone"}`` (``run``: it runs as the call it is).
FOLLOW_HEADER = "dlock_follows"

#: Checks in a row that find the existing call gone before the follower runs itself.
GONE_CHECKS = 3
_FIRST_DELAY, _MAX_DELAY = 0.1, 2.0
#: States of a call that is alive without an outcome yet.
_ALIVE = frozenset({states.RETRY, states.STARTED, states.RECEIVED})


def in_canvas(options: Mapping[str, Any]) -> bool:
    """Whether a call is sent as part of a canvas: a group or chord member, a chain's
    link (its ``chain`` option, empty for the last link), or a call with callbacks."""
    return bool(options.get("group_id") or options.get("chord") or options.get("link")
                or options.get("link_error")) or options.get("chain") is not None


def follow_header(other: str, policy: str, name: str, prefix: str) -> dict[str, Any]:
    return {"id": other, "policy": policy, "name": name, "prefix": prefix,
            "polls": 0, "gone": 0}


def follows(request: Any) -> dict[str, Any] | None:
    """The follower header of a worker's request, or None."""
    raw = getattr(request, FOLLOW_HEADER, None)
    if raw is None:
        raw = (getattr(request, "headers", None) or {}).get(FOLLOW_HEADER)
    return dict(raw) if isinstance(raw, Mapping) and raw.get("run") is not True \
        else None


def follow(task: Any, request: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           info: dict[str, Any], run: Callable[[], Any]) -> Any:
    """Run a follower (see the module): its outcome, a re-queue (Retry), or ``run()``
    when the existing call is gone."""
    other, policy = str(info.get("id") or ""), info.get("policy")
    if policy == "raise":
        raise AlreadyQueued(f"a call of {info.get('name')!r} was already queued or "
                            f"running (task {other})", lock_name=info.get("name"),
                            task_id=other or None)
    if policy == "drop" or not other:
        return None
    keeps_results = not task.ignore_result and \
        not isinstance(task.backend, DisabledBackend)
    if keeps_results:
        result = task.AsyncResult(other)
        state = result.state
        if state == states.SUCCESS:
            return result.result
        if state in states.PROPAGATE_STATES:
            error = result.result
            if isinstance(error, BaseException):
                raise error
            raise TaskRevokedError(f"{other} ended in state {state}")
    gone = 0 if _alive(task.app, info, other) else int(info.get("gone") or 0) + 1
    if gone >= GONE_CHECKS:
        if not keeps_results:
            return None  # it ended (its outcome is not kept)
        logger.warning("Task %s[%s]: the call %s it duplicates is gone without an "
                       "outcome (its message was lost): it runs itself", task.name,
                       request.id, other)
        _mark_run(request, info)
        return run()
    polls = int(info.get("polls") or 0)
    delay = min(_MAX_DELAY, _FIRST_DELAY * 2.0 ** min(polls, 16))
    headers = {**(getattr(request, "headers", None) or {}),
               FOLLOW_HEADER: {**info, "polls": polls + 1, "gone": gone}}
    sig = task.signature_from_request(request, args, kwargs, countdown=delay,
                                      retries=request.retries, headers=headers)
    sig.apply_async()
    raise Retry(f"waits for the outcome of {other}", when=delay, sig=sig)


def _alive(app: Any, info: Mapping[str, Any], other: str) -> bool:
    """Whether ``other`` is queued, running or being retried (True when it cannot be
    told)."""
    name, prefix = str(info.get("name") or ""), str(info.get("prefix") or "")
    try:
        marker = markers_for(app).read(prefix, name)
        if marker is not None and marker[0] == other:
            return True
        hold = backend_for(app).read(prefix, name)
        if hold is not None and other in {h.task_id for h in (hold, *hold.holders)}:
            return True  # (a semaphore's holders: every slot's)
    except DLockError:
        return True
    try:
        return app.AsyncResult(other).state in _ALIVE
    except Exception:
        return True


def _mark_run(request: Any, info: dict[str, Any]) -> None:
    """From here on the follower is the call it is (its re-queues too)."""
    header = {**info, "run": True}
    headers = getattr(request, "headers", None)
    if isinstance(headers, dict):
        headers[FOLLOW_HEADER] = header
    try:
        setattr(request, FOLLOW_HEADER, header)
    except AttributeError:
        pass
