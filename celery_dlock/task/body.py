"""One attempt's body under its lock: run it, release the lock however it ends, and
apply ``lock_lost_action`` to a hold lost meanwhile (``lock_lost`` told once, an
interrupt raised in the body when asked, never while it publishes its retry)."""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from celery.exceptions import Ignore, Reject, Retry

from ..core.errors import DLockError, LockLost
from ..core.protocol import Lock
from . import signals
from .attempt import Attempt, attempts

__all__ = ["end_attempt", "run_body", "state_of"]

logger = logging.getLogger("celery_dlock.task")


def run_body(task: Any, request: Any, lock: Lock, call: Callable[..., Any],
             args: tuple[Any, ...], kwargs: dict[str, Any], started: float,
             settings: Mapping[str, Any]) -> Any:
    """Run the body (``call``) under ``lock``, taken; release it however the body
    ends, and apply ``lock_lost_action`` to a hold lost meanwhile."""
    attempt = Attempt(lock, threading.get_ident(), request.id)
    lock.on_lost = functools.partial(_on_lock_lost, task, attempt, settings)
    if lock.lost:
        # Found lost between the acquire and here (a rate or marker call that
        # hung past the hold's deadline, a release by force), while no on_lost
        # was there to tell: the body must not start on a lock another owner
        # may hold by now.
        if attempt.found_lost(lock.lost_reason or "lost"):
            _report_lost(task, attempt, attempt.lost_reason or "lost")
        attempt.stop()
        end_attempt(task, attempt, "FAILURE", settings)
        raise LockLost(f"lock {attempt.key!r} was lost before the task's body "
                       f"started ({attempt.lost_reason}); the body did not run",
                       lock_name=attempt.key)
    reset = attempts.set({**attempts.get(), task.name: attempt})
    signals.send(signals.lock_acquired, task, lock.name, fence=attempt.fence,
                 task_id=request.id, wait=time.monotonic() - started)
    # Everything the body runs (its except and finally blocks, with-exits, a
    # fallback after MaxRetriesExceededError) runs before the release below.
    try:
        result = call(*args, **kwargs)
    except BaseException as exc:
        attempt.stop()
        attempts.reset(reset)
        end_attempt(task, attempt, state_of(exc), settings)
        raise
    attempt.stop()
    attempts.reset(reset)
    lost = end_attempt(task, attempt, "SUCCESS", settings)
    if lost is None:
        return result
    action = settings["lock_lost_action"]
    if action == "warn":
        logger.warning("Task %s[%s]: its lock %r was lost while it ran (%s); its "
                       "result stands (lock_lost_action='warn')", task.name,
                       request.id, attempt.key, lost)
        return result
    raise LockLost(f"lock {attempt.key!r} was lost while the task ran ({lost}); "
                   f"the attempt fails (lock_lost_action={action!r})",
                   lock_name=attempt.key)


def end_attempt(task: Any, attempt: Attempt, state: str,
                settings: Mapping[str, Any]) -> str | None:
    """Release the attempt's lock; returns why the hold was lost, if it was."""
    lock = attempt.lock
    lost = attempt.lost_reason
    if lock.depth > 0:  # 0 once release_all() ran (a warm shutdown)
        try:
            lock.release()
        except LockLost as exc:
            # found out only now (unless on_lost is telling right now): tell
            if attempt.found_lost(lock.lost_reason or exc.message):
                _report_lost(task, attempt, attempt.lost_reason or exc.message)
            lost = attempt.lost_reason
        except DLockError as exc:
            logger.warning("Task %s[%s]: releasing lock %r: %s", task.name,
                           attempt.task_id, attempt.key, exc)
    if lost is not None and state == "SUCCESS" and \
            settings["lock_lost_action"] != "warn":
        state = "FAILURE"
    signals.send(signals.lock_released, task, attempt.key, fence=attempt.fence,
                 task_id=attempt.task_id,
                 held_for=time.monotonic() - attempt.started,
                 state=state)
    return lost


def _on_lock_lost(task: Any, attempt: Attempt, settings: Mapping[str, Any],
                  lock: Lock) -> None:
    if attempt.found_lost(lock.lost_reason or "lost"):
        _report_lost(task, attempt, attempt.lost_reason or "lost")
    if settings["lock_lost_action"] == "interrupt":
        attempt.interrupt()


def _report_lost(task: Any, attempt: Attempt, reason: str) -> None:
    logger.warning("Task %s[%s]: lock %r lost while running: %s", task.name,
                   attempt.task_id, attempt.key, reason)
    signals.send(signals.lock_lost, task, attempt.key, fence=attempt.fence,
                 task_id=attempt.task_id, reason=reason)


def state_of(exc: BaseException) -> str:
    """The state an attempt that raised ``exc`` ends in (for ``lock_released``)."""
    if isinstance(exc, Retry):
        return "RETRY"
    if isinstance(exc, Ignore):
        return "IGNORED"
    if isinstance(exc, Reject):
        return "REJECTED"
    return "FAILURE"
