"""Reading the locks held in Redis (for ``celery dlock`` and metrics): the Redis
backend's functions under the name they had before the backends got folders of their
own (:mod:`celery_dlock.backends.redis.inspect`).  New code asks a backend
(:func:`celery_dlock.task.backend.backend_for`) instead."""

from __future__ import annotations

from ..backends.redis.inspect import (
    SUMMARY_FIELDS,
    HoldChanged,
    LockInfo,
    force_release,
    get_lock,
    iter_locks,
    lock_name_of,
    node_clients,
    scan_pattern,
    waiting_counts,
)

__all__ = [
    "SUMMARY_FIELDS",
    "HoldChanged",
    "LockInfo",
    "force_release",
    "get_lock",
    "iter_locks",
    "lock_name_of",
    "node_clients",
    "scan_pattern",
    "waiting_counts",
]
