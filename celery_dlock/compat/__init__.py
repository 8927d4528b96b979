"""One-import migration from celery-once and celery-singleton (docs/migrating.md).

``from celery_once import QueueOnce, AlreadyQueued`` and ``from celery_singleton
import Singleton, DuplicateTaskError, clear_locks`` become imports from here; the
tasks keep their options, which are translated to celery-dlock's own.
"""

from __future__ import annotations

from ..task.duplicates import AlreadyQueued
from .clear import Removed, clear_locks
from .once import QueueOnce
from .singleton import DuplicateTaskError, Singleton

__all__ = [
    "AlreadyQueued",
    "DuplicateTaskError",
    "QueueOnce",
    "Removed",
    "Singleton",
    "clear_locks",
]
