"""Uniqueness modes at enqueue, and what a duplicate gets.

The runtime lock (taken when a call starts on a worker) stays the authority: no two
bodies of one lock name ever overlap, whatever the mode.  A mode other than
``while_running`` adds a *queue marker* (:mod:`celery_dlock.task.markers`) so that a
second call is caught before it is queued:

=====================  ==========================================  =====================
mode                   a second call is a duplicate while ...      the name frees when
=====================  ==========================================  =====================
``while_running``      (never: no enqueue-time check)              --
``until_started``      the first is queued                         the first starts
``until_finished``     the first is queued or running              the first ends
``queued_and_running`` another is queued (one may run besides)     the queued one starts
``throttle``           a call was accepted less than ``lock_ttl``  ``lock_ttl`` after
                       ago (whether or not it ran or finished)     the accepted enqueue
=====================  ==========================================  =====================

``on_duplicate`` (what the duplicate call gets):

* ``return_existing`` (the default): the queued (or running) call's ``AsyncResult``,
  same id, so ``.get()`` waits for the one run;
* ``raise``: :class:`~celery_dlock.AlreadyQueued` with the existing ``task_id``;
* ``drop``: a :class:`~celery_dlock.DroppedResult` (state ``DROPPED``): never runs;
* ``replace``: the queued call is revoked and this one queued instead (latest
  arguments win, one run).  A call that has started is never stopped: against a
  running call (``until_finished``) ``replace`` acts as ``return_existing``.  With
  ``throttle`` it is refused (the window's call may have run already).  A replace
  stands once its publish went through (the claim, the publish, then a confirm); a
  failed publish takes it back: the queued call keeps its marker and runs.

A send of a task id already queued, running, waiting for its retry or for the
redelivery of a message whose worker process died is a duplicate
of that call (in every mode; ``replace`` acts as ``return_existing`` then), and so is
a send of a replaced task id: only the call's own re-queue takes the marker again.
Each send's claim carries an operation id, so a claim re-sent after a lost reply gets
its first answer; a claim that got no reply is taken back (nothing was published).

A duplicate inside a canvas (a group or chord member, a chain's link, a call with
callbacks) is sent as a follower instead, so that its own task id gets an outcome
(:mod:`celery_dlock.task.follow`).

Cost: one script call per send (the claim; a replace adds the confirm); at start one
script call (the hand-over, after the lock is taken; none in ``throttle``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery import states
from kombu.utils.uuid import uuid

from ..core.errors import BackendUnavailable, DLockError, InvalidLockConfig
from . import signals
from .attempt import attempts
from .backend import markers_for
from .duplicates import AlreadyQueued, DroppedResult
from .follow import FOLLOW_HEADER, follow_header, in_canvas
from .markers import (
    CLAIMED,
    MARKER_HEADER,
    OURS,
    PENDING,
    QUEUED,
    REPLACED,
    RUNNING,
    MarkerRecord,
    MarkerStore,
    marker_ttl,
    record_of,
)
from .settings import check_combination, check_limit_mode
from .takeback import settle, take_back_later

__all__ = ["send"]

logger = logging.getLogger("celery_dlock.task")


def _stale(app: Any, task: Any, task_id: str) -> bool:
    """Whether the result store says ``task_id`` ended or was revoked (its marker
    outlived it); False when it cannot tell."""
    try:
        result = (task.AsyncResult if task is not None else app.AsyncResult)(task_id)
        return result.state in states.READY_STATES
    except Exception:
        return False


#: How long a replace waits for another replace's publish to settle (stand or be
#: taken back), and how often it asks.
PENDING_WAIT = 2.0
PENDING_STEP = 0.02


def send(app: Any, original: Callable[..., Any], task: Any, name: str, args: Any,
         kwargs: Any, options: dict[str, Any], per_call: Mapping[str, Any]) -> Any:
    """Send one call of a task with an enqueue-time mode (see the module's table)."""
    if task is None or not callable(getattr(task, "lock_name", None)):
        raise InvalidLockConfig(
            f"lock_mode for {name!r}: the task is not a LockedTask registered in this "
            f"app, so its lock name cannot be computed where it is sent")
    settings = {**task.dlock_settings(), **per_call}
    mode, policy = settings["lock_mode"], settings["on_duplicate"]
    check_combination(f"call of {name!r}", mode, policy)
    check_limit_mode(f"call of {name!r}", mode, settings["lock_limit"])
    lock_name = task.lock_name(tuple(args or ()), kwargs or {})
    prefix = settings["lock_prefix"]
    task_id = options.get("task_id") or uuid()
    options["task_id"] = task_id
    headers = dict(options.get("headers") or {})
    if FOLLOW_HEADER in headers:  # a duplicate's follower, re-queued: never claims
        return original(name, args, kwargs, **options)
    record = record_of(headers)
    # A call accepted before and re-queued with its task id (a retry, a contention
    # retry, a duplicate delivery's copy) is never a duplicate of anything.
    requeue = record is not None and record.task_id == task_id
    started = requeue and record is not None and record.started
    if requeue and mode == "throttle":
        # A throttle call's re-queue leaves its window as it is (it counts from the
        # accepted enqueue): published as it is, claiming nothing.
        headers[MARKER_HEADER] = MarkerRecord(lock_name, prefix, mode, policy,
                                              task_id, started).header()
        options["headers"] = headers
        return original(name, args, kwargs, **options)
    store = markers_for(app)
    ttl = marker_ttl(mode, settings, options)
    if started and mode != "until_finished":
        # The retry of a started call holds no name in until_started and
        # queued_and_running (it freed when the call started): it claims nothing, but
        # its task id is kept as waiting for its retry (before this attempt releases
        # its lock), so that a send of it is a duplicate of this call.
        return _retry_waits(store, original, task, prefix, lock_name, task_id, ttl,
                            (name, args, kwargs), options, headers,
                            MarkerRecord(lock_name, prefix, mode, policy, task_id, True))

    op = uuid()  # the same for a re-sent claim (its reply lost), new for each send

    def claim() -> tuple[int, str, float | None]:
        return store.claim(prefix, lock_name, task_id, ttl,
                           running_counts=mode == "until_finished",
                           replace=policy == "replace" and not requeue, requeue=requeue,
                           op=op, started=started)

    # This process's claims of the name whose take-back waits for the store are taken
    # back first: a call never published is nobody's duplicate.
    settle(prefix, lock_name)
    try:
        code, other, left = claim()
    except BackendUnavailable as exc:
        if not requeue:
            # No reply: the claim may have run, or may run later (a stalled server).
            # Nothing is published, so it is taken back (its ttl bounds it).
            take_back_later(store, prefix, lock_name, task_id, op, ttl)
            raise
        # A started call's retry, sent from its body, tries again while the body's
        # hold stands: the name stays answered for by the hold until then.
        answer = _while_held(task, task_id, claim) if started else None
        if answer is None:
            # An accepted call's re-queue (a retry, a contention re-queue, a rate
            # park) is never lost for want of its marker: it is published all the
            # same, with its record; its start finds what the name's marker says.
            logger.warning("Task %s[%s] is re-queued without its queue marker of %r: "
                           "%s", task.name, task_id, lock_name, exc)
            answer = (OURS, task_id, None)
        code, other, left = answer
    waited = 0.0
    while code == PENDING and waited < PENDING_WAIT:
        time.sleep(PENDING_STEP)  # another replace's publish: settled in milliseconds
        waited += PENDING_STEP
        code, other, left = claim()
    if code == PENDING:  # its caller never settled it: a duplicate of that call
        code = QUEUED
    # (A marker naming this very task id is never judged by the result store: a
    # task id sent again may have a result of an earlier run.)
    if code == QUEUED and not requeue and mode != "throttle" and other and \
            other != task_id and _stale(app, task, other):
        store.clear(prefix, lock_name, other)  # its call ended or was revoked
        code, other, left = claim()
    if requeue or code in (CLAIMED, OURS, REPLACED):
        headers[MARKER_HEADER] = MarkerRecord(lock_name, prefix, mode, policy,
                                              task_id, started).header()
        options["headers"] = headers
        try:
            result = original(name, args, kwargs, **options)
        except BaseException:
            if code in (CLAIMED, REPLACED):
                _take_back(store, prefix, lock_name, task_id, op, ttl)
            raise
        if code == REPLACED:
            _replaced(app, task, store, prefix, lock_name, other, task_id, mode)
        return result
    if other != task_id and in_canvas(options):
        # Its own id (not the existing call's) must get an outcome: a follower.
        _told(task, lock_name, task_id, other, mode, policy)
        headers[FOLLOW_HEADER] = follow_header(
            other, "return_existing" if policy == "replace" else policy, lock_name,
            prefix)
        options["headers"] = headers
        return original(name, args, kwargs, **options)
    return _duplicate(app, task, lock_name, task_id, other, left, mode, policy,
                      running=code == RUNNING,
                      arguments=task.lock_arguments(tuple(args or ()), kwargs or {}))


#: How often a started call's re-queue asks the store again while its hold stands.
HELD_RETRY_STEP = 0.1
HELD_RETRY_MAX_STEP = 0.5


def _while_held(task: Any, task_id: str,
                claim: Callable[[], tuple[int, str, float | None]],
                ) -> tuple[int, str, float | None] | None:
    """The claim of a started call's re-queue (its ``self.retry()``, sent from its
    body in this thread), asked again until the store answers while the body's hold
    stands: as long as it stands, a send of the name finds the name held, so the
    re-queue's marker, written late, leaves no moment without an answer for the name.
    None when the hold was lost first (or no body of this call runs here): the
    re-queue is then published without its marker (docs/modes.md, Limits)."""
    attempt = attempts.get().get(getattr(task, "name", ""))
    if attempt is None or attempt.task_id != task_id:
        return None
    lock = attempt.lock
    # The watchdog finds a hold lost within its ttl of the store's silence; the
    # deadline only bounds the loop should it not.
    deadline = time.monotonic() + 2 * lock.ttl + 1.0
    step = HELD_RETRY_STEP
    while not lock.lost and attempt.lost_reason is None and time.monotonic() < deadline:
        time.sleep(step)
        step = min(step * 2, HELD_RETRY_MAX_STEP)
        try:
            return claim()
        except BackendUnavailable:
            continue
    return None


def _retry_waits(store: MarkerStore, original: Callable[..., Any], task: Any,
                 prefix: str, lock_name: str, task_id: str, ttl: float,
                 call: tuple[Any, Any, Any], options: dict[str, Any],
                 headers: dict[str, Any], record: MarkerRecord) -> Any:
    """Publish the retry of a started call that holds no marker, its task id kept
    as waiting meanwhile (published all the same when the store cannot be reached
    while the body's hold stands)."""
    op = uuid()

    def claim() -> tuple[int, str, float | None]:
        return store.claim(prefix, lock_name, task_id, ttl, running_counts=False,
                           replace=False, requeue=True, op=op, started=True, waits=True)

    try:
        claim()
    except BackendUnavailable as exc:
        if _while_held(task, task_id, claim) is None:
            logger.warning("Task %s[%s] is re-queued without its record of %r as a "
                           "retry waiting (a send of its task id meanwhile is not "
                           "caught): %s", task.name, task_id, lock_name, exc)
    headers[MARKER_HEADER] = record.header()
    options["headers"] = headers
    try:
        return original(*call, **options)
    except BaseException:
        try:  # nothing waits: its task id is free again
            store.clear(prefix, lock_name, task_id)
        except DLockError:
            pass  # it expires within its ttl
        raise


def _take_back(store: MarkerStore, prefix: str, name: str, task_id: str, op: str,
               ttl: float) -> None:
    """The publish failed (or the claim got no reply): the claim is taken back (a
    replace replaces nothing: the call it replaced is queued under the name again,
    and runs)."""
    try:
        store.undo(prefix, name, task_id, op, ttl)
    except DLockError as exc:
        # (the broker and the store down together, a Redis restart between the claim
        # and the publish): tried again until the store answers, or the name would
        # stay taken for the marker's ttl by a call never published
        logger.warning("Could not take back the queue marker of %r after a failed "
                       "publish yet (a call it replaced starts all the same: the "
                       "replace was not confirmed); trying again: %s", name, exc)
        take_back_later(store, prefix, name, task_id, op, ttl)


def _replaced(app: Any, task: Any, store: MarkerStore, prefix: str, lock_name: str,
              old: str, new: str, mode: str) -> None:
    try:
        stands = store.confirm(prefix, lock_name, new)
    except DLockError as exc:  # unconfirmed: ``old`` may still start (and run)
        logger.warning("Task %s[%s] replaced %s, but the replace could not be "
                       "confirmed (if %s starts first, it runs and %s does not): %s",
                       task.name, new, old, old, new, exc)
        return
    if not stands:  # ``old`` started first and took it back, or a later call
        # replaced this one (whose confirm or take-back decides for ``old``)
        if mode == "until_finished":
            logger.info("Task %s[%s] does not replace %s (it started first, or a later "
                        "call replaced %s): %s never runs (superseded)", task.name,
                        new, old, new, new)
        else:
            logger.info("Task %s[%s] does not replace %s (it started first, and %s "
                        "runs after it; or a later call replaced %s)", task.name, new,
                        old, new, new)
        return
    signals.send(signals.lock_duplicate, task, lock_name, task_id=new, existing=old,
                 mode=mode, policy="replace")
    try:
        app.control.revoke(old)
    except Exception as exc:  # the replaced call still never runs: its start checks
        logger.warning("Task %s[%s] replaced %s, whose revoke failed (it will not run: "
                       "its start finds it replaced): %s", task.name, new, old, exc)


def _told(task: Any, lock_name: str, task_id: str, other: str, mode: str,
          policy: str) -> None:
    signals.send(signals.lock_duplicate, task, lock_name, task_id=task_id,
                 existing=other or None, mode=mode,
                 policy="return_existing" if policy == "replace" else policy)
    logger.info("Task %s: call %s is a duplicate of %s (lock %r, %s): %s", task.name,
                task_id, other or "a call not named (a holder that is not a task, or "
                "the call that replaced it)", lock_name, mode,
                policy)


def _duplicate(app: Any, task: Any, lock_name: str, task_id: str, other: str,
               left: float | None, mode: str, policy: str, running: bool,
               arguments: str | None = None) -> Any:
    _told(task, lock_name, task_id, other, mode, policy)
    if policy == "raise":
        what = "running" if running else "queued"
        raise AlreadyQueued(
            f"a call of {lock_name!r} is already {what}"
            + (f" (task {other})" if other else "") + f" (lock_mode={mode!r})",
            lock_name=lock_name, task_id=other or None, countdown=left,
            arguments=arguments)
    if policy == "drop" or not other:
        return DroppedResult(task_id, other or None, app=app, lock_name=lock_name)
    return task.AsyncResult(other)
