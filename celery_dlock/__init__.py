"""celery-dlock: reentrant, renewed, owner-checked Redis locks for Celery tasks.

The lock core (:class:`RedisLock`) works without Celery::

    from celery_dlock import RedisLock

    with RedisLock(redis.Redis(), "report:2026-11", ttl=30):
        build_report()
"""

from __future__ import annotations

from .errors import (
    BackendUnavailable,
    DLockError,
    Holder,
    InvalidLockConfig,
    LockLost,
    LockNotAcquired,
    LockNotOwned,
    UnkeyableArgument,
)
from .lock import RedisLock
from .owner import owner_context

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable",
    "DLockError",
    "Holder",
    "InvalidLockConfig",
    "LockLost",
    "LockNotAcquired",
    "LockNotOwned",
    "RedisLock",
    "UnkeyableArgument",
    "__version__",
    "owner_context",
]
