"""celery-dlock's own signals, in Celery's style (``celery.utils.dispatch.Signal``).

Connect like any Celery signal::

    from celery_dlock import signals

    @signals.lock_contended.connect
    def count_contention(sender, key, policy, holder, **kwargs):
        metrics.increment("contention", tags={"task": sender.name, "policy": policy})

``sender`` is the task instance.  Every signal also passes ``key`` (the lock name) and
``task_id``.  ``lock_lost`` is sent from the heartbeat thread.

This module imports nothing from the rest of the package.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = ["lock_acquired", "lock_contended", "lock_lost", "lock_released"]

#: A locked task took its lock. Arguments: ``key``, ``fence``, ``task_id``,
#: ``wait`` (seconds spent acquiring).
lock_acquired = Signal(name="dlock_lock_acquired")

#: A locked task found its lock held elsewhere (or Redis unreachable). Arguments:
#: ``key``, ``policy`` (retry, wait, skip, raise or a callable's name), ``holder``
#: (a :class:`celery_dlock.Holder` or None), ``task_id``, ``error`` (the exception).
lock_contended = Signal(name="dlock_lock_contended")

#: A locked task released its lock when its attempt ended. Arguments: ``key``,
#: ``fence``, ``task_id``, ``held_for`` (seconds), ``state`` (how the attempt ended:
#: SUCCESS, FAILURE, RETRY, IGNORED, REJECTED).
lock_released = Signal(name="dlock_lock_released")

#: A running task's lock was found lost (expired or taken). Arguments: ``key``,
#: ``fence``, ``task_id``, ``reason``.
lock_lost = Signal(name="dlock_lock_lost")
