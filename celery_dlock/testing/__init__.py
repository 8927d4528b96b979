"""Fixtures for your own tests of locked tasks: a pytest plugin, opt-in.

In your ``conftest.py``::

    pytest_plugins = ["celery_dlock.testing"]

then::

    def test_a_held_stock_is_skipped(dlock_eager, dlock_hold, dlock_events):
        dlock_eager(app)                              # eager, with the real lock
        with dlock_hold(app, "stock:42"):             # as another worker would
            result = reduce_stock.apply_async((42,), on_contention="skip").get()
        assert is_skipped(result)
        assert dlock_events.skipped("stock:42")

The fixtures (:mod:`celery_dlock.testing.plugin`): ``dlock_redis``, ``dlock_hold``,
``dlock_events`` and ``dlock_eager``.  Importing this package needs pytest; nothing
else of celery-dlock imports it.
"""

from __future__ import annotations

from .eager import EAGER_SETTINGS, Eager
from .events import KINDS, Event, EventLog
from .holds import HeldLock, Holds
from .plugin import (
    REDIS_URL_VARIABLE,
    dlock_eager,
    dlock_events,
    dlock_hold,
    dlock_redis,
)

__all__ = [
    "EAGER_SETTINGS",
    "KINDS",
    "REDIS_URL_VARIABLE",
    "Eager",
    "Event",
    "EventLog",
    "HeldLock",
    "Holds",
    "dlock_eager",
    "dlock_events",
    "dlock_hold",
    "dlock_redis",
]
