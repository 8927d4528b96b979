"""celery-dlock: reentrant, renewed, owner-checked Redis locks for Celery tasks.

On a task::

    @app.task(base=LockedTask, bind=True, lock_key="stock:{product_id}")
    def reduce_stock(self, product_id, qty=1): ...

The lock core (:class:`RedisLock`) works without Celery::

    from celery_dlock import RedisLock

    with RedisLock(redis.Redis(), "report:2026-11", ttl=30):
        build_report()
"""

from __future__ import annotations

from .backends.redis.lock import RedisLock
from .backends.redis.redlock.lock import RedlockLock
from .backends.redis.semaphore import RedisSemaphore
from .core.errors import (
    BackendUnavailable,
    DLockError,
    FencingUnavailable,
    Holder,
    InvalidLockConfig,
    LockKeyConflict,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    UnkeyableArgument,
)
from .core.owner import owner_context
from .task import signals
from .task.backend import lock_from_url
from .task.contention import ACQUIRED, Contention, is_skipped
from .task.duplicates import DROPPED, AlreadyQueued, DroppedResult
from .task.locked_task import LockedTask, LockLostInterrupt

__version__ = "0.1.0"

__all__ = [
    "ACQUIRED",
    "DROPPED",
    "AlreadyQueued",
    "BackendUnavailable",
    "Contention",
    "DLockError",
    "DroppedResult",
    "FencingUnavailable",
    "Holder",
    "InvalidLockConfig",
    "LockKeyConflict",
    "LockLost",
    "LockLostInterrupt",
    "LockNotAcquired",
    "LockNotOwned",
    "LockedTask",
    "RedisLock",
    "RedisSemaphore",
    "RedlockLock",
    "UnkeyableArgument",
    "__version__",
    "is_skipped",
    "lock_from_url",
    "owner_context",
    "signals",
]
