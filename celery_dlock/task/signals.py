"""celery-dlock's own signals, in Celery's style (``celery.utils.dispatch.Signal``).

Connect like any Celery signal::

    from celery_dlock import signals

    @signals.lock_contended.connect
    def count_contention(sender, name, policy, holder, **kwargs):
        metrics.increment("contention", tags={"task": sender.name, "policy": policy})

``sender`` is the task instance.  Every signal also passes ``name`` (the lock's name,
as ``celery dlock ls`` shows it) and ``task_id``.  ``lock_lost`` is sent from the
scheduler thread.

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from typing import Any

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_duplicate", "lock_lost",
           "lock_parked", "lock_released", "send"]

#: A locked task took its lock. Arguments: ``name``, ``fence``, ``task_id``,
#: ``wait`` (seconds spent acquiring).
lock_acquired = Signal(name="dlock_lock_acquired")

#: A locked task found its lock held elsewhere (or Redis unreachable). Arguments:
#: ``name``, ``policy`` (retry, wait, skip, raise or a callable's name), ``holder``
#: (a :class:`celery_dlock.Holder` or None), ``task_id``, ``error`` (the exception).
lock_contended = Signal(name="dlock_lock_contended")

#: A locked task released its lock when its attempt ended. Arguments: ``name``,
#: ``fence``, ``task_id``, ``held_for`` (seconds), ``state`` (how the attempt ended:
#: SUCCESS, FAILURE, RETRY, IGNORED, REJECTED).
lock_released = Signal(name="dlock_lock_released")

#: A running task's lock was found lost (expired or taken). Arguments: ``name``,
#: ``fence``, ``task_id``, ``reason``.
lock_lost = Signal(name="dlock_lock_lost")


#: An enqueue found its lock name already queued (or running, or throttled), or
#: replaced the queued call (sent by the producer). Arguments: ``name``, ``task_id``
#: (the new call's id), ``existing`` (the other call's id, None when the holder is not
#: a task), ``mode`` (the lock_mode), ``policy`` (return_existing, raise, drop or
#: replace: what the new call got).
lock_duplicate = Signal(name="dlock_lock_duplicate")

#: A call over its ``lock_rate`` was parked: re-queued for its slot (sent from the
#: worker, before any lock is taken). Arguments: ``name``, ``task_id``, ``delay``
#: (seconds to its slot), ``rate`` (as written, ``"5/s"``).
lock_parked = Signal(name="dlock_lock_parked")


def send(signal: Signal, sender: Any, name: str, **arguments: Any) -> Any:
    """Send ``signal`` about the lock ``name``."""
    return signal.send(sender=sender, name=name, **arguments)
